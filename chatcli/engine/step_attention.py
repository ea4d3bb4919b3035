"""The fused decode step's attention: one new query a row over the keys its cache holds.

Owns: writing a step's keys and values into a cache and attending over them, for plain rows
(each its own cached keys), for sample rows over a shared prompt (the prompt's part and
each row's own part, combined exactly) and for rows of independent sequences (each its own
slot of a SlotCache, at its own position, under a mask). Knows nothing about the rest of the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chatcli.engine.step_matrices import run_on_threads
from chatcli.model.attention import attend_shared
from chatcli.model.kv_cache import KVCache, SharedPrefixCache
from chatcli.model.slot_cache import SlotCache


def attend_rows(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    cache: KVCache,
    pos: int,
    threads: int,
) -> torch.Tensor:
    """q (N, H, D), k/v (N, Hkv, D) -> (N, H, D), over each row's own cached keys."""
    k_cache, v_cache = cache.get_layer_cache(layer)  # (N, T, Hkv, D)
    k_cache[:, pos] = k
    v_cache[:, pos] = v
    start = max(0, pos - window)
    return run_on_threads(
        threads,
        F.scaled_dot_product_attention,
        q.unsqueeze(2),
        k_cache[:, start : pos + 1].transpose(1, 2),
        v_cache[:, start : pos + 1].transpose(1, 2),
        enable_gqa=q.size(1) != k.size(1),
    )


def attend_slots(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: SlotCache,
    slots: torch.Tensor,
    pos: torch.Tensor,
    first: int,
    mask: torch.Tensor,
    threads: int,
) -> torch.Tensor:
    """q (N, H, D), k/v (N, Hkv, D) -> (N, H, D) for rows of independent sequences: row i's
    key and value written to slot slots[i] at position pos[i], then its query over that
    slot's keys from `first` on under `mask` (N, 1, 1, keys: slot_step.visible_keys), which
    hides what lies past the row's position or before its window."""
    k_all, v_all = cache.k_cache[layer], cache.v_cache[layer]  # (slots, T, Hkv, D)
    k_all[slots, pos] = k
    v_all[slots, pos] = v
    last = first + mask.size(-1)
    n = slots.numel()
    if slots.tolist() == list(range(n)):  # the first n slots: a view, nothing gathered
        keys, values = k_all[:n, first:last], v_all[:n, first:last]
    else:
        keys, values = k_all[slots, first:last], v_all[slots, first:last]
    return run_on_threads(
        threads,
        F.scaled_dot_product_attention,
        q.unsqueeze(2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        enable_gqa=q.size(1) != k.size(1),
    ).squeeze(2)


def attend_over_prefix(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    cache: SharedPrefixCache,
    pos: int,
    threads: int,
) -> torch.Tensor:
    """The rows' own suffixes plus the one shared prompt, as model.attend_shared does it,
    in two fused attention calls instead of ~25 small ops.

    Each call also returns the log-sum-exp of its scores, and two partial softmaxes
    combine exactly: out = lerp(out_suffix, out_prefix, sigmoid(lse_prefix - lse_suffix)).
    The query heads that share a K/V head become extra query positions, so both calls
    see plain multi-head shapes (the prefix call takes all N rows' queries at once).
    """
    N, H, D = q.shape
    Hkv = k.size(1)
    r = H // Hkv
    P = cache.prefix_len
    pk, pv = cache.prefix.get_layer_cache(layer)  # (1, Tp, Hkv, D)
    sk, sv = cache.suffix.get_layer_cache(layer)  # (N, Ts, Hkv, D)
    s = pos - P
    sk[:, s] = k
    sv[:, s] = v
    start = max(0, pos - window)
    if q.device.type != "cpu":  # the fused kernel below is the CPU one
        return attend_shared(
            q.unsqueeze(1),
            pk[:, min(start, P) : P],
            pv[:, min(start, P) : P],
            sk[:, max(0, start - P) : s + 1],
            sv[:, max(0, start - P) : s + 1],
        ).view(N, H, D)
    qg = q.view(N, Hkv, r, D)
    out_s, lse_s = run_on_threads(
        threads,
        attention_with_lse,
        qg,
        sk[:, max(0, start - P) : s + 1].transpose(1, 2),
        sv[:, max(0, start - P) : s + 1].transpose(1, 2),
    )
    if start >= P:  # the window no longer reaches the prompt
        return out_s.reshape(N, H, D)
    qp = qg.transpose(0, 1).reshape(1, Hkv, N * r, D)
    out_p, lse_p = run_on_threads(
        threads,
        attention_with_lse,
        qp,
        pk[:, start:P].transpose(1, 2),
        pv[:, start:P].transpose(1, 2),
    )
    out_p = out_p.view(Hkv, N, r, D).transpose(0, 1)
    lse_p = lse_p.view(Hkv, N, r).transpose(0, 1)
    weight = torch.sigmoid(lse_p - lse_s.view(N, Hkv, r)).unsqueeze(-1).to(out_s.dtype)
    return torch.lerp(out_s.view(N, Hkv, r, D), out_p, weight).reshape(N, H, D)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention (B, Hkv, Lq, D) x (B, Hkv, Lk, D) and the log-sum-exp of its scores
    (B, Hkv, Lq), through the CPU flash kernel that computes both."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    return out, lse
