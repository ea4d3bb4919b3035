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
    logprobs: torch.Tensor,
    picked: torch.Tensor | None,
    column: Sequence[int],
    masks: Sequence[int],
    top: int,
) -> list[TokenLogprob]:
    """Each row's entry for its token of this step: logprobs (R, V) from `distributions`,
    picked (R, 1): the tokens drawn for the rows, on the device (None: nothing was drawn),
    and the rows' tokens and masks. A row of mask 1 took its drawn token; one of mask 0 was
    forced (or is a finished row's filler), and the model's odds are not reported for it."""
    if picked is None or not any(masks):
        return [TokenLogprob(token, None) for token in column]
    # Small host reads rather than one of a concatenation: on a CPU each op costs more than
    # the read (a few microseconds), and on a GPU these come after the draw's own read.
    chosen = logprobs.gather(1, picked)[:, 0].tolist()
    values: list[list[float]] = [[] for _ in column]
    indices: list[list[int]] = [[] for _ in column]
    if top > 0:
        best = logprobs.topk(min(top, logprobs.size(-1)), dim=-1)
        values, indices = best.values.tolist(), best.indices.tolist()
    out = []
    for token, mask, lp, vs, ids in zip(column, masks, chosen, values, indices, strict=True):
        if mask == 0:
            out.append(TokenLogprob(token, None))
        else:
            out.append(TokenLogprob(token, lp, tuple(zip(ids, vs, strict=True))))
    return out
