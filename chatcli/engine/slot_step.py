"""Rows of independent sequences for steps without a step of their own, and their masks.

Owns: forward_slots, any model's forward run a row at a time over its slot of a SlotCache
(the plain answer for models without a decode step that takes slot rows: exact by
construction, as slow as N batch-1 steps), and visible_keys, the mask that shows each row
of a step its own window only (DecodeStep's torch path for slot rows). Knows nothing about
which conversation a slot holds (the scheduler's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from chatcli.model.kv_cache import KVCache
from chatcli.model.slot_cache import SlotRows


def visible_keys(
    positions: list[int], window: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, torch.Tensor]:
    """(first, mask): the keys a step of rows at `positions` reads start at `first` (the
    earliest any row's window reaches), and mask (N, 1, 1, keys) adds -inf where row i must
    not look: past its own position, or before its window (i - window <= j <= i)."""
    starts = [max(0, p - window) for p in positions]
    first, last = min(starts), max(positions)
    j = torch.arange(first, last + 1, device=device)
    pos = torch.tensor(positions, device=device).unsqueeze(1)
    start = torch.tensor(starts, device=device).unsqueeze(1)
    hidden = (j > pos) | (j < start)  # (N, keys)
    mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    return first, mask.view(len(positions), 1, 1, -1)


def forward_slots(
    forward_last: Callable[[torch.Tensor, KVCache], torch.Tensor],
    ids: torch.Tensor,
    rows: SlotRows,
    out: list[int] | None = None,
) -> torch.Tensor:
    """Any model's step for slot rows: forward_last(ids (1, 1), slot's cache) a row at a
    time, in order (the Engine's forward_last, whatever model and step it runs), the logits
    of the rows `out` names (None: all) stacked (len(out), V). Exact by construction, as
    slow as N batch-1 steps."""
    logits = [forward_last(ids[i : i + 1], view) for i, view in enumerate(rows.views)]
    if out is not None and not out:  # a prompt's chunk that does not end it: no logits
        return logits[0][:0]
    return torch.cat(logits if out is None else [logits[i] for i in out])
