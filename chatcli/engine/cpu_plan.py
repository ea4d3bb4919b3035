"""How to run a model fast on this CPU: threads and weight precision, chosen by model size.

Owns: the decision and applying it. Measured on 2-core machines (docs/performance.md and
`chatcli bench`): a small model is dispatch-bound, and a second OpenMP thread only adds a
fork/join to every tiny op, so torch's ops decode it faster on one thread (our own
kernel, a whole step in one call, picks its threads itself: decode_step); a large model is
bandwidth-bound, so it gets both threads and a 16-bit copy of its matrices (half the bytes
per token).
A long prefill chunk is the exception for a small model: its ops are matrix products over
many rows, which split well, so it runs on every core (prefill_threads).
Also owns ThreadChoice: whether a big model's products and attention run on every core or
on one, chosen while it decodes by the measured step time, since a second thread that must
wait for a core another process holds costs more than it gives (openmp_wait.py). Knows
nothing about generation itself.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# Below this many parameters a decode step is a few hundred microsecond-sized ops.
SMALL_MODEL_PARAMS = 50_000_000
# A prefill chunk of at least this many tokens runs on every core, whatever the model's size:
# below it a second thread gained nothing (docs/performance-notes.md, "Wide prefill").
WIDE_PREFILL_TOKENS = 128


@dataclass(frozen=True)
class CpuPlan:
    threads: int
    reason: str


def available_cores() -> int:
    """The cores this process may run on, at most OMP_NUM_THREADS where the user set it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    limit = os.environ.get("OMP_NUM_THREADS", "").strip()
    if limit.isdigit() and int(limit) > 0:
        cores = min(cores, int(limit))
    return cores


def plan_for(model: torch.nn.Module) -> CpuPlan:
    cores = available_cores()
    n = sum(p.numel() for p in model.parameters())
    if n < SMALL_MODEL_PARAMS:
        return CpuPlan(1, f"{n / 1e6:.1f}M params: dispatch-bound, torch's ops on one thread")
    return CpuPlan(cores, f"{n / 1e6:.0f}M params: bandwidth-bound, {cores} threads")


def apply_cpu_plan(model: torch.nn.Module) -> CpuPlan | None:
    """Set torch's threads for this model; CUDA/MPS models are left alone (returns None)."""
    if next(model.parameters()).device.type != "cpu":
        return None
    plan = plan_for(model)
    torch.set_num_threads(plan.threads)
    return plan


def prefill_threads(tokens: int) -> int:
    """The threads a CPU prefill chunk of `tokens` tokens should have at least: every core
    for a long one, else one (the caller's count stands)."""
    return available_cores() if tokens >= WIDE_PREFILL_TOKENS else 1


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `threads` inside, the caller's count restored after."""
    before = torch.get_num_threads()
    if threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _lower_quartile(times: deque[float]) -> float:
    return sorted(times)[len(times) // 4]


class ThreadChoice:
    """Which of two thread counts a repeated piece of work (a decode step) runs on, chosen
    by its measured time.

    Runs on `preferred` and, after `first_probe` runs and then every `probe_every`, on
    `other` for `probe_len` runs; switches when the best of those beats the lower quartile
    of the last `window` runs on the current count by `margin`. So it settles within a few
    steps, follows a change of load (another process taking a core, or leaving it) within
    `probe_every`, and a probe of the slower count costs at most probe_len/probe_every of
    the time. Call `threads()` before each run and `record()` with its time after.
    """

    def __init__(
        self,
        preferred: int,
        other: int = 1,
        *,
        first_probe: int = 4,
        probe_every: int = 64,
        probe_len: int = 1,
        window: int = 8,
        margin: float = 0.05,
    ) -> None:
        if probe_len < 1 or first_probe < 1 or probe_every < 1:
            raise ValueError("probe_len, first_probe and probe_every must be at least 1")
        self.current, self.other = preferred, other
        self.first_probe, self.probe_every = first_probe, probe_every
        self.probe_len, self.margin = probe_len, margin
        self._recent: deque[float] = deque(maxlen=window)
        self._probe: list[float] = []
        self._runs_since_probe = 0
        self._probed = False
        self._probing = False

    def threads(self) -> int:
        """The thread count the next run should use."""
        return self.other if self._probing else self.current

    def record(self, seconds: float) -> None:
        """The time of the run just made on `threads()`."""
        if not self._probing:
            self._recent.append(seconds)
            self._runs_since_probe += 1
            due = self.probe_every if self._probed else self.first_probe
            self._probing = self.current != self.other and self._runs_since_probe >= due
            return
        self._probe.append(seconds)
        if len(self._probe) < self.probe_len:
            return
        # The best of the probe (its first run may pay for waking the other count's threads)
        # against the lower quartile of the current count's runs, not their median: a shared
        # host's noise only adds time, so a median let one lucky probe win (docs/
        # performance-notes.md, "Thread choice"). A count another process really slows is
        # slow in every run.
        if min(self._probe) < _lower_quartile(self._recent) * (1.0 - self.margin):
            self.current, self.other = self.other, self.current
            self._recent.clear()
            self._recent.append(min(self._probe))
        self._probe.clear()
        self._probing, self._probed, self._runs_since_probe = False, True, 0
