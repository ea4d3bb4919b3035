"""The f16_rows kernel: up to 8 fp32 rows times an fp16 matrix packed in panels.

Owns: the wrapper of f16_rows.c (quantize.Fp16Weight reads a few rows of a copy through
it), its check against torch, and `f16_rows()`, the checked kernel or None. x86 with AVX2,
F16C and FMA, or AVX-512; arm64 with NEON.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from chatcli.kernels.build import KERNELS_DIR, checked
from chatcli.kernels.panels import HalfPanels

F16_ROWS_SOURCE = KERNELS_DIR / "f16_rows.c"


class F16Rows:
    """The loaded f16_rows: 1 to `max_rows` fp32 rows times an fp16 matrix packed once in
    panels of `panel` columns (pack)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.f16_rows
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 2
        self._fn.argtypes += [ctypes.c_long] * 2 + [ctypes.c_int]
        self.panel = int(library.f16_rows_panel())
        self.max_rows = int(library.f16_rows_max())

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether this kernel takes `weight` (N, K): whole panels of columns."""
        return weight.dim() == 2 and weight.size(0) % self.panel == 0 and weight.size(1) > 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight (N, K) -> its fp16 panels as the kernel reads them (N * K halves)."""
        if not self.fits(weight):
            raise ValueError(f"f16_rows takes (N, K) with N a multiple of {self.panel}")
        return HalfPanels.of(weight.t(), self.panel).panels

    def __call__(self, panels: torch.Tensor, x: torch.Tensor, out: int) -> torch.Tensor:
        """panels from pack() of an (out, K) matrix, x (M, K) -> fp32 (M, out), M <=
        max_rows, on torch's current threads."""
        rows, k = x.shape
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"f16_rows takes 1 to {self.max_rows} rows, not {rows}")
        if panels.dtype != torch.float16 or panels.numel() != out * k or out % self.panel:
            raise ValueError(f"f16_rows: panels of {panels.numel()} halves for {out}x{k}")
        x = x.to(torch.float32).contiguous()
        y = torch.empty(rows, out, dtype=torch.float32)
        threads = torch.get_num_threads()
        self._fn(x.data_ptr(), rows, panels.data_ptr(), y.data_ptr(), out, k, threads)
        return y


def check_f16_rows(kernel: F16Rows) -> None:
    """The kernel against torch for every row count it takes (RuntimeError if it differs)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(kernel.panel * 6, 40, generator=g).half()
    panels = kernel.pack(weight)
    for rows in range(1, kernel.max_rows + 1):
        x = torch.randn(rows, weight.size(1), generator=g)
        if not torch.allclose(kernel(panels, x, weight.size(0)), x @ weight.float().t(),
                              atol=1e-4, rtol=1e-4):  # fmt: skip
            raise RuntimeError(f"f16_rows disagrees with torch for {rows} rows")


@functools.cache
def f16_rows() -> F16Rows | None:
    """The compiled, checked kernel, or None where it cannot run here (unavailable_reason):
    x86 with AVX2, F16C and FMA, or AVX-512; arm64."""
    return checked("f16_rows", F16_ROWS_SOURCE, F16Rows, check_f16_rows, needs_avx512=False)
