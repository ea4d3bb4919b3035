"""Muon: momentum SGD whose update for a weight matrix is orthogonalized before it is applied.

nanochat trains its block matrices with Muon and everything else (embeddings, lm_head,
scalars) with AdamW; `python -m chatcli.training.train --optimizer muon` does the same for the
embedded model (the default stays AdamW: in a 5-minute trial on this CPU, Muon's extra cost
per step outweighed its lower loss per step; see docs/training.md). The idea: a matrix's
momentum-averaged gradient is dominated by a few directions, so a plain step mostly pushes
along those. Replacing the update G = U S V^T by its nearest semi-orthogonal matrix U V^T
gives every direction the same step size, which nanochat and modded-nanogpt report trains
transformers in fewer steps than AdamW.

U V^T is approximated by a few Newton-Schulz iterations of an odd quintic polynomial,
X <- a X + b (X X^T) X + c (X X^T)^2 X, whose coefficients (3.4445, -4.7750, 2.0315, from
Keller Jordan's Muon write-up) push every singular value of the normalized update into
roughly [0.5, 1.3] in five steps (tests/test_muon.py checks that); exact orthogonality is not
needed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

_QUINTIC = (3.4445, -4.7750, 2.0315)


def orthogonalize(update: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """An approximately semi-orthogonal matrix with the singular vectors of `update`.

    `update` is a matrix or a stack of matrices (..., rows, cols), each orthogonalized alone.
    """
    if update.ndim < 2:
        raise ValueError(f"Muon orthogonalizes matrices; got a {update.ndim}-D tensor")
    a, b, c = _QUINTIC
    x = update.float()
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    # Dividing by the Frobenius norm puts every singular value in [0, 1], where the iteration
    # converges.
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, orthogonalized per matrix, scaled so tall matrices get larger steps.

    Only for 2-D parameters of hidden layers. Embeddings (whose gradients touch only the rows
    of the tokens seen), the output head and scalars belong to AdamW, as in nanochat and
    Muon's own recipe. Matrices of one shape are orthogonalized together as one batch: the
    d6 model's 39 block matrices come in four shapes, so a step makes four orthogonalize
    calls instead of 39.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 0.02,
        momentum: float = 0.95,
        ns_steps: int = 5,
    ) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "ns_steps": ns_steps})
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes only matrices; got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            momentum = group["momentum"]
            by_shape: dict[tuple[int, int], list[torch.nn.Parameter]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    by_shape[tuple(p.shape)].append(p)
            for (rows, cols), params in by_shape.items():
                grads = [p.grad for p in params]
                bufs = [self._momentum_buffer(p) for p in params]
                torch._foreach_lerp_(bufs, grads, 1 - momentum)
                nesterov = torch.stack(grads).lerp_(torch.stack(bufs), momentum)
                updates = orthogonalize(nesterov, group["ns_steps"])
                # An orthogonal update has unit singular values whatever its shape; the
                # sqrt(rows / cols) factor for tall matrices keeps the per-entry step comparable.
                alpha = -group["lr"] * max(1.0, rows / cols) ** 0.5
                torch._foreach_add_(params, list(updates.to(params[0].dtype).unbind()), alpha=alpha)

    def _momentum_buffer(self, p: torch.nn.Parameter) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        return state["momentum_buffer"]
