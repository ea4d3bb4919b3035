"""Prompt-lookup speculative decoding: a row drafts from its own history, one forward verifies.

Owns: Drafter (an index of a row's n-grams: the tokens that followed the latest earlier
occurrence of its last n tokens, n = NGRAM_MAX down to NGRAM_MIN), Verified (one verify forward's
logits and the drafts they assume), and Speculation (one row's drafting: the logits its next
token comes from, the cache rewound past a rejected draft, the counts, and the back-off that
stops drafting for a row whose drafts are rarely taken), and SlotVerifier (a server's slot
row verified in its slot). Knows nothing of sampling, budgets
or the calculator: the scheduler's per-row policy takes each token from a verified row of
logits exactly as from a decode step's, and Speculation only says whether the next row is
still the model's (the token taken was the draft) or must be computed.

Why it is exact: the verify forward's logits at position i are the model's for the prefix
through draft i, and they are used only while every token taken equals its draft. Each token
is drawn from the model's own distribution with the row's own draw, the one plain decode
would use, so greedy and seeded replies are the plain ones. For a point-mass draft this is
the standard speculative rule (take draft d with probability p(d), else a token from p with d
removed), drawn in one step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from chatcli.model.kv_cache import KVCache
from chatcli.model.slot_cache import SlotCache, SlotRows

# The n-grams a row's last tokens are looked up by, longest first. One token alone matches
# too often by chance in open-ended text: its drafts were mostly rejected.
NGRAM_MAX = 3
NGRAM_MIN = 2
# Drafts a verification takes at most: the verify forward runs DRAFT_TOKENS + 1 positions.
DRAFT_TOKENS = 6
# Back-off: after WINDOW verifications whose tokens plain steps would have given in less time
# (with GAIN to spare), the row decodes PAUSE tokens plainly, then after each such one
# verification twice as many (up to PAUSE_MAX), until one pays. A verification's cost in
# plain steps is measured on the CPU (a small model's several rows cost several steps; a big
# model's, about one: its weights are read once); VERIFY_COST until measured, and on a GPU,
# where a call returns before its work ends.
WINDOW = 2
PAUSE = 48
PAUSE_MAX = 2048
GAIN = 1.1
VERIFY_COST = 2.0
TIME_EVERY = 4  # a plain step in this many is timed


def _average(mean: float | None, seconds: float) -> float:
    """A moving average of a call's seconds: the latest counts a quarter."""
    return seconds if mean is None else 0.75 * mean + 0.25 * seconds


class VerifyRunner(Protocol):
    """What drafting needs from whoever runs the model (the Engine)."""

    def forward_last(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor: ...

    def forward_verify(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor: ...


class RowsRunner(VerifyRunner, Protocol):
    """What a slot's verification needs besides: the step over slot rows."""

    @property
    def takes_prompt_rows(self) -> bool: ...

    def forward_rows(
        self, ids: torch.Tensor, rows: SlotRows, out: list[int] | None = None
    ) -> torch.Tensor: ...


class SlotVerifier:
    """A server's slot row run as a row of its own drafts: a plain step as the slots' step,
    a verification as rows of its slot (where the runner takes a prompt's rows: one pass over
    the weights), else through the model's forward over the slot's cache."""

    def __init__(self, runner: RowsRunner, cache: SlotCache, slot: int) -> None:
        self.runner, self.cache, self.slot = runner, cache, slot

    def forward_last(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return self.runner.forward_rows(ids, SlotRows(self.cache, [self.slot]))

    def forward_verify(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if self.runner.takes_prompt_rows:
            rows = SlotRows(self.cache, [self.slot] * ids.size(1))
            return self.runner.forward_rows(ids.view(-1, 1), rows)
        return self.runner.forward_verify(ids, cache)


class Drafter:
    """A row's tokens and, for each n-gram in them, where the latest one that has a token
    after it ends: a lookup of the row's last n tokens is one dict read, not a scan. The
    index catches up at each draft, so a row that is not drafting (paused) pays a list
    append a token."""

    def __init__(self, tokens: list[int]) -> None:
        self.history: list[int] = list(tokens)
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> index of its follower
        self._indexed = 0  # tokens whose n-grams before them are in _after

    def append(self, token: int) -> None:
        self.history.append(token)

    def _catch_up(self) -> None:
        h, after = self.history, self._after
        for t in range(max(self._indexed, 1), len(h)):
            # the n-grams that end just before token t have it as their follower
            for n in range(NGRAM_MIN, min(NGRAM_MAX, t) + 1):
                after[tuple(h[t - n : t])] = t
        self._indexed = len(h)

    def draft(self, k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the row's last NGRAM_MAX
        tokens (else of fewer); [] where none occurred before. A copy that runs into the
        row's end goes on with what it drafted, as an overlapping copy does (a repeating
        run drafts its next k, not the few tokens left before the end)."""
        self._catch_up()
        h = self.history
        for n in range(min(NGRAM_MAX, len(h)), NGRAM_MIN - 1, -1):
            at = self._after.get(tuple(h[-n:]))
            if at is not None:
                end = len(h)
                drafts = h[at : at + k]
                while len(drafts) < k:
                    drafts.append(drafts[at + len(drafts) - end])
                return drafts
        return []


@dataclass
class Verified:
    """One verify forward: logits (k + 1, V) of `line`, the row's last token and its drafts,
    written from cache position `base` on."""

    logits: torch.Tensor
    line: torch.Tensor  # (1, k + 1) ids
    drafts: list[int]
    base: int
    used: int = 0  # rows of logits taken so far


@dataclass
class SpeculationCounts:
    """A row's drafting so far: verify forwards, drafts they checked, drafts taken."""

    verifications: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verification(self) -> float:
        """Tokens each verify forward gave: the drafts taken and the model's own next one."""
        if not self.verifications:
            return 0.0
        return (self.accepted + self.verifications) / self.verifications


class Speculation:
    """One row's drafting (a generation of one row in a cache of its own)."""

    def __init__(
        self, drafter: Drafter, counts: SpeculationCounts | None = None, timed: bool = True
    ) -> None:
        """timed: whether a call's time is its work's (the CPU's; a GPU's call returns
        before its work is done): the back-off weighs a verification by its measured cost."""
        self.drafter = drafter
        self.timed = timed
        self._plain = -1  # plain steps so far, less one: the first is timed
        self.counts = counts if counts is not None else SpeculationCounts()
        self.pending: Verified | None = None
        self._window: list[int] = []  # drafts taken by the last verifications
        self._pause_left = 0
        self._next_pause = PAUSE
        # Seconds of a plain step and of a verification (moving averages; CPU only).
        self._step_s: float | None = None
        self._verify_s: float | None = None

    def logits(
        self, runner: VerifyRunner, ids: torch.Tensor, cache: KVCache, room: int, queued: list[int]
    ) -> torch.Tensor:
        """Logits (1, V) for the row's next token, ids (1, 1) its last token not yet in the
        cache: the next verified row where the drafts so far were taken; else one verify
        forward of the last token and up to `room` drafts (`queued`: tokens the row will take
        anyway, the calculator's, drafted first); else a plain decode step."""
        p = self.pending
        if p is not None:
            return p.logits[p.used : p.used + 1]
        drafts = self.plan(cache, room, queued)
        if not drafts:
            # A plain step's time is sampled, not taken every step: on a small model a
            # step is a few hundred microseconds, and each clock read costs.
            self._plain += 1
            if not self.timed or self._plain % TIME_EVERY:
                return runner.forward_last(ids, cache)
            t0 = time.perf_counter()
            logits = runner.forward_last(ids, cache)
            self._step_s = _average(self._step_s, time.perf_counter() - t0)
            return logits
        base = cache.get_pos()
        line = self.line(drafts, ids.device)
        t0 = time.perf_counter()
        logits = runner.forward_verify(line, cache)
        if self.timed:
            self._verify_s = _average(self._verify_s, time.perf_counter() - t0)
        self.record(logits, line, drafts, base)
        return logits[0:1]

    def plan(self, cache: KVCache, room: int, queued: list[int]) -> list[int]:
        """The drafts to verify at this step (up to `room`, the cache's room and
        DRAFT_TOKENS; `queued` first), or [] for a plain step: none found, or a pause."""
        room = min(room, DRAFT_TOKENS, cache.max_seq_len - cache.get_pos() - 1)
        drafts = queued[:room] if queued else []
        if not drafts and self._pause_left > 0:
            self._pause_left -= 1
        elif not drafts and room > 0:
            drafts = self.drafter.draft(room)
        return drafts

    def line(self, drafts: list[int], device: torch.device) -> torch.Tensor:
        """(1, 1 + len(drafts)): the row's last token, not yet in the cache, then the drafts:
        the positions one verification runs."""
        return torch.tensor([[self.drafter.history[-1], *drafts]], dtype=torch.long, device=device)

    def record(
        self, logits: torch.Tensor, line: torch.Tensor, drafts: list[int], base: int
    ) -> None:
        """A verification ran `line` from cache position `base`: logits (len(line), V), one
        row a position. The next tokens are drawn from them while the drafts are taken."""
        self.pending = Verified(logits, line, drafts, base)

    def verified(self) -> torch.Tensor | None:
        """The next verified row of logits (1, V), while the drafts so far were taken."""
        p = self.pending
        return None if p is None else p.logits[p.used : p.used + 1]

    def took(self, token: int, cache: KVCache, last: bool) -> None:
        """The row took `token` (from the logits `logits` gave); `last`: nothing more is drawn
        for it (it stopped, or the budget is spent). Where the token was not the draft the next
        verified row assumed, or none is left, the cache is rewound to hold what plain decode
        would have written: every token but this one."""
        self.drafter.append(token)
        p = self.pending
        if p is None:
            return
        i = p.used  # drafts taken before this token
        p.used += 1
        hit = i < len(p.drafts) and token == p.drafts[i]
        if hit and not last:
            return
        self.pending = None
        cache.rewind(p.base + 1 + i, p.line[:, i])  # the token at i: the first, or draft i
        # The drafts compared with a token taken: those past a reply's end never were.
        c = self.counts
        c.verifications += 1
        c.drafted += min(len(p.drafts), i + 1)
        c.accepted += i + hit
        self._back_off(i + hit)

    def settle(self, cache: KVCache) -> None:
        """The row ends (or is left) while verified logits wait: rewind the cache to what
        plain decode would hold, every token taken but the last."""
        p = self.pending
        if p is None:
            return
        self.pending = None
        taken = p.used  # every one of them its draft, or it would not be pending
        cache.rewind(p.base + taken, p.line[:, taken - 1])

    @property
    def verify_cost(self) -> float:
        """A verification's time in plain steps: measured, else VERIFY_COST."""
        if self._step_s is None or self._verify_s is None:
            return VERIFY_COST
        return self._verify_s / self._step_s

    def _back_off(self, taken: int) -> None:
        """Stop drafting for a while where the last WINDOW verifications gave fewer tokens
        (the drafts taken and the model's own) than plain steps would have in their time;
        after a pause, one such verification is enough to pause again (twice as long)."""
        self._window.append(taken)
        if len(self._window) < (WINDOW if self._next_pause == PAUSE else 1):
            return
        tokens = sum(self._window) + len(self._window)
        if tokens < GAIN * self.verify_cost * len(self._window):
            self._pause_left = self._next_pause
            self._next_pause = min(2 * self._next_pause, PAUSE_MAX)
        else:
            self._next_pause = PAUSE
        self._window.clear()
