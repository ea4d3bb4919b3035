"""The f16_matvec kernel: one fp32 row times an fp16 matrix, a big model's batch-1 product.

Owns: the wrapper of f16_matvec.c (quantize.Fp16Weight reads a copy through it), its check
against torch, and `f16_matvec()`, the checked kernel or None. On x86 AVX-512 only (the CPU
it was written for; fbgemm's kernel serves the others); on arm64 NEON's.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from chatcli.kernels.build import KERNELS_DIR, checked

SOURCE = KERNELS_DIR / "f16_matvec.c"


class F16Matvec:
    """The loaded f16_matvec: rows of `rows` and inputs of `step` at a time."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.f16_matvec
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_int]
        self.rows = int(library.f16_matvec_rows())
        self.step = int(library.f16_matvec_step())

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether this kernel takes `weight` (N, K): whole blocks of rows and of inputs."""
        n, k = weight.shape
        return n % self.rows == 0 and k % self.step == 0

    def __call__(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """weight (N, K) fp16 contiguous, x (K,) -> fp32 (N,), on torch's current threads."""
        n, k = weight.shape
        if weight.dtype != torch.float16 or not weight.is_contiguous() or not self.fits(weight):
            raise ValueError(f"f16_matvec takes a contiguous fp16 (N, K) matrix, not {weight}")
        x = x.to(torch.float32).contiguous()
        if x.shape != (k,):
            raise ValueError(f"f16_matvec: input of shape {tuple(x.shape)}, matrix {n}x{k}")
        y = torch.empty(n, dtype=torch.float32)
        self._fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), n, k, torch.get_num_threads())
        return y


def check_f16_matvec(kernel: F16Matvec) -> None:
    """The kernel against torch on a small random matrix: a library that answers wrongly is
    not used (RuntimeError)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(kernel.rows * 24, kernel.step * 10, generator=g).half()
    x = torch.randn(weight.size(1), generator=g)
    want = weight.float() @ x
    got = kernel(weight, x)
    if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
        raise RuntimeError("f16_matvec disagrees with torch on a test matrix")


@functools.cache
def f16_matvec() -> F16Matvec | None:
    """The compiled, checked kernel, or None where it cannot run here (unavailable_reason)."""
    return checked("f16_matvec", SOURCE, F16Matvec, check_f16_matvec, needs_avx512=True)
