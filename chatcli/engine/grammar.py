"""Structured output: a JSON schema's grammar as each row's token mask.

Owns: turning a JSON schema into a grammar the library can run (`json_grammar`, refusing
what it cannot express, naming the keyword), the grammar library's view of a tokenizer
(built once per tokenizer), and `RowsGrammar`: one generation's matchers, a row each, whose
next masks are computed on a thread of their own while the model's step runs (llguidance
releases the GIL), then applied to the rows' logits before the one sampler draws. The
reply ends with <|assistant_end|>, the only token a finished grammar allows.

The grammar library is llguidance, an optional extra, imported at first use (docs/serving.md
says why it over xgrammar). Knows nothing of HTTP or of text beyond the tokenizer's bytes.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from chatcli.errors import SchemaError
from chatcli.model.data_files import UnreadableFileError, read_json_file, shown
from chatcli.model.special_tokens import ASSISTANT_END

STRUCTURED_EXTRA = "pip install 'chatcli[structured]'"
SCHEMA_MAX_BYTES = 1 << 20  # far past any schema a reply follows

# How the JSON is written: one space after ':' and ',' and no other whitespace. A model
# that never wrote JSON would otherwise be free to pad a reply with blanks until the budget
# ends it. A schema's own "x-guidance" options override these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# An integer the schema leaves unbounded is kept to JSON's exactly representable ones (RFC
# 7493's I-JSON, what JavaScript reads without rounding): a model that never wrote JSON
# would otherwise go on adding digits until the budget cuts the reply.
SAFE_INTEGER = 2**53 - 1
# A schema's keywords whose values are JSON data, not schemas.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})

# Any JSON object: OpenAI's {"type": "json_object"}.
ANY_OBJECT: dict[str, Any] = {"type": "object"}

# Masks measured dearer than this are computed on a thread while the step runs; cheaper ones
# at once, as a thread's hand-off (submit, wake, wait) costs about this much itself.
THREAD_ABOVE_S = 50e-6

_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit j of a mask's word: token 32 w + j
_threads: ThreadPoolExecutor | None = None
_tokenizers: dict[int, tuple[Any, Any]] = {}  # id(Encoding) -> (Encoding, LLTokenizer)
_lock = threading.Lock()


def import_llguidance() -> Any:
    """llguidance, or one line saying how to install it."""
    try:
        import llguidance
    except ImportError:
        raise SchemaError(
            f"Structured output needs the structured extra: {STRUCTURED_EXTRA}"
        ) from None
    return llguidance


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar (llguidance's JSON text) of replies that are `schema`'s JSON (None: any
    JSON object). A SchemaError names what the grammar library cannot express."""
    llguidance = import_llguidance()
    schema = ANY_OBJECT if schema is None else schema
    if not isinstance(schema, dict):
        raise SchemaError(
            f"A JSON schema is a JSON object, not {type(schema).__name__}: "
            'write it as {"type": "object", "properties": {...}}.'
        )
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            bounded(schema), defaults=JSON_STYLE
        )
    except (ValueError, TypeError) as e:
        raise SchemaError(f"The JSON schema cannot be read: {e}.") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise SchemaError(
            f"The JSON schema uses what structured output cannot enforce ({_first_line(messages)}):"
            " leave that keyword out or express it with properties, enum or a pattern."
        )
    return grammar


def bounded(schema: Any) -> Any:
    """`schema` with each integer it leaves unbounded kept within +-SAFE_INTEGER."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else bounded(v) for k, v in schema.items()}
    kinds = out.get("type")
    if kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out


def read_schema(path: Path) -> dict[str, Any]:
    """The JSON Schema in the file at `path` (an UnreadableFileError, or a SchemaError where
    it is not a JSON object)."""
    try:
        schema = read_json_file(path, SCHEMA_MAX_BYTES)
    except UnreadableFileError as e:
        raise SchemaError(f"The JSON Schema file {e}: give the path of a schema file.") from None
    except ValueError as e:
        raise SchemaError(
            f"{path} is not readable JSON: {e}. Write the schema as a JSON object."
        ) from None
    if not isinstance(schema, dict):
        raise SchemaError(
            f"{path} holds {shown(schema, 40)}, not a JSON Schema object: write it as "
            '{"type": "object", "properties": {...}}.'
        )
    return schema


def _first_line(messages: list[str]) -> str:
    text = " ".join(messages).strip() or "an invalid schema"
    return text.splitlines()[0][:200]


def grammar_tokenizer(tokenizer: Any) -> Any:
    """llguidance's tokenizer for a chatcli Tokenizer (its tiktoken Encoding), with
    <|assistant_end|> as the end of a reply. Built once per tokenizer: it takes about a
    second for a 65536-token vocabulary."""
    llguidance = import_llguidance()
    from llguidance.tiktoken import lltokenizer_from_encoding

    encoding = getattr(tokenizer, "enc", None)
    if encoding is None:
        raise SchemaError(
            "Structured output needs the model's tiktoken tokenizer (tokenizer.pkl); this "
            "model's tokenizer has none."
        )
    with _lock:
        kept = _tokenizers.get(id(encoding))
        if kept is None or kept[0] is not encoding:
            end = tokenizer.encode_special(ASSISTANT_END)
            built = lltokenizer_from_encoding(encoding, n_vocab=encoding.n_vocab, eos_token=end)
            kept = _tokenizers[id(encoding)] = (encoding, built)
    assert isinstance(kept[1], llguidance.LLTokenizer)
    return kept[1]


def _mask_threads() -> ThreadPoolExecutor:
    global _threads
    with _lock:
        if _threads is None:
            _threads = ThreadPoolExecutor(
                max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="chatcli-grammar"
            )
        return _threads


class RowsGrammar:
    """One generation's rows under one grammar: a matcher a row, and the next step's allowed
    tokens as a bitmask (rows, ceil(V / 32)) int32, bit j of word w for token 32 w + j.

    The masks are computed between the rows' last tokens and the sampler's need of them:
    at once while that is measured cheaper than a thread's hand-off (THREAD_ABOVE_S, the
    common case: a JSON schema's mask takes microseconds), else on a thread while the model's
    step runs, the step's time hiding it."""

    def __init__(self, tokenizer: Any, grammar: str, rows: int, end: int) -> None:
        llguidance = import_llguidance()
        self.matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(rows)]
        error = self.matchers[0].get_error() if self.matchers[0].is_error() else ""
        if error:
            raise SchemaError(f"The grammar cannot run: {_first_line([error])}.")
        self.end = end
        self.vocab = tokenizer.vocab_size
        self.bitmask = torch.zeros((rows, (self.vocab + 31) // 32), dtype=torch.int32)
        self._live = [True] * rows
        self._next: Future[None] | None = None  # the masks a thread computes
        self._stale = True  # the masks are the last step's, not yet computed anew
        self.background = False  # whether the masks are computed on a thread
        self.fill_s = 0.0  # the last masks' time, where computed at once

    def _fill(self) -> None:
        bitmask = self.bitmask
        size = bitmask.size(1) * bitmask.element_size()
        for i, matcher in enumerate(self.matchers):
            if self._live[i]:
                row = bitmask[i]
                matcher.unsafe_compute_mask_ptr(row.data_ptr(), size)  # drops the GIL

    def _ready(self) -> None:
        """The masks of this step, computed now or waited for."""
        if self._next is not None:
            self._next.result()
            self._next = None
        elif self._stale:
            t0 = time.perf_counter()
            self._fill()
            self.fill_s = time.perf_counter() - t0
            self.background = self.fill_s > THREAD_ABOVE_S
        self._stale = False

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (rows, V) with every token the rows' grammars forbid at -inf. Tokens past
        the tokenizer's vocabulary (a padded embedding) are forbidden too."""
        self._ready()
        forbidden = forbidden_tokens(self.bitmask, self.vocab)
        for i, matcher in enumerate(self.matchers):
            # A row that is over draws a filler it does not take; a matcher in error (no
            # sampled token can put it there) ends its row. Either way: one finite logit.
            if not self._live[i] or matcher.is_error():
                forbidden[i] = True
                forbidden[i, self.end] = False
        forbidden = forbidden.to(logits.device, non_blocking=True)
        if logits.size(1) == self.vocab:
            return logits.masked_fill(forbidden, float("-inf"))
        masked = torch.full_like(logits, float("-inf"))  # a padded vocabulary's extra columns
        width = min(logits.size(1), self.vocab)
        masked[:, :width] = logits[:, :width].masked_fill(forbidden[:, :width], float("-inf"))
        return masked

    def advance(self, column: list[int], live: list[bool]) -> None:
        """The rows took `column`: each live row's matcher follows its token; the next masks
        start on a thread where they are dear (the caller runs the step meanwhile)."""
        for i, (matcher, token) in enumerate(zip(self.matchers, column, strict=True)):
            self._live[i] = live[i]
            if live[i]:
                matcher.consume_token(token)
        self._stale = True
        if self.background and any(self._live):
            self._next = _mask_threads().submit(self._fill)


def forbidden_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A (rows, words) int32 bitmask of allowed tokens as (rows, vocab) bools, True where a
    token is forbidden."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS) & 1  # (rows, words, 32)
    return bits.view(bitmask.size(0), -1)[:, :vocab] == 0
