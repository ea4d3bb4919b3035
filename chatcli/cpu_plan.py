"""How to run a model fast on this CPU: threads and weight precision, chosen by model size.

Owns: the decision and applying it. Measured on 2-core machines (docs/performance.md and
`chatcli bench`): a small model is dispatch-bound, and a second OpenMP thread only adds a
fork/join to every tiny op, so it decodes faster on one thread; a large model is
bandwidth-bound, so it gets both threads and its matrices in bf16 (half the bytes per token).
Knows nothing about generation itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# Below this many parameters a decode step is a few hundred microsecond-sized ops.
SMALL_MODEL_PARAMS = 50_000_000


@dataclass(frozen=True)
class CpuPlan:
    threads: int
    reason: str


def plan_for(model: torch.nn.Module) -> CpuPlan:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    n = sum(p.numel() for p in model.parameters())
    if n < SMALL_MODEL_PARAMS:
        return CpuPlan(1, f"{n / 1e6:.1f}M params: dispatch-bound, one thread")
    return CpuPlan(cores, f"{n / 1e6:.0f}M params: bandwidth-bound, {cores} threads")


def apply_cpu_plan(model: torch.nn.Module) -> CpuPlan | None:
    """Set torch's threads for this model; CUDA/MPS models are left alone (returns None)."""
    if next(model.parameters()).device.type != "cpu":
        return None
    plan = plan_for(model)
    torch.set_num_threads(plan.threads)
    return plan
