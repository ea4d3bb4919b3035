"""The fused decode step for rows of independent sequences: a server's conversations at once.

Owns: step_slots, DecodeStep's step for SlotRows (each row its own slot of a SlotCache, at
its own position, with its own rotary angles, previous token and window): through our
kernel's rows_step_slots where it applies (the products of every row in one pass over the
weights, each row's attention over its own keys), else in torch's ops, the rows' keys
written at their positions in one indexed write and read back under a mask that shows each
row its own window only. Also forward_slots, any model's forward run a row at a time over
its slot: the plain answer for models without such a step. Knows nothing about which
conversation a slot holds (the engine's batch.py).

Why rows of different lengths decode in one step: a big model's step streams its weights
from memory once for all rows (8 rows cost about 2 rows' time), and a small model's step is
dispatch, paid once for all rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from chatcli.engine.decode_step import DecodeStep, _soft_cap
from chatcli.engine.step_attention import attend_slots
from chatcli.engine.step_matrices import run_on_threads
from chatcli.kernels.rows_step import rows_step
from chatcli.model.kv_cache import KVCache
from chatcli.model.slot_cache import SlotRows


def step_slots(
    step: DecodeStep, ids: torch.Tensor, rows: SlotRows, out: list[int] | None = None
) -> torch.Tensor:
    """ids (N, 1), row i's token for slot rows.slots[i] -> the logits (len(out), V) of the
    rows `out` names (None: all), each slot advanced by its rows: DecodeStep's arithmetic
    (its _step), every row at its own position; a slot's several rows (a prompt's chunk)
    each attend the ones before it."""
    N = ids.size(0)
    if rows.batch_size != N:
        raise ValueError(f"{N} tokens for {rows.batch_size} rows")
    positions = rows.room(step.model.max_positions)
    device = ids.device
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    cos_table, sin_table = step._rope_tables()
    cos, sin = cos_table[pos], sin_table[pos]  # (N, D): each row's own angles
    idx = ids.view(N)
    prev = rows.previous(idx) if step.smear else None  # -1: a sequence's first token
    cache = rows.cache
    kernel = rows_step() if step._rows_model is not None and device.type == "cpu" else None
    if (
        kernel is not None
        and kernel.has_slots
        and kernel.takes_slots(step._rows_model, (cache.k_cache, cache.v_cache))
    ):
        if step._embed_native:
            x = kernel.embed(step.wte, idx, step._eps, prev, step.smear_gate, step.smear_lambda)
        else:
            x = _embed(step, idx, prev)
        slots = torch.tensor(rows.slots, dtype=torch.long)
        logits = kernel.run_slots(
            step._rows_model, x, idx, cos, sin, slots, pos, (cache.k_cache, cache.v_cache),
            step.wide_threads, out,
        )  # fmt: skip
        rows.advance(idx)
        return logits[:, : step.vocab_size]  # the softcap taken in the kernel
    return _torch_step(step, idx, prev, cos, sin, positions, pos, rows, out)


def _embed(step: DecodeStep, idx: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    """DecodeStep._embed for rows whose previous tokens may be -1 (a sequence's first
    token: no smear, as the model's forward leaves its first position)."""
    if prev is None or bool((prev >= 0).all()):
        return step._embed(idx, prev, step.fold_norms)
    x = step._embed(idx, None, step.fold_norms)
    has = prev >= 0
    smeared = step._embed(idx[has], prev[has], step.fold_norms)
    x[has] = smeared
    return x


def _torch_step(
    step: DecodeStep,
    idx: torch.Tensor,
    prev: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: list[int],
    pos: torch.Tensor,
    rows: SlotRows,
    out: list[int] | None,
) -> torch.Tensor:
    """step_slots through torch's ops: _step's layers with each row's angles and window."""
    N, H, Hkv, D = idx.size(0), step.n_head, step.n_kv_head, step.head_dim
    C = step.wte.size(1)
    fold = step.fold_norms
    # Every head of a row turns by the row's angle: (N * (H + Hkv), D), as _qk_v lays them.
    cos, sin = cos.repeat_interleave(H + Hkv, 0), sin.repeat_interleave(H + Hkv, 0)
    slots = torch.tensor(rows.slots, dtype=torch.long, device=idx.device)
    rows.cache.make_finite(rows.slots, max(positions) + 1)  # the keys the masks hide
    masks: dict[int, tuple[int, torch.Tensor]] = {}  # window -> (first key, mask)
    x = _embed(step, idx, prev)
    x0 = x
    saved = None
    for i, layer in enumerate(step.layers):
        if step.lambdas:
            x = torch.add(x * layer.resid_lambda, x0, alpha=layer.x0_lambda)
        qk, v = step._qk_v(layer, x, idx, cos, sin, fold)
        if layer.window not in masks:
            masks[layer.window] = visible_keys(positions, layer.window, x.dtype, x.device)
        first, mask = masks[layer.window]
        y = attend_slots(
            i, qk[:, :H], qk[:, H:], v, rows.cache, slots, pos, first, mask, step.wide_threads
        )
        x = step._mlp(layer, layer.proj.addmm(x, y.reshape(N, H * D)), fold)
        if i == step.backout_layer:
            saved = x
    if saved is not None:
        x = torch.add(x, saved, alpha=-step.backout_lambda)
    rows.advance(idx)
    if out is not None:  # only these rows' logits: a prompt's tokens but its last need none
        x = x[out]
    cap = step.softcap
    if fold:  # the last norm joins the softcap's division
        logits = step.lm_head.mm(x)[:, : step.vocab_size]
        scales = step._row_scales(x, times=cap)
        return run_on_threads(step.wide_threads, _soft_cap, logits, cap, scales)
    logits = step.lm_head.mm(F.rms_norm(x, (C,)))[:, : step.vocab_size].float()
    return run_on_threads(step.wide_threads, _soft_cap, logits, cap)


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
