"""Which device `--device auto` runs a model on where a machine has an Apple GPU (MPS) beside
its CPU: our C kernels on the CPU, or torch's MPS ops.

Owns: choose_apple_device (a pure decision from the model's size and what runs here, with
the reason the banner shows) and apple_device (the same, asked of this machine). Knows
nothing about loading a model.

Why by size: a decode step is ~150-300 small ops. Our CPU kernels run a small model's whole
step as one call (the embedded model: 12-16x torch's eager ops on a CPU), while MPS pays a
launch per op (tens of microseconds: more than a small model's step takes on the CPU
kernels). A big model's step instead streams its weights, and on Apple Silicon the GPU
reaches more of the shared memory's bandwidth than the CPU cores do (on Max and Ultra parts,
about twice). Neither side was measured on a Mac here: MPS_MIN_MATRIX_PARAMS is set high so
that MPS is picked only where its advantage is the memory's, which is large, and never for
a model our kernels run and MPS would only slow; `--device mps` or `cpu` chooses by hand.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

# At and above this many matrix weights (the decode step's stream; embedding tables not
# counted) a model goes to MPS on `--device auto`: d20 (~480M) stays on our CPU kernels.
MPS_MIN_MATRIX_PARAMS = 1_000_000_000
# Below this, a model's step is dispatch-bound wherever it runs: torch's CPU ops launch in
# microseconds, MPS's in tens, so even without our kernels the CPU is the faster.
SMALL_MATRIX_PARAMS = 16_000_000


@dataclass(frozen=True)
class DeviceChoice:
    """Where `--device auto` runs a model, and why (for the banner)."""

    device: str  # "cpu" or "mps"
    why: str


def choose_apple_device(
    matrix_params: int, cpu_kernels: bool, mps: bool, mps_bf16: bool
) -> DeviceChoice:
    """cpu or mps for a model of `matrix_params` weights on a machine where our decode
    kernels loaded (cpu_kernels) or not, with an MPS device (mps) that computes in bf16 or
    not (macOS before 14): a model that big needs 16-bit weights, and fp32 on MPS reads twice
    the bytes the CPU's fp16 copies do."""
    size = f"{matrix_params / 1e6:,.0f}M weights"
    if not mps:
        return DeviceChoice("cpu", "no Apple GPU that torch can use")
    if matrix_params < SMALL_MATRIX_PARAMS:
        how = "our C kernels" if cpu_kernels else "torch's CPU ops"
        return DeviceChoice("cpu", f"{how}: a small model's step costs less than MPS's launches")
    if matrix_params < MPS_MIN_MATRIX_PARAMS and cpu_kernels:
        return DeviceChoice("cpu", f"our C kernels: faster than MPS for {size}")
    if not mps_bf16:
        return DeviceChoice("cpu", "MPS here has no bf16 (macOS 14 or later has)")
    if matrix_params >= MPS_MIN_MATRIX_PARAMS:
        return DeviceChoice("mps", f"MPS: {size} stream faster from the GPU")
    return DeviceChoice("mps", "MPS: our C kernels are not built here")


def on_apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def apple_device(matrix_params: int) -> DeviceChoice:
    """choose_apple_device asked of this machine (builds our decode kernel once to learn
    whether it runs here: the CPU path needs it anyway)."""
    from chatcli.kernels.rows_step import rows_step

    mps = getattr(torch.backends, "mps", None)
    available = mps is not None and mps.is_available()
    bf16 = available and bool(getattr(mps, "is_macos_or_newer", lambda *_: False)(14, 0))
    return choose_apple_device(matrix_params, rows_step() is not None, available, bf16)
