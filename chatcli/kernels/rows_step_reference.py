"""The rows_step kernel's answers in torch's ops: what its load check and the tests hold it to.

Owns: the reference decode step and embedding (torch ops over the same structs) and the
largest differences between them and the kernel on a random model (rows_step_errors,
embed_errors). Knows nothing about models beyond that arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chatcli.kernels.panels import HalfPanels, Int4Panels, Int8Panels, Matrix, int8_rows
from chatcli.kernels.rows_library import RowsLayer, RowsModel, RowsStep


def _rope_norm(
    heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_scale: float, norm_eps: float
) -> torch.Tensor:
    """Rotary embedding then the qk-norm of (..., D) heads, as the kernels compute them."""
    half = heads.size(-1) // 2
    x1, x2 = heads[..., :half], heads[..., half:]
    rotated = torch.cat([x1 * cos[:half] + x2 * sin[:half], x2 * cos[half:] - x1 * sin[half:]], -1)
    return rotated * torch.rsqrt(norm_eps + norm_scale * rotated.square().sum(-1, keepdim=True))


def _reference_rows_step(
    model: RowsModel,
    x: torch.Tensor,
    ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor],
    prefix_len: int,
    suffix: tuple[torch.Tensor, torch.Tensor],
    pos: int,
) -> torch.Tensor:
    """rows_step in torch ops, x and the suffix written in place (the load check's answer)."""
    m = model.struct
    N, H, Hkv, D = x.size(0), m.H, m.Hkv, m.D
    at = pos - prefix_len

    def scales(t: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt(t.square().mean(-1, keepdim=True) + m.eps)

    def dense(t: Matrix) -> torch.Tensor:
        return t.matrix() if isinstance(t, HalfPanels | Int8Panels | Int4Panels) else t

    x0, saved = x.clone(), None
    for i, la in enumerate(model.layers):
        x.mul_(la.resid_lambda).add_(x0, alpha=la.x0_lambda)
        s = scales(x)
        qkv = (x @ dense(la.qkv)) * s
        q_k = qkv[:, : (H + Hkv) * D].view(N, H + Hkv, D)
        heads = _rope_norm(q_k, cos, sin, m.norm_scale, m.norm_eps)
        v = qkv[:, (H + Hkv) * D :].view(N, Hkv, D)
        if la.ve_table is not None:
            gate = torch.sigmoid((x[:, : m.ve_channels] @ la.ve_gate.t()) * s)
            v = v + m.ve_scale * gate.unsqueeze(-1) * la.ve_table[ids].float().view(N, Hkv, D)
        suffix[0][i, :, at], suffix[1][i, :, at] = heads[:, H:], v
        start = max(0, pos - la.window)
        keys = torch.cat(
            [prefix[0][i, :, start:prefix_len].expand(N, -1, -1, -1),
             suffix[0][i, :, max(0, start - prefix_len) : at + 1]], 1,
        )  # fmt: skip
        values = torch.cat(
            [prefix[1][i, :, start:prefix_len].expand(N, -1, -1, -1),
             suffix[1][i, :, max(0, start - prefix_len) : at + 1]], 1,
        )  # fmt: skip
        keys, values = keys.repeat_interleave(H // Hkv, 2), values.repeat_interleave(H // Hkv, 2)
        scores = torch.einsum("nhd,nthd->nht", heads[:, :H], keys) * m.att_scale
        y = torch.einsum("nht,nthd->nhd", scores.softmax(-1), values).reshape(N, H * D)
        x += y @ dense(la.proj)
        u = (torch.relu(x @ dense(la.fc)) * scales(x)).square()
        x += u @ dense(la.fc_proj)
        if i == m.backout_layer:
            saved = x.clone()
    if saved is not None:
        x -= m.backout_lambda * saved
    return m.softcap * torch.tanh((x @ dense(model.lm_head)) * scales(x) / m.softcap)


def rows_step_errors(
    kernel: RowsStep,
    *,
    rows: int = 3,
    heads: tuple[int, int] = (4, 2),
    head_dim: int = 16,
    widths: tuple[int, int, int] = (64, 128, 100),
    prompt: int | None = 7,
    pos: int = 9,
    windows: tuple[int, ...] = (100, 2),
    threads: int = 2,
    seed: int = 0,
    half: bool = False,
    int8: bool = False,
    int4: bool = False,
    bf16_table: bool = False,
) -> list[float]:
    """The largest differences between the kernel and _reference_rows_step on a random
    model (the logits, then the keys and values written): the load check, and the tests'.

    heads: (H, Hkv); widths: (model, MLP, vocabulary); prompt: the shared prefix's length,
    or None for rows without one; windows: one layer each, the first with value embeddings,
    a short one leaving the prompt. The defaults take both of the products' loops (whole
    blocks of the widest vectors' 32 columns and a vocabulary of 100). half: the matrices
    fp16 in half panels, the vocabulary rounded up to whole panels (104 with 8 lanes: 6
    blocks and a panel without a pair); int8: the matrices int8 (Int8Panels), the
    vocabulary rounded up so too, the reference reading the matrices they stand for;
    int4: the same with int4 matrices (Int4Panels: every width but the vocabulary's whole
    groups of 128, so pass widths and heads that make them); bf16_table: the value
    embeddings bf16."""
    g = torch.Generator().manual_seed(seed)
    Hkv, D, C, N = heads[1], head_dim, widths[0], rows
    model = _random_model(kernel, g, heads, head_dim, widths, windows, half, int8, int4, bf16_table)
    V = model.struct.V
    P, L = prompt or 0, len(windows)
    x, ids = torch.randn(N, C, generator=g), torch.randint(0, V, (N,), generator=g)
    cos, sin = torch.rand(D, generator=g), torch.rand(D, generator=g)
    prefix = tuple(torch.randn(L, 1, P + 3, Hkv, D, generator=g) for _ in range(2))
    suffix = tuple(torch.randn(L, N, pos - P + 2, Hkv, D, generator=g) for _ in range(2))
    mine, my_suffix = x.clone(), tuple(t.clone() for t in suffix)
    want = _reference_rows_step(model, x, ids, cos, sin, prefix, P, suffix, pos)
    shared = prefix if prompt is not None else None
    got = kernel(model, mine, ids, cos, sin, shared, P, my_suffix, pos, threads=threads)
    pairs = ((got, want), (my_suffix[0], suffix[0]), (my_suffix[1], suffix[1]))
    return [(a - b).abs().max().item() for a, b in pairs]


def slots_errors(
    kernel: RowsStep,
    *,
    slots: tuple[int, ...] = (3, 0, 2, 1, 1, 1),
    positions: tuple[int, ...] = (9, 1, 5, 0, 1, 2),
    out: tuple[int, ...] | None = (0, 1, 2, 5),
    windows: tuple[int, ...] = (100, 3),
    threads: int = 2,
    seed: int = 0,
) -> list[float]:
    """The largest differences between rows_step_slots over rows of independent sequences
    (each in its slot of one cache, at its own position, with its own rotary tables; rows
    of one slot a prompt's tokens, in order) and rows_step of each row alone, one after the
    other: the logits of the rows `out` names (None: all), then the keys and values written
    (every slot, the untouched ones included). The load check, and the tests'."""
    g = torch.Generator().manual_seed(seed)
    heads, D, widths = (4, 2), 16, (64, 128, 100)
    model = _random_model(kernel, g, heads, D, widths, windows, False, False, False, False)
    N, L, Hkv, T = len(slots), len(windows), heads[1], max(positions) + 3
    x = torch.randn(N, widths[0], generator=g)
    ids = torch.randint(0, model.struct.V, (N,), generator=g)
    cos, sin = torch.rand(N, D, generator=g), torch.rand(N, D, generator=g)
    cache = tuple(torch.randn(L, max(slots) + 2, T, Hkv, D, generator=g) for _ in range(2))
    alone = tuple(c.clone() for c in cache)
    want = []
    for n, (slot, pos) in enumerate(zip(slots, positions, strict=True)):
        own = tuple(c[:, slot : slot + 1].clone() for c in alone)
        row = x[n : n + 1].clone()
        want.append(kernel(model, row, ids[n : n + 1], cos[n], sin[n], None, 0, own, pos, threads))
        for whole, part in zip(alone, own, strict=True):
            whole[:, slot : slot + 1] = part
    got = kernel.run_slots(
        model, x.clone(), ids, cos, sin, torch.tensor(slots), torch.tensor(positions), cache,
        threads, None if out is None else list(out),
    )  # fmt: skip
    if out is not None and not out:  # no logits asked for: none given, the caches written
        logits_error = 0.0 if got.shape == (0, model.struct.V) else float("inf")
        return [logits_error] + [
            (a - b).abs().max().item() for a, b in zip(cache, alone, strict=True)
        ]
    want_out = torch.cat(want) if out is None else torch.cat([want[i] for i in out])
    pairs = ((got, want_out), (cache[0], alone[0]), (cache[1], alone[1]))
    return [(a - b).abs().max().item() for a, b in pairs]


def _random_model(
    kernel: RowsStep,
    g: torch.Generator,
    heads: tuple[int, int],
    head_dim: int,
    widths: tuple[int, int, int],
    windows: tuple[int, ...],
    half: bool,
    int8: bool,
    int4: bool,
    bf16_table: bool,
) -> RowsModel:
    """A random model as the kernel reads it (rows_step_errors says what each option does)."""
    (H, Hkv), D, (C, F, V) = heads, head_dim, widths
    panel = kernel.int8_panel if int8 else kernel.int4_panel if int4 else kernel.half_panel
    if half or int8 or int4:
        V = -(-V // panel) * panel

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * shape[0] ** -0.5

    def weights(*shape: int) -> Matrix:
        w = rand(*shape)
        if int8:
            return Int8Panels.of(*int8_rows(w.t()), panel, kernel.int8_interleave)
        if int4:
            return Int4Panels.of(w.t(), panel)
        return HalfPanels.of(w, panel) if half else w

    table_dtype = torch.bfloat16 if bf16_table else torch.float32
    layers = [
        RowsLayer(
            weights(C, (H + 2 * Hkv) * D),
            weights(H * D, C),
            weights(C, F),
            weights(F, C),
            rand(Hkv, 8) if i == 0 else None,
            rand(V, Hkv * D).to(table_dtype) if i == 0 else None,
            window=window,
            resid_lambda=0.9,
            x0_lambda=0.2,
        )
        for i, window in enumerate(windows)
    ]
    return kernel.model(
        layers, weights(C, V), n_head=H, n_kv_head=Hkv, ve_scale=3.0, eps=1e-6,
        norm_scale=1.44 / D, norm_eps=1e-6, softcap=15.0, backout_layer=0, backout_lambda=0.3,
    )  # fmt: skip


def reference_embed(
    table: torch.Tensor,
    ids: torch.Tensor,
    eps: float,
    prev: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    smear_lambda: float = 0.0,
) -> torch.Tensor:
    """RowsStep.embed in torch's ops, as the model's forward embeds a continuing token."""
    x = F.rms_norm(table[ids].float(), (table.size(1),), eps=eps)
    if prev is None or gate is None:
        return x
    before = F.rms_norm(table[prev].float(), (table.size(1),), eps=eps)
    weight = smear_lambda * torch.sigmoid(x[:, : gate.numel()] @ gate)
    return x + weight.unsqueeze(1) * before


def embed_errors(kernel: RowsStep, *, bf16: bool = False, rows: int = 5, seed: int = 0) -> float:
    """The largest difference between RowsStep.embed and reference_embed on a random table,
    with and without the smear (a previous token for every row, and one for all)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(50, 40, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
    ids = torch.randint(0, 50, (rows,), generator=g)
    prev = torch.randint(0, 50, (rows,), generator=g)
    gate = torch.randn(24, generator=g) * 0.3
    worst = 0.0
    for p in (None, prev, prev[:1]):
        got = kernel.embed(table, ids, 1e-6, p, gate if p is not None else None, 0.7)
        want = reference_embed(table, ids, 1e-6, p, gate if p is not None else None, 0.7)
        worst = max(worst, (got - want).abs().max().item())
    return worst
