"""The nanochat tokenizer: safe loading of `tokenizer.pkl`, encoding, and chat rendering.

Owns: turning text into ids and back, the special tokens' ids, and rendering a conversation
(system/user/assistant messages, assistant calculator calls) into the special-token sequence
nanochat models were trained on. Knows nothing about models, tensors or the terminal.

`tokenizer.pkl` is a pickled `tiktoken.Encoding`. A plain `pickle.load` would run whatever code
the file names, so it is read with a restricted unpickler that can only rebuild an Encoding
from its plain state (name, pat_str, mergeable_ranks, special_tokens) and refuses any other
global before anything is called.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import tiktoken

from chatcli.errors import TokenizerError
from chatcli.model.data_files import UnreadableFileError, read_bytes, shown
from chatcli.model.long_runs import encode_ordinary
from chatcli.model.special_tokens import (
    ASSISTANT_END,
    ASSISTANT_START,
    BOS,
    OUTPUT_END,
    OUTPUT_START,
    PYTHON_END,
    PYTHON_START,
    SPECIAL_TOKENS,
    USER_END,
    USER_START,
)

Message = dict[str, Any]

# The split pattern nanochat's tokenizer uses (GPT-4 style, numbers in groups of 1-2 digits).
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s+"""
)
# GPT-4's own (numbers in groups of 1-3), which nanochat's is made from and forks train with.
GPT4_SPLIT_PATTERN = SPLIT_PATTERN.replace(r"\p{N}{1,2}", r"\p{N}{1,3}")
# The embedded model's: single digits, and a word never takes the character before it
# (chatcli.training.train says why).
COPY_SPLIT_PATTERN = SPLIT_PATTERN.replace(r"\p{N}{1,2}", r"\p{N}").replace(
    r"[^\r\n\p{L}\p{N}]?+\p{L}+", r"\p{L}+"
)
# The patterns a tokenizer may split with. Each splits any text in linear time once long
# runs of blanks go around it (long_runs.py, which relies on their shared whitespace
# alternatives); another pattern can backtrack without end, and a pattern tiktoken's regex
# engine cannot run panics it on ordinary input, where Python sees no error to catch.
KNOWN_SPLIT_PATTERNS = (SPLIT_PATTERN, GPT4_SPLIT_PATTERN, COPY_SPLIT_PATTERN)
# Far past any tokenizer.pkl (a 65536-token one is about 1 MB): more is something else.
TOKENIZER_MAX_BYTES = 256 << 20


class _Refused(pickle.UnpicklingError):
    """The pickle asked for something a tokenizer file never needs."""


class _EncodingState:
    """Stands in for tiktoken.Encoding while unpickling: it only records the pickled state."""

    def __init__(self, *args: object) -> None:
        if args:
            raise _Refused("unexpected constructor arguments for Encoding")
        self.state: object = None

    def __setstate__(self, state: object) -> None:
        self.state = state


class _RestrictedUnpickler(pickle.Unpickler):
    # tiktoken pickles an Encoding as NEWOBJ(tiktoken.core.Encoding) + BUILD(state dict).
    # That single class is the only global a tokenizer file may name.
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in {("tiktoken.core", "Encoding"), ("tiktoken", "Encoding")}:
            return _EncodingState
        raise _Refused(f"refused to load global {module}.{name}")

    def persistent_load(self, pid: object) -> Any:
        raise _Refused("persistent ids are not allowed")


def _check_memo_indices(data: bytes) -> None:
    """Refuse a memo index past every object the pickle could have made by then: the C
    unpickler grows its memo to the index a PUT names, so 9 bytes (LONG_BINPUT 2**30) would
    ask for 8 GB. Reads the opcodes only (pickletools: nothing built)."""
    for count, (op, arg, _) in enumerate(pickletools.genops(data)):
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and arg > count:
            raise _Refused(f"a memo index ({arg}) past anything the file builds")


def _read_encoding_state(path: Path) -> dict[str, Any]:
    try:
        data = read_bytes(path, TOKENIZER_MAX_BYTES)
    except UnreadableFileError as e:
        if e.missing:
            raise TokenizerError(
                f"No tokenizer file at {path}. A nanochat model needs its tokenizer.pkl "
                "(in <base dir>/tokenizer/ or beside the model_*.pt file)."
            ) from None
        raise TokenizerError(f"Tokenizer file {e}. Copy the model's tokenizer.pkl again.") from None
    try:
        _check_memo_indices(data)
        obj = _RestrictedUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise TokenizerError(
            f"Refused to load tokenizer {path}: {e}. A nanochat tokenizer.pkl holds only a "
            "tiktoken Encoding; this file asks for more, so it was not loaded (nothing in it ran)."
        ) from e
    except Exception as e:  # truncated or garbage bytes surface as many exception types
        raise TokenizerError(
            f"Tokenizer file {path} is corrupt or truncated ({type(e).__name__}: {e})."
        ) from e
    state = obj.state if isinstance(obj, _EncodingState) else None
    keys = {"name", "pat_str", "mergeable_ranks", "special_tokens"}
    if not isinstance(state, dict) or not keys <= state.keys():
        raise TokenizerError(
            f"Tokenizer file {path} does not hold a tiktoken Encoding state "
            f"(expected keys {sorted(keys)})."
        )
    ranks, specials = state["mergeable_ranks"], state["special_tokens"]
    if not (
        isinstance(state["pat_str"], str)
        and isinstance(ranks, dict)
        and all(isinstance(k, bytes) and isinstance(v, int) for k, v in ranks.items())
        and isinstance(specials, dict)
        and all(isinstance(k, str) and isinstance(v, int) for k, v in specials.items())
    ):
        raise TokenizerError(f"Tokenizer file {path} has a malformed Encoding state.")
    # tiktoken's Rust core panics (past any `except Exception`) on an id given twice.
    ids = [*ranks.values(), *specials.values()]
    if len(set(ids)) != len(ids):
        twice = next(i for i, n in Counter(ids).items() if n > 1)
        raise TokenizerError(
            f"Tokenizer file {path} gives the id {twice} to more than one token: it is "
            "damaged. Copy the model's tokenizer.pkl again."
        )
    return state


class EncodingParts(NamedTuple):
    """What a tiktoken Encoding is made of: its split pattern, its merges and its special
    tokens (what nanochat pickles, what an export converts)."""

    pat_str: str
    mergeable_ranks: dict[bytes, int]
    special_tokens: dict[str, int]


def encoding_parts(encoding: tiktoken.Encoding) -> EncodingParts:
    """An Encoding's parts. tiktoken keeps them as private attributes and offers no public
    way to read them back; this is the one place that reads them."""
    return EncodingParts(
        encoding._pat_str, encoding._mergeable_ranks, encoding._special_tokens
    )  # fmt: skip


def _check_pattern(pattern: str, what: str) -> None:
    if pattern not in KNOWN_SPLIT_PATTERNS:
        raise TokenizerError(
            f"{what} splits text with the pattern {shown(pattern, 90)}, which is not one "
            "nanochat uses: refused, since another pattern can crash tiktoken on ordinary "
            "text. Use the tokenizer.pkl saved with the model."
        )


class Tokenizer:
    """A tiktoken Encoding with nanochat's special tokens and chat rendering."""

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        parts = encoding_parts(encoding)
        _check_pattern(parts.pat_str, "The tokenizer")
        missing = [t for t in SPECIAL_TOKENS if t not in parts.special_tokens]
        if missing:
            raise TokenizerError(f"Tokenizer lacks nanochat special tokens: {', '.join(missing)}.")
        self.enc = encoding
        self._special = {name: parts.special_tokens[name] for name in SPECIAL_TOKENS}
        self._special_by_id = {i: name for name, i in self._special.items()}

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a nanochat `tokenizer.pkl` safely (see module docstring)."""
        path = Path(path)
        state = _read_encoding_state(path)
        _check_pattern(state["pat_str"], f"Tokenizer file {path}")  # before tiktoken compiles it
        try:
            encoding = tiktoken.Encoding(
                name=str(state["name"]),
                pat_str=state["pat_str"],
                mergeable_ranks=state["mergeable_ranks"],
                special_tokens=state["special_tokens"],
            )
        except Exception as e:  # tiktoken validates ranks/pattern and raises various types
            raise TokenizerError(f"Tokenizer file {path} is malformed: {e}") from e
        return cls(encoding)

    @classmethod
    def from_ranks(
        cls,
        mergeable_ranks: dict[bytes, int],
        name: str = "rustbpe",
        pattern: str = SPLIT_PATTERN,
    ) -> Tokenizer:
        """Build from trained merges, appending the 9 special tokens as the last ids."""
        n = len(mergeable_ranks)
        specials = {tok: n + i for i, tok in enumerate(SPECIAL_TOKENS)}
        enc = tiktoken.Encoding(
            name=name,
            pat_str=pattern,
            mergeable_ranks=mergeable_ranks,
            special_tokens=specials,
        )
        return cls(enc)

    def save(self, path: str | Path) -> None:
        """Write a `tokenizer.pkl` that nanochat (and this module) can load."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(self.enc, f)

    # ---- ids and text -------------------------------------------------------------------

    def get_vocab_size(self) -> int:
        return self.enc.n_vocab

    def get_bos_token_id(self) -> int:
        return self._special[BOS]

    def encode_special(self, name: str) -> int:
        try:
            return self._special[name]
        except KeyError:
            raise TokenizerError(f"Unknown special token {name!r}.") from None

    def special_name(self, token_id: int) -> str | None:
        """The special token's name for an id, or None for ordinary tokens."""
        return self._special_by_id.get(token_id)

    def encode(self, text: str, prepend: int | str | None = None) -> list[int]:
        """Encode ordinary text: a user typing "<|bos|>" gets plain text, never the token."""
        ids = encode_ordinary(self.enc, text)  # any text, long runs of blanks included
        if prepend is not None:
            first = prepend if isinstance(prepend, int) else self.encode_special(prepend)
            ids.insert(0, first)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode(list(ids))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Raw bytes, for streaming decoders that must not split a UTF-8 character."""
        return self.enc.decode_bytes(list(ids))

    # ---- conversations ------------------------------------------------------------------

    def render_conversation(
        self, conversation: Sequence[Message] | dict[str, Any], max_tokens: int | None = None
    ) -> tuple[list[int], list[int]]:
        """Render a whole conversation to (ids, mask) as nanochat's SFT does.

        mask is 1 on the tokens an assistant wrote (its text, its calculator calls and its
        closing <|assistant_end|>) and 0 elsewhere, including the calculator outputs that the
        engine injects: a model learns to call the tool, never to invent its result.
        """
        messages = _merge_system(_messages_of(conversation))
        ids: list[int] = [self.get_bos_token_id()]
        mask: list[int] = [0]

        def add(tokens: Iterable[int], m: int) -> None:
            tokens = list(tokens)
            ids.extend(tokens)
            mask.extend([m] * len(tokens))

        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            expected = "user" if i % 2 == 0 else "assistant"
            if role != expected:
                raise TokenizerError(
                    f"Message {i} has role {role!r}; messages must alternate user/assistant "
                    "(an optional system message first)."
                )
            if role == "user":
                if not isinstance(content, str):
                    raise TokenizerError(f"Message {i}: user content must be a string.")
                add([self._special[USER_START]], 0)
                add(self.encode(content), 0)
                add([self._special[USER_END]], 0)
            else:
                add([self._special[ASSISTANT_START]], 0)
                for part in _assistant_parts(content, i):
                    kind, text = part["type"], part["text"]
                    if kind == "text":
                        add(self.encode(text), 1)
                    elif kind == "python":
                        add([self._special[PYTHON_START]], 1)
                        add(self.encode(text), 1)
                        add([self._special[PYTHON_END]], 1)
                    else:  # python_output: forced by the tool at inference, so not learned
                        add([self._special[OUTPUT_START]], 0)
                        add(self.encode(text), 0)
                        add([self._special[OUTPUT_END]], 0)
                add([self._special[ASSISTANT_END]], 1)
        if max_tokens is not None:
            ids, mask = ids[:max_tokens], mask[:max_tokens]
        return ids, mask

    def render_for_completion(self, conversation: Sequence[Message] | dict[str, Any]) -> list[int]:
        """Ids for a conversation ending in a user message, followed by <|assistant_start|>."""
        messages = _merge_system(_messages_of(conversation))
        if not messages or messages[-1].get("role") != "user":
            raise TokenizerError("A conversation to complete must end with a user message.")
        ids, _ = self.render_conversation(messages)
        ids.append(self._special[ASSISTANT_START])
        return ids


def _messages_of(conversation: Sequence[Message] | dict[str, Any]) -> list[Message]:
    if isinstance(conversation, dict):
        conversation = conversation.get("messages", [])
    return list(conversation)


def _merge_system(messages: list[Message]) -> list[Message]:
    # nanochat has no system role: the system text is prepended to the first user message.
    if not messages or messages[0].get("role") != "system":
        return messages
    system, rest = messages[0], messages[1:]
    if not rest or rest[0].get("role") != "user":
        raise TokenizerError("A system message must be followed by a user message.")
    merged = {"role": "user", "content": f"{system.get('content', '')}\n\n{rest[0]['content']}"}
    return [merged, *rest[1:]]


def _assistant_parts(content: object, index: int) -> list[dict[str, str]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise TokenizerError(f"Message {index}: assistant content must be a string or parts.")
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") not in ("text", "python", "python_output")
            or not isinstance(part.get("text"), str)
        ):
            raise TokenizerError(
                f"Message {index}: bad assistant part {part!r}; expected "
                '{"type": "text"|"python"|"python_output", "text": str}.'
            )
    return content
