"""The GPT's attention arithmetic: causal, windowed, and over a shared prompt's keys.

Owns: attend (causal attention with a sliding window, from any cache position, through one
fused kernel call with a float mask built once per shape) and attend_shared (sample rows over
one shared prefix and their own suffixes, exactly one softmax). Shapes: q (B, Tq, H, D),
k/v (B, Tk, Hkv, D). Knows nothing about caches or weights.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def attend_shared(
    q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor
) -> torch.Tensor:
    """One decode step of N rows over a shared prefix and per-row suffixes, exactly.

    q (N, 1, H, D); pk/pv (1, Lp, Hkv, D), shared; sk/sv (N, Ls, Hkv, D), per row.
    Scores over both key sets go through one softmax (a common max, one denominator), so the
    result equals attention over the concatenated keys. The prefix is read once for all rows:
    its matmuls take the N rows' queries as extra query positions.
    """
    N, _, H, D = q.shape
    Hkv = sk.shape[2]
    r = H // Hkv
    if pk.size(1) == 0:  # a short window that no longer reaches the prompt
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), sk.transpose(1, 2), sv.transpose(1, 2), enable_gqa=r > 1
        )
        return y.transpose(1, 2)
    qg = q.view(N, Hkv, r, D) * D**-0.5  # query head j*r+i uses kv head j
    # prefix: (Hkv, N*r, D) @ (Hkv, D, Lp) -> (N, Hkv, r, Lp)
    qp = qg.permute(1, 0, 2, 3).reshape(Hkv, N * r, D)
    sp = torch.bmm(qp, pk[0].permute(1, 2, 0)).view(Hkv, N, r, -1).permute(1, 0, 2, 3)
    ss = torch.matmul(qg, sk.permute(0, 2, 3, 1))  # (N, Hkv, r, Ls)
    m = torch.maximum(sp.amax(-1, keepdim=True), ss.amax(-1, keepdim=True))
    ep, es = (sp - m).exp_(), (ss - m).exp_()
    denom = ep.sum(-1, keepdim=True) + es.sum(-1, keepdim=True)
    op = torch.bmm(ep.permute(1, 0, 2, 3).reshape(Hkv, N * r, -1), pv[0].permute(1, 0, 2))
    y = op.view(Hkv, N, r, D).permute(1, 0, 2, 3) + torch.matmul(es, sv.permute(0, 2, 1, 3))
    return (y / denom).reshape(N, 1, H, D)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: int, k_pos: int, window: int
) -> torch.Tensor:
    """Causal (optionally windowed) attention. q (B,Tq,H,D), k/v (B,Tk,Hkv,D) -> (B,Tq,H,D).

    q_pos, k_pos: absolute positions of q[:, 0] and k[:, 0]. Query at position i sees keys j
    with i - window <= j <= i.
    """
    Tq, Tk = q.shape[1], k.shape[1]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = qh.shape[1] != kh.shape[1]
    if Tq == 1 and q_pos - k_pos < window + 1 and k_pos + Tk - 1 == q_pos:
        # Decode step: every key present is visible, no mask needed.
        y = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=gqa)
    elif q_pos == k_pos and Tq == Tk and window >= Tq - 1:
        # A fresh sequence no longer than the window: plain causal, the fast fused kernel.
        y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        args = (q_pos, Tq, k_pos, Tk, window, q.dtype, q.device)
        if torch.compiler.is_compiling():  # traced into the graph, not looked up
            mask = _visible(*args, inference=False)
        else:
            mask = _visible_cached(*args, inference=torch.is_inference_mode_enabled())
        y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return y.transpose(1, 2)


def _visible(
    q_pos: int,
    Tq: int,
    k_pos: int,
    Tk: int,
    window: int,
    dtype: torch.dtype,
    device: torch.device,
    inference: bool,
) -> torch.Tensor:
    """(Tq, Tk) additive mask: 0 where query i sees key j (i - window <= j <= i), -inf
    elsewhere. A float mask spares the attention kernel converting a boolean one.
    `inference` only keys the cache (a tensor made under inference_mode cannot take part
    in autograd)."""
    i = torch.arange(q_pos, q_pos + Tq, device=device).unsqueeze(1)
    j = torch.arange(k_pos, k_pos + Tk, device=device).unsqueeze(0)
    hidden = (j > i) | (j < i - window)
    return torch.zeros(Tq, Tk, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


# Every layer of one forward asks for the same mask (one per window size), which costs ~7
# small ops to build. At most 4 stay alive (a 2048-token forward without a cache, through
# short windows, keeps a 16 MB fp32 one).
_visible_cached = functools.lru_cache(maxsize=4)(_visible)
