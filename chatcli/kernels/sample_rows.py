"""The sample_rows kernel: every row's next token from its logits in one call.

Owns: the wrapper of decode_ops.c's sample_rows (temperature, top-k, top-p and a uniform
draw a row: sampling.sample_next_token's choice), its float64 reference and check, and
`sample_rows()`, the checked kernel or None. Any CPU with a C compiler.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from chatcli.kernels.build import checked
from chatcli.kernels.rows_library import DECODE_OPS_SOURCE


class SampleRows:
    """The loaded sample_rows (kernels/decode_ops.c): every row's next token in one call."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.sample_rows
        fn.restype = ctypes.c_int  # 0, or -1 where it decided nothing
        fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_float]
        fn.argtypes += [ctypes.c_long, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
        self._fn = fn

    @staticmethod
    def takes(
        logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
    ) -> bool:
        """Whether the kernel decides these: fp32 rows on the CPU, a temperature above 0,
        and top-p only inside a top-k (the kernel sorts no more than top-k's candidates)."""
        nucleus = top_p is not None and 0.0 < top_p < 1.0
        restricted = top_k is not None and 0 < top_k < logits.size(-1)
        return (
            logits.device.type == "cpu"
            and logits.dtype == torch.float32
            and logits.dim() == 2
            and temperature > 0.0
            and (restricted or not nucleus)
        )

    def __call__(
        self,
        logits: torch.Tensor,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        u: torch.Tensor,
    ) -> torch.Tensor | None:
        """logits (B, V) fp32 and the rows' draws u (B, 1) in [0, 1) -> token ids (B, 1), or
        None where a row's logits hold NaN or no finite value (torch's ops decide those)."""
        if not self.takes(logits, temperature, top_k, top_p):
            raise ValueError("sample_rows takes fp32 CPU rows, temperature > 0, top-p in top-k")
        logits = logits.contiguous()
        u = u.to(torch.float32).contiguous()
        out = torch.empty(logits.size(0), 1, dtype=torch.long)
        status = self._fn(
            logits.data_ptr(), logits.size(0), logits.size(1), temperature, top_k or 0,
            top_p if top_p is not None else 1.0, u.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        return out if status == 0 else None


def _reference_cdf(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The candidates' running sums (B, candidates) in float64, in sample_rows' order (top-k's
    strongest first, else the vocabulary's), and their tokens (None: the vocabulary's)."""
    x = logits.double()
    idx = None
    if top_k is not None and 0 < top_k < x.size(-1):
        x, idx = torch.topk(x, top_k, dim=-1)
    probs = torch.softmax(x / temperature, dim=-1)
    if top_p is not None and 0.0 < top_p < 1.0:
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
    return probs.cumsum(-1), idx


def reference_sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    u: torch.Tensor,
) -> torch.Tensor:
    """sample_rows' choice in float64 torch ops: the candidates in the same order (top-k's
    strongest first, else the vocabulary's), the first whose running sum exceeds u times
    their total (the load check's answer)."""
    cdf, idx = _reference_cdf(logits, temperature, top_k, top_p)
    choice = torch.searchsorted(cdf, u.double() * cdf[:, -1:], right=True)
    choice = choice.clamp_(max=cdf.size(-1) - 1)
    return idx.gather(1, choice) if idx is not None else choice


# How near a boundary between two tokens a draw may fall on either: the kernel sums fp32
# probabilities in its vectors' order (4, 8 or 16 lanes), the reference in float64, and a
# draw within rounding of a boundary may land on its other side (4 lanes: 3e-7 of the total).
BOUNDARY_SLACK = 1e-5


def agrees(
    got: torch.Tensor,
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    u: torch.Tensor,
) -> bool:
    """Whether the kernel's tokens `got` (B, 1) are the reference's, or differ only where
    the draw is within BOUNDARY_SLACK of the total from every boundary between the two."""
    want = reference_sample(logits, temperature, top_k, top_p, u)
    cdf, idx = _reference_cdf(logits, temperature, top_k, top_p)
    for r in (got != want).nonzero()[:, 0].tolist():
        order = idx[r] if idx is not None else torch.arange(cdf.size(-1))
        at = [int((order == t).nonzero()[0, 0]) for t in (got[r, 0], want[r, 0]) if t in order]
        if len(at) < 2:
            return False
        target = float(u[r, 0]) * float(cdf[r, -1])
        between = cdf[r, min(at) : max(at)]
        if (between - target).abs().max() > BOUNDARY_SLACK * float(cdf[r, -1]):
            return False
    return True


def check_sample_rows(kernel: SampleRows) -> None:
    """The kernel against reference_sample on random rows, for each kind of restriction: a
    library that chooses otherwise (beyond rounding at a boundary: agrees) is not used
    (RuntimeError)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 1000, generator=g) * 3
    u = torch.rand(32, 1, generator=g)
    for temperature, top_k, top_p in [(1.0, None, None), (0.6, 50, None), (0.8, 40, 0.9)]:
        got = kernel(logits, temperature, top_k, top_p, u)
        if got is None or not agrees(got, logits, temperature, top_k, top_p, u):
            raise RuntimeError(
                f"sample_rows disagrees with torch at temperature {temperature}, top-k {top_k}, "
                f"top-p {top_p}"
            )


@functools.cache
def sample_rows() -> SampleRows | None:
    """The compiled, checked kernel, or None where it cannot run here (unavailable_reason)."""
    return checked(
        "sample_rows", DECODE_OPS_SOURCE, SampleRows, check_sample_rows, needs_avx512=False
    )
