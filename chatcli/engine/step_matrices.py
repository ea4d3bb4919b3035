"""The decode step's weights, repacked: each layer's matrices as one step reads them.

Owns: StepMatrix (one matrix of the step: several modules' stacked into one, a small one's
transposed copy, or the compact decode copies a big model's modules keep) with its products
on the threads the step gives it, and StepLayer (one layer's matrices and constants). Knows
nothing about caches or attention (decode_step.py), nor how the kernel reads them
(DecodeStep._kernel_model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from chatcli.model.gpt import Attention
from chatcli.model.linear import linear, through_copy, weight_major
from chatcli.model.quantize import DecodeWeight

# Elements of a stacked matrix (a copy of its parts): d20's q, k and v are 4.9M (20 MB).
STACK_AT_MOST = 1 << 20

Out = TypeVar("Out")  # what an op run by run_on_threads returns


def run_on_threads(threads: int, op: Callable[..., Out], *args: object, **kwargs: object) -> Out:
    """op(*args, **kwargs) on `threads` threads, the step's own one restored after."""
    if threads == 1:
        return op(*args, **kwargs)
    torch.set_num_threads(threads)
    try:
        return op(*args, **kwargs)
    finally:
        torch.set_num_threads(1)


def _on_product_threads(product: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Run a StepMatrix product on its `threads`, the rest of the step staying on one."""

    @functools.wraps(product)
    def run(self: StepMatrix, *args: torch.Tensor, **kwargs: float) -> torch.Tensor:
        return run_on_threads(self.threads, product, self, *args, **kwargs)

    return run


class StepMatrix:
    """One matrix of the step, several modules' stacked into one (c_q, c_k and c_v), and
    the compact copies (quantize.py) a big model's batch-1 decode reads instead.

    A small model's matrices without copies are stacked into one weight, one product (the
    stacked copy costs little memory and saves ops, which is what a small model's step is
    made of). With compact copies, the model's own stacked copy (the attention's
    qkv_decode_weight) or each module's (model.Linear) serves up to the copy's max_rows
    rows, the fp32 weights more, so no compact copy is duplicated here.

    A small matrix on the CPU also keeps a transposed copy (in, out), taken when the step
    is built, as the stacked one is (a step reads the weights it was built from): rows @ W.T
    read it faster than the (out, in) weight, and so does one row when the output is the
    wider side; `mv` keeps the (out, in) weight where the input is the wider side (the
    MLP's c_proj).
    BLAS's gemv over (out, in) rows takes one short dot product per output, where over
    (in, out) it accumulates whole output rows at full vector width
    (`python scripts/bench_decode_paths.py layouts` measures both).

    threads: how many threads the products run on (DecodeStep sets it each step).
    """

    threads = 1

    def __init__(self, modules: list[torch.nn.Module], stacked_in: Attention | None = None) -> None:
        self.modules = modules
        self.stacked_in = stacked_in  # the attention that may keep the modules' stacked copy
        self.weight: torch.Tensor | None = None  # (out, in)
        self.weight_t: torch.Tensor | None = None  # (in, out), contiguous
        self.vector_from_t = False  # one row reads weight_t (else weight)
        if all(c is None for c in self.copies):
            parts = [m.weight.detach() for m in modules]
            if len(parts) == 1:
                self.weight = parts[0]
            elif sum(p.numel() for p in parts) <= STACK_AT_MOST:
                self.weight = torch.cat(parts)
        w = self.weight
        if w is not None and w.device.type == "cpu" and w.numel() <= STACK_AT_MOST:
            self.weight_t = w.t().contiguous()
            self.vector_from_t = w.size(0) > w.size(1)
            if self.vector_from_t and len(self.modules) > 1:
                self.weight = None  # the stacked (out, in) copy would serve nothing

    @property
    def copy(self) -> DecodeWeight | None:
        """The modules' one stacked copy, read where it is kept (GPT.add_decode_weights)."""
        return None if self.stacked_in is None else self.stacked_in.qkv_decode_weight

    @property
    def copies(self) -> list[DecodeWeight | None]:
        if self.copy is not None:
            return [self.copy]
        return [getattr(m, "decode_weight", None) for m in self.modules]

    @property
    def _plain(self) -> bool:
        """Whether the products read the weights kept here (else the modules or copies)."""
        return self.weight is not None or self.weight_t is not None

    @_on_product_threads
    def mv(self, x: torch.Tensor) -> torch.Tensor:
        """(C,) -> (out,)."""
        if self.vector_from_t:
            return x @ self.weight_t
        if self.weight is not None:
            return torch.mv(self.weight, x)
        return self._by_module(x)

    @_on_product_threads
    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) -> (N, out)."""
        if self.weight_t is not None:
            return x @ self.weight_t
        if self.weight is not None:  # a big fp32 matrix read where it is (model.linear)
            return linear(x, self.weight)
        return self._by_module(x)

    def _by_module(self, x: torch.Tensor) -> torch.Tensor:
        copy = self.copy
        if copy is not None:
            y = through_copy(copy, x)
            if y is not None:
                return y
        out = [m(x) for m in self.modules]
        return out[0] if len(out) == 1 else torch.cat(out, dim=-1)

    def addmv(self, x: torch.Tensor, v: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """x + alpha * (W @ v), one fused op without copies."""
        if self._plain:
            return self._fused_addmv(x, v, alpha)
        return torch.add(x, self.mv(v), alpha=alpha)

    def addmm(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + y @ W.T for rows y (N, in)."""
        if self._plain:
            return self._fused_addmm(x, y)
        return torch.add(x, self.mm(y))

    @_on_product_threads
    def _fused_addmv(self, x: torch.Tensor, v: torch.Tensor, alpha: float) -> torch.Tensor:
        if self.vector_from_t:  # none of nanochat's (attention's c_proj is square)
            return torch.addmm(x.view(1, -1), v.view(1, -1), self.weight_t, alpha=alpha).view(-1)
        return torch.addmv(x, self.weight, v, alpha=alpha)

    @_on_product_threads
    def _fused_addmm(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.weight_t is not None:
            return torch.addmm(x, y, self.weight_t)
        if weight_major(self.weight, y.size(0)):  # decided on the product's threads
            return torch.add(x, linear(y, self.weight))
        return torch.addmm(x, y, self.weight.t())


@dataclass
class StepLayer:
    qkv: StepMatrix  # (H*D + 2*Hkv*D, C): c_q, c_k, c_v stacked
    proj: StepMatrix
    fc: StepMatrix
    fc_proj: StepMatrix
    window: int
    resid_lambda: float
    x0_lambda: float
    ve_table: torch.Tensor | None  # (V, Hkv*D) value embedding, or None
    ve_gate: torch.Tensor | None  # (Hkv, ve_channels)
