"""Fakes shared by the tests: a byte-level tokenizer and a model whose logits follow a script.

Neither knows anything about real checkpoints. `ByteTokenizer` has the nanochat layout (256
byte ids, then the 9 special tokens in `SPECIAL_TOKENS` order) so the engine's tool-use and
stop logic see real special ids. `ScriptedModel` follows the engine's model protocol
(`config`, `get_device()`, `forward(idx, kv_cache=...)`) and decides each row's next-token
logits with a plain Python function of that row's tokens so far.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from chatcli.chat.stream import TextDelta
from chatcli.model.special_tokens import (
    ASSISTANT_END,
    ASSISTANT_START,
    BOS,
    OUTPUT_END,
    PYTHON_END,
    PYTHON_START,
    SPECIAL_TOKENS,
    USER_END,
    USER_START,
)
from chatcli.model.tokenizer import Tokenizer

N_BYTES = 256
VOCAB_SIZE = N_BYTES + len(SPECIAL_TOKENS)  # 265
SPECIAL_IDS = {name: N_BYTES + i for i, name in enumerate(SPECIAL_TOKENS)}
PEAK = 50.0  # a logit this far above the rest leaves them ~e^-50 of the mass: never drawn
# One user turn asking for the calculator, rendered for completion in the byte layout.
CHAT_PROMPT = [
    SPECIAL_IDS[BOS],
    SPECIAL_IDS[USER_START],
    *b"what is 12*7?",
    SPECIAL_IDS[USER_END],
    SPECIAL_IDS[ASSISTANT_START],
]


class ByteTokenizer:
    """ids 0..255 are UTF-8 bytes; ids 256..264 are the special tokens, in order."""

    def encode(self, text: str, prepend: int | str | None = None) -> list[int]:
        ids = list(text.encode("utf-8"))
        if prepend is not None:
            ids.insert(0, prepend if isinstance(prepend, int) else self.encode_special(prepend))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        out = bytearray()
        for i in ids:
            out += bytes([i]) if i < N_BYTES else SPECIAL_TOKENS[i - N_BYTES].encode("utf-8")
        return bytes(out)

    def encode_special(self, name: str) -> int:
        return SPECIAL_IDS[name]

    def get_bos_token_id(self) -> int:
        return SPECIAL_IDS[SPECIAL_TOKENS[0]]

    def get_vocab_size(self) -> int:
        return VOCAB_SIZE

    # The real tokenizer's rendering of a saved conversation, over these ids.
    _special = SPECIAL_IDS
    render_conversation = Tokenizer.render_conversation


# A script maps one row's continuation (the tokens after the prompt, forced ones included)
# to that row's next-token logits (V,), or to a token id meaning "this token, surely".
Script = Callable[[list[int]], torch.Tensor | int]


@dataclass
class FakeConfig:
    sequence_len: int = 256
    vocab_size: int = VOCAB_SIZE
    n_layer: int = 1
    n_head: int = 1
    n_kv_head: int = 1
    n_embd: int = 4


class ScriptedModel(nn.Module):
    """A model protocol fake: logits come from `script`, K/V are never written.

    It keeps every row's token history across calls. A forward into an empty cache starts a
    new sequence (the engine's batch-1 prefill); when the batch then grows to N rows, the
    single history is copied to each row, as the engine copies the prefill cache. A cache
    kept warm between prompts (a session's, a server worker's) is followed too: a batch-1
    call after sample rows goes on from the cache they forked from, one into a rewound
    cache forgets what lay past its position, and the reply starts after any call of more
    than one token or into a rewound cache (a prompt; decode runs one token a row).
    """

    def __init__(self, script: Script, sequence_len: int = 256) -> None:
        super().__init__()
        self.config = FakeConfig(sequence_len=sequence_len)
        self.script = script
        # The engine reads the cache dtype off the first parameter.
        self.anchor = nn.Parameter(torch.zeros(1))
        self.histories: list[list[int]] = []
        self.prompt_len = 0
        self.calls: list[tuple[int, int]] = []  # (B, T) of every forward

    def get_device(self) -> torch.device:
        return self.anchor.device

    def forward(self, idx: torch.Tensor, kv_cache=None) -> torch.Tensor:
        B, T = idx.shape
        self.calls.append((B, T))
        rows = idx.tolist()
        pos = 0 if kv_cache is None else kv_cache.get_pos()
        if pos == 0:
            self.histories = [list(r) for r in rows]
            self.prompt_len = T
        else:
            prompt = T > 1
            if B == 1 and len(self.histories) > 1:  # back to the cache the rows forked from
                self.histories, prompt = [self.histories[0][:pos]], True
            if len(self.histories) == 1 and B > 1:
                self.histories = [list(self.histories[0]) for _ in range(B)]
            assert len(self.histories) == B, "batch changed mid-sequence"
            if B == 1 and len(self.histories[0]) > pos:  # a rewound cache
                del self.histories[0][pos:]
                prompt = True
            for history, r in zip(self.histories, rows, strict=True):
                history.extend(r)
            if prompt:
                self.prompt_len = len(self.histories[0])
        # (B, T, V): only the last position is scripted; the engine samples nothing else.
        logits = torch.zeros(B, T, self.config.vocab_size)
        for b, history in enumerate(self.histories):
            logits[b, -1] = as_logits(self.script(history[self.prompt_len :]))
        if kv_cache is not None:
            kv_cache.advance(T)
        return logits

    def continuations(self) -> list[list[int]]:
        """Every row's tokens after the prompt, as the model was fed them."""
        return [h[self.prompt_len :] for h in self.histories]


class SlotScriptedModel(nn.Module):
    """ScriptedModel for generations that interleave over many caches, one row each (a
    server's batch runs such a model a row at a time over its slots): each cache keeps its
    own history. A call of more than one token, into an empty cache or into a rewound one
    starts a reply after it. `delay`: seconds a forward takes (time for a client to act)."""

    def __init__(self, script: Script, sequence_len: int = 256, delay: float = 0.0) -> None:
        super().__init__()
        self.config = FakeConfig(sequence_len=sequence_len)
        self.script = script
        self.delay = delay
        self.anchor = nn.Parameter(torch.zeros(1))  # the cache dtype's source
        self.histories: dict[int, list[int]] = {}  # id(cache) -> its tokens
        self.prompt_lens: dict[int, int] = {}

    def get_device(self) -> torch.device:
        return self.anchor.device

    def forward(self, idx: torch.Tensor, kv_cache=None) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        B, T = idx.shape
        assert B == 1 and kv_cache is not None, "one row over its own cache at a time"
        key, pos = id(kv_cache), kv_cache.get_pos()
        history = self.histories.setdefault(key, [])
        prompt = T > 1 or pos == 0 or len(history) != pos
        del history[pos:]
        history.extend(idx[0].tolist())
        if prompt:
            self.prompt_lens[key] = len(history)
        logits = torch.zeros(1, T, self.config.vocab_size)
        logits[0, -1] = as_logits(self.script(history[self.prompt_lens[key] :]))
        kv_cache.prev_token = idx[:, -1]
        kv_cache.advance(T)
        return logits


def as_logits(next_: torch.Tensor | int) -> torch.Tensor:
    if isinstance(next_, torch.Tensor):
        return next_.float()
    return peaked(next_)


def peaked(token: int) -> torch.Tensor:
    logits = torch.zeros(VOCAB_SIZE)
    logits[token] = PEAK
    return logits


# ---- scripts --------------------------------------------------------------------------------


def uniform(generated: list[int]) -> torch.Tensor:
    """Every token equally likely, special tokens included."""
    return torch.zeros(VOCAB_SIZE)


def uniform_bytes(generated: list[int]) -> torch.Tensor:
    """Every byte equally likely, special tokens impossible: a row that never stops."""
    logits = torch.zeros(VOCAB_SIZE)
    logits[N_BYTES:] = float("-inf")
    return logits


def noisy(generated: list[int]) -> torch.Tensor:
    """Fixed pseudo-random logits per continuation: no two steps share an argmax pattern."""
    g = torch.Generator().manual_seed(1_000_003 * len(generated) + sum(generated))
    logits = 3 * torch.randn(VOCAB_SIZE, generator=g)
    logits[N_BYTES:] = float("-inf")
    return logits


def reply(tokens: Sequence[int]) -> Script:
    """Answer with `tokens` in order, then repeat the last one."""
    tokens = list(tokens)

    def script(generated: list[int]) -> int:
        return tokens[min(len(generated), len(tokens) - 1)]

    return script


def tool_call(expr: str, then: Sequence[int]) -> Script:
    """<|python_start|> expr <|python_end|>, then `then` once the tool output is over.

    `then` starts after <|output_end|> when the engine forced an output, or straight after
    <|python_end|> when it forced nothing. While forced tokens stream in, the model's own
    choice is discarded, so what it asks for then does not matter.
    """
    tok = ByteTokenizer()
    call = [SPECIAL_IDS[PYTHON_START], *tok.encode(expr), SPECIAL_IDS[PYTHON_END]]
    then = list(then)
    output_end = SPECIAL_IDS[OUTPUT_END]

    def script(generated: list[int]) -> int:
        if output_end in generated:
            k = len(generated) - generated.index(output_end) - 1
        elif len(generated) < len(call):
            return call[len(generated)]
        else:
            k = len(generated) - len(call)
        return then[min(k, len(then) - 1)]

    return script


# ' done' then <|assistant_end|>: the usual end of a tool-use answer.
DONE = [*ByteTokenizer().encode(" done"), SPECIAL_IDS[ASSISTANT_END]]


def merged(events: list) -> list:
    """Neighbouring TextDeltas joined: how the text was chunked is not the point."""
    out = []
    for e in events:
        if isinstance(e, TextDelta) and out and isinstance(out[-1], TextDelta):
            out[-1] = TextDelta(out[-1].text + e.text)
        else:
            out.append(e)
    return out
