"""Log-probabilities of the tokens a generation produces, and the likeliest alternatives.

Owns: MAX_TOP_LOGPROBS, TokenLogprob (one produced token's log-probability and its top-K alternatives),
LogprobRecord (where Engine.generate appends each step's), and column_logprobs, the one
place the scheduler's loop computes them. The distribution is the model's own after the
logit softcap at temperature 1: log_softmax of the logits the step gave, before
temperature, top-k or top-p reshaped them for the draw (what vLLM reports by default).
A token the calculator forced (mask 0) has no probability: it is marked forced.

Knows nothing about text: token ids and numbers only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the engine, not with the terminal that shows these
    import torch

# OpenAI's limit on top_logprobs; a row asks for 0 to this many alternatives.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One produced token: its log-probability (None: the calculator forced it, the model
    did not choose it) and the `top` likeliest tokens there as (token, logprob), likeliest
    first (empty for a forced token)."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()

    @property
    def forced(self) -> bool:
        return self.logprob is None


@dataclass
class LogprobRecord:
    """Pass one to Engine.generate to read each step's log-probabilities: `columns` gets one
    list a step, an entry a row. `top`: the alternatives each entry lists (0 to 20)."""

    top: int = 0
    columns: list[list[TokenLogprob]] = field(default_factory=list)


def check_top(top: int | None) -> None:
    """A ValueError unless `top` is None (not asked) or 0..MAX_TOP_LOGPROBS."""
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")


def distributions(logits: torch.Tensor) -> torch.Tensor:
    """logits (R, V) -> log-probabilities (R, V) in fp32: the model's distribution at
    temperature 1. Call before sampling: a draw may not leave its logits as they were."""
    return logits.float().log_softmax(dim=-1)


def column_logprobs(
    logprobs: torch.Tensor, column: Sequence[int], masks: Sequence[int], top: int
) -> list[TokenLogprob]:
    """Each row's entry for its token of this step: logprobs (R, V) from `distributions`,
    the rows' tokens and masks. One host read for the whole column."""
    import torch

    rows = len(column)
    ids = torch.tensor(column, dtype=torch.long, device=logprobs.device).clamp_(
        max=logprobs.size(-1) - 1
    )
    chosen = logprobs.gather(1, ids[:, None])  # (R, 1)
    if top > 0:
        values, indices = torch.topk(logprobs, min(top, logprobs.size(-1)), dim=-1)
        both = torch.cat([chosen, values, indices.to(values.dtype)], dim=1).tolist()
    else:
        both = chosen.tolist()
    k = (len(both[0]) - 1) // 2 if rows else 0
    out = []
    for token, mask, row in zip(column, masks, both, strict=True):
        if mask == 0:  # forced, or a finished row's filler: no choice of the model's
            out.append(TokenLogprob(token, None))
            continue
        # The ids went through fp32: exact below 2**24, far past any vocabulary.
        alternatives = tuple((int(i), v) for v, i in zip(row[1 : 1 + k], row[1 + k :], strict=True))
        out.append(TokenLogprob(token, row[0], alternatives))
    return out
