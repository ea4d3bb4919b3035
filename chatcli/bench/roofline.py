"""The memory's bandwidth and the decode rooflines it sets, as `chatcli bench` measures them.

Owns: timing that waits for a GPU's queued work, the streaming read bandwidth of a buffer,
the bytes of weights a batch-1 decode step reads, and a decode run's fractions of the
roofline measured beside it. Knows nothing about the engine or the baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from chatcli.engine.cpu_plan import torch_threads
from chatcli.model.gpt import GPT
from chatcli.model.linear import Linear


def sync_device() -> None:
    """Wait for the current CUDA device's queued work, where CUDA is in use: a timing
    without this measures how fast kernels are queued, not run."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def bandwidth_probe(megabytes: int = 512, device: torch.device | str = "cpu") -> torch.Tensor:
    """A buffer much larger than the caches, for bandwidth_of."""
    return torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)


def bandwidth_of(buffer: torch.Tensor, repeats: int = 5) -> float:
    """Streaming read bandwidth in GB/s: the fastest of `repeats` sums over buffer (after
    one that is not timed)."""
    buffer.sum()
    best = min(timed(lambda: buffer.sum()) for _ in range(repeats))
    return buffer.numel() * buffer.element_size() / best / 1e9


def roofline_fractions(
    decode: Callable[[], float],
    probe: torch.Tensor,
    threads: int,
    weight_bytes: int,
    bf16_bytes: int,
) -> dict[str, float]:
    """One batch-1 decode run (its tok/s) between two bandwidth probes over `probe` on
    `threads` threads, as fractions of the rooflines the faster probe implies for
    weight_bytes and bf16_bytes a token. Why beside the run: this host's memory read 31-36
    GB/s in most spells and 45-65 in others, which can start and end within one bench run,
    so the rounds' best decode and best probe could come from different spells (d20: 0.50
    of a 64.7 GB/s roofline while the decode read its weights at 32). The faster probe
    keeps it conservative where a spell turns during the run."""
    with torch_threads(threads):
        before = bandwidth_of(probe, repeats=3)
    tps = decode()
    with torch_threads(threads):
        gbs = max(before, bandwidth_of(probe, repeats=3)) * 1e9
    return {
        "roofline_paired": tps * weight_bytes / gbs,
        "bf16_roofline_paired": tps * bf16_bytes / gbs,
    }


def timed(fn) -> float:
    sync_device()
    t0 = time.perf_counter()
    fn()
    sync_device()
    return time.perf_counter() - t0


def weight_bytes_per_token(model: GPT) -> int:
    """Bytes of weights a batch-1 decode step reads: every matrix but the embedding tables,
    in the precision decode reads it (its compact decode copy when there is one)."""
    stacked = model.stacked_linears()  # counted in their attention's stacked copy
    total = sum(w.nbytes for w in model.decode_weights())
    for module in model.modules():
        fp32 = isinstance(module, Linear) and module.decode_weight is None
        if fp32 and id(module) not in stacked:
            total += module.weight.numel() * module.weight.element_size()
    return total


def matrix_params(model: GPT) -> int:
    """Weights of every matrix a decode step reads (the embedding tables are looked up)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
