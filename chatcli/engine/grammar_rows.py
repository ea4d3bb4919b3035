"""Each row's grammar: its matcher, and its next token mask applied to its logits.

Owns: `RowsGrammar`, one generation's matchers (a row each) whose masks the Scheduler applies
to the rows' logits before the one sampler draws, then advances with the tokens taken; where
those masks are computed (at once, or on a thread while the model's step runs, llguidance
releasing the GIL); and reading a bitmask as forbidden tokens. A finished grammar allows only
<|assistant_end|>, so the reply ends there. Knows nothing of schemas (grammar.py's) or text.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from chatcli.engine.grammar import first_line, import_llguidance
from chatcli.errors import SchemaError

# Masks measured dearer than this are computed on a thread while the step runs; cheaper ones
# at once: a thread's hand-off (submit, wake, wait) costs tens of microseconds itself, and far
# more where the CPU's cores are all busy (then the thread only waits its turn). Measured as
# the least of a generation's first FILLS_MEASURED masks' times, which a busy machine's
# pauses do not inflate.
THREAD_ABOVE_S = 100e-6
FILLS_MEASURED = 4

# Row b: whether each bit j of the byte b is clear (the mask's token forbidden): a table
# look-up per byte is one op where shifting out the bits takes four.
_FORBIDDEN_BITS_CPU = torch.tensor([[not (b >> j) & 1 for j in range(8)] for b in range(256)])
_FORBIDDEN_BITS: dict[torch.device, torch.Tensor] = {
    _FORBIDDEN_BITS_CPU.device: _FORBIDDEN_BITS_CPU
}
# Grammars kept compiled, the most recently asked for: a server's clients mostly send a few
# schemas again and again.
COMPILED_KEPT = 32

_threads: ThreadPoolExecutor | None = None
_compiled: dict[tuple[int, str], tuple[Any, Any]] = {}  # (id(tokenizer), grammar) -> matcher
_lock = threading.Lock()


def _matcher(tokenizer: Any, grammar: str) -> Any:
    """A new matcher of `grammar`: a copy of the one compiled at its first request (a copy
    takes microseconds, compiling a schema's grammar milliseconds: a batch's requests and
    /samples' rows share a schema)."""
    key = (id(tokenizer), grammar)
    with _lock:
        kept = _compiled.pop(key, None)
        if kept is None or kept[0] is not tokenizer:
            llguidance = import_llguidance()
            # log_level 0: an error is the row's end here (mask), never a line on stderr.
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise SchemaError(f"The grammar cannot run: {first_line([matcher.get_error()])}.")
            kept = (tokenizer, matcher)
        _compiled[key] = kept  # the most recent last
        while len(_compiled) > COMPILED_KEPT:
            _compiled.pop(next(iter(_compiled)))
    return kept[1].deep_copy()


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

    def __init__(
        self, tokenizer: Any, grammar: str, rows: int, end: int, prefix: Sequence[int] = ()
    ) -> None:
        first = _matcher(tokenizer, grammar)
        # A reply going on (/continue): the grammar follows what it wrote so far.
        if prefix and not first.consume_tokens(list(prefix)):
            raise SchemaError(
                "The reply so far does not follow the reply format's schema, so it cannot "
                "go on under it: /retry writes another reply."
            )
        self.matchers = [first.deep_copy() for _ in range(rows)]
        self.end = end
        self.vocab = tokenizer.vocab_size
        self.bitmask = torch.zeros((rows, (self.vocab + 31) // 32), dtype=torch.int32)
        self._live = [True] * rows
        self._next: Future[None] | None = None  # the masks a thread computes
        self._stale = True  # the masks are the last step's, not yet computed anew
        self.background = False  # whether the masks are computed on a thread
        self.fill_s = float("inf")  # the least time the masks took, computed at once
        self._fills = 0  # masks computed at once so far

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
            self.fill_s = min(self.fill_s, time.perf_counter() - t0)
            self._fills += 1
            self.background = self._fills >= FILLS_MEASURED and self.fill_s > THREAD_ABOVE_S
        self._stale = False

    def ready(self) -> torch.Tensor:
        """This step's bitmask (rows, words), computed now or waited for: a row that is over
        (it draws a filler it does not take) or whose matcher failed (no sampled token can do
        that) may only end."""
        self._ready()
        for i, matcher in enumerate(self.matchers):
            if not self._live[i] or matcher.is_error():
                self.bitmask[i] = 0
                self.bitmask[i, self.end // 32] = _bit(self.end % 32)
        return self.bitmask

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (rows, V) with every token the rows' grammars forbid at -inf."""
        return masked_rows([(self, logits)])[0]

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


def masked_rows(
    parts: list[tuple[RowsGrammar | None, torch.Tensor]],
) -> list[torch.Tensor]:
    """Each part's logits (rows, V), with what its grammar forbids at -inf (as they are
    without one); tokens past the tokenizer's vocabulary (a padded embedding) are forbidden
    too. The step's bitmasks cross to the logits' device and unpack together: a GPU gets
    4 KB a row for 32768 tokens, not 32 KB of bools, and a batch's rows one op, not one each."""
    under = [(i, grammar) for i, (grammar, _) in enumerate(parts) if grammar is not None]
    out = [logits for _, logits in parts]
    if not under:
        return out
    device = out[under[0][0]].device
    bitmasks = [grammar.ready() for _, grammar in under]
    vocab = max(grammar.vocab for _, grammar in under)
    both = bitmasks[0] if len(bitmasks) == 1 else torch.cat(bitmasks)
    forbidden = forbidden_tokens(both.to(device, non_blocking=True), vocab)
    at = 0
    for i, grammar in under:
        logits, rows = out[i], grammar.bitmask.size(0)
        mine, at = forbidden[at : at + rows, : grammar.vocab], at + rows
        if logits.size(1) == grammar.vocab:
            out[i] = logits.masked_fill(mine, float("-inf"))
            continue
        masked = torch.full_like(logits, float("-inf"))  # a padded vocabulary's columns
        width = min(logits.size(1), grammar.vocab)
        masked[:, :width] = logits[:, :width].masked_fill(mine[:, :width], float("-inf"))
        out[i] = masked
    return out


def _bit(j: int) -> int:
    """Bit j of an int32 word, as a Python int the word can hold (bit 31 is its sign)."""
    return (1 << j) - (1 << 32 if j == 31 else 0)


def forbidden_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A (rows, words) int32 bitmask of allowed tokens as (rows, vocab) bools, True where a
    token is forbidden."""
    table = _FORBIDDEN_BITS.get(bitmask.device)
    if table is None:
        table = _FORBIDDEN_BITS[bitmask.device] = _FORBIDDEN_BITS_CPU.to(bitmask.device)
    octets = bitmask.view(torch.uint8).long()  # little-endian: token 8 k + j is bit j of k
    return table[octets].view(bitmask.size(0), -1)[:, :vocab]  # (rows, words * 4, 8) first
