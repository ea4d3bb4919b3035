"""One decode step of our GPT (one token per row) in as few operations as the math allows.

Owns: repacking a loaded GPT's weights for decode, the step itself in three forms, and the
fallback that keeps a failed fast form from breaking a chat (StepWithFallback). A small model (the embedded one:
3.6M parameters) fits in cache, so a decode step costs what its ops cost to dispatch (~2-15 us
each on this CPU), not what they compute. The module-by-module forward spends ~300 ops per
token. Where our C kernel compiles (native_kernels.rows_step), a small fp32 model's whole
step, one row or many, is one call of it: every layer and the vocabulary's products, each
product shared among the cores, the shared prompt's attention as products over its keys
transposed once a generation. Elsewhere DecodeStep does the same arithmetic in torch ops,
about half as many as the module forward:

- q, k and v come from one product over the three matrices stacked;
- the rotary embedding of q and k is one (rows*(H+Hkv), D) @ (D, D) product with a fixed
  signed permutation plus one fused multiply-add, with the cos/sin rows picked once per step;
- the qk-norm of all heads is 4 ops on their norms, the era's qk scale folded in (fp32 on
  the CPU; elsewhere rms_norm, the scale its weight in fp32 or multiplied after in bf16);
- residual adds fuse into addmm/addmv, and the scalar lambdas become Python floats;
- every RMSNorm that feeds a matrix is folded into the product after it: at batch 1 as a
  scalar read on the host (see _one_row), for several rows as their (N, 1) scales
  (_row_scales);
- a small matrix is read through a transposed copy where that is the faster layout
  (_Matrix);
- sample rows over a shared prompt: two fused attention calls whose log-sum-exps combine
  the prompt's part and each row's own part exactly.

StaticDecodeStep is the same step with shapes fixed by the cache, which a CUDA graph needs
(CudaGraphStep). Same weights, same math: every form equals model.forward to float rounding
(the tests hold every era to 2e-5, both the kernel and torch's ops, and greedy output to
identity).

The Engine picks a form (engine._pick_decode_step): the fused step for an fp32 model on the
CPU, the CUDA graph on a GPU. A big CPU model is bandwidth-bound, and its fused step reads
the compact decode copies (quantize.py) its modules keep; halving its ops still matters
there, as each op on two threads pays a fork/join. So its products and attention run on the
caller's threads (or on one, where a second does not pay: cpu_plan.ThreadChoice) and the
rest on one. A small model's kernel runs on every core, torch's ops on one, each moving to
the other count where that measures faster.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from chatcli.engine.cpu_plan import SMALL_MODEL_PARAMS, ThreadChoice, available_cores
from chatcli.engine.fallback import Fallback
from chatcli.kernels.native import Matrix, RowsLayer, RowsModel, rows_step
from chatcli.model.gpt import (
    GPT,
    SMEAR_CHANNELS,
    Attention,
    attend_shared,
    is_embedding_table,
    linear,
    through_copy,
    weight_major,
)
from chatcli.model.kv_cache import KVCache, SharedPrefixCache
from chatcli.model.quantize import DecodeWeight

# Elements of a stacked matrix (a copy of its parts): d20's q, k and v are 4.9M (20 MB).
STACK_AT_MOST = 1 << 20

Out = TypeVar("Out")  # what an op run by _run_on returns


def _run_on(threads: int, op: Callable[..., Out], *args: object, **kwargs: object) -> Out:
    """op(*args, **kwargs) on `threads` threads, the step's own one restored after."""
    if threads == 1:
        return op(*args, **kwargs)
    torch.set_num_threads(threads)
    try:
        return op(*args, **kwargs)
    finally:
        torch.set_num_threads(1)


def _on_product_threads(product: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Run a _Matrix product on its `threads`, the rest of the step staying on one."""

    @functools.wraps(product)
    def run(self: _Matrix, *args: torch.Tensor, **kwargs: float) -> torch.Tensor:
        return _run_on(self.threads, product, self, *args, **kwargs)

    return run


class _Matrix:
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
    (in, out) it accumulates whole output rows at full vector width. One run of
    `python scripts/bench_decode_paths.py layouts` (embedded model, weights from memory, us
    per matrix, (out, in) against (in, out)): one row 56/40 (qkv), 78/52 (c_fc), 118/75
    (lm_head), 47/75 (MLP c_proj); 8 rows 99/71, 143/103, 227/180, 113/91 and 43/24 (c_proj
    of attention).

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
class _Layer:
    qkv: _Matrix  # (H*D + 2*Hkv*D, C): c_q, c_k, c_v stacked
    proj: _Matrix
    fc: _Matrix
    fc_proj: _Matrix
    window: int
    resid_lambda: float
    x0_lambda: float
    ve_table: torch.Tensor | None  # (V, Hkv*D) value embedding, or None
    ve_gate: torch.Tensor | None  # (Hkv, ve_channels)


class DecodeStep:
    """Callable (ids (N, 1), cache) -> logits (N, V); advances the cache like model.forward.

    The cache is a KVCache with N rows or a SharedPrefixCache over N sample rows.
    """

    wants_full_cache = False  # any cache shape: it reads what was written, nothing more
    reads_whole_cache = False

    def __init__(self, model: GPT) -> None:
        cfg, arch = model.config, model.arch
        self.model = model
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.vocab_size = cfg.vocab_size
        self.softcap = arch.softcap
        self.ve_scale = arch.ve_gate_scale
        self.ve_channels = arch.ve_gate_channels
        self.backout_layer = cfg.n_layer // 2 if arch.backout else -1
        self.backout_lambda = model.backout_lambda.item() if arch.backout else 0.0
        self.smear = arch.smear
        self.smear_gate: torch.Tensor | None = None
        self.smear_lambda = 0.0
        if arch.smear:
            self.smear_gate = model.smear_gate.weight.detach().reshape(-1).contiguous()  # (24,)
            self.smear_lambda = model.smear_lambda.item()
        self.wte = model.transformer.wte.weight.detach()
        # The activations' dtype; the embedding tables may be narrower (model.look_up), and
        # then each looked-up row widens to it (one op, only where a table is narrower).
        self.dtype = model.compute_dtype
        self.lm_head = _Matrix([model.lm_head])
        D = self.head_dim
        # In fp32 the qk-norm's weight carries the era's qk scale (1 before era D); in bf16
        # that weight would round 1.2 to 1.203125, so the scale multiplies after the norm.
        self.qk_scale = arch.qk_scale if arch.qk_scale is not None else 1.0
        self.qk_norm_weight = (
            torch.full((D,), self.qk_scale, dtype=self.dtype, device=self.wte.device)
            if self.dtype == torch.float32
            else None
        )
        # rotate-half as a matrix: (x1, x2) @ P = (x2, -x1), so x*cos + (x@P)*sin is rope.
        half = D // 2
        P = torch.zeros(D, D, dtype=self.dtype, device=self.wte.device)
        P[half:, :half] = torch.eye(half)
        P[:half, half:] = -torch.eye(half)
        self.rotate_half = P
        self.layers = []
        for i, block in enumerate(model.transformer.h):
            a, m = block.attn, block.mlp
            ve_table = model.value_embeds[str(i)].weight.detach() if a.ve_channels else None
            self.layers.append(
                _Layer(
                    qkv=_Matrix([a.c_q, a.c_k, a.c_v], stacked_in=a),
                    proj=_Matrix([a.c_proj]),
                    fc=_Matrix([m.c_fc]),
                    fc_proj=_Matrix([m.c_proj]),
                    window=model.windows[i],
                    resid_lambda=model.resid_lambdas[i].item() if arch.lambdas else 1.0,
                    x0_lambda=model.x0_lambdas[i].item() if arch.lambdas else 0.0,
                    ve_table=ve_table,
                    ve_gate=a.ve_gate.weight.detach() if a.ve_channels else None,
                )
            )
        self.lambdas = arch.lambdas
        self.matrices = [self.lm_head] + [
            m for layer in self.layers for m in (layer.qkv, layer.proj, layer.fc, layer.fc_proj)
        ]
        # A big CPU model's step is a few big products, which stream weights faster on every
        # core, among hundreds of small ops, which on two threads pay a fork/join each (d20's
        # int8 step went from 45 to 90 ms with every op on two, under a passive wait). So
        # its products run on the caller's threads, and so does its attention, which
        # streams the cache (d20 over 512 positions: 14.1 against 9.7 ms a token on one
        # thread and two, with openmp_wait's spin); everything else runs on one.
        # A small model's step through torch's ops runs on the caller's one thread
        # (cpu_plan), but its products and attention read ~11 MB of weights and cache a
        # token, more than a core's L2 holds: on a Xeon with AVX-512 the embedded model's
        # step took 0.98-1.0 ms with them on both cores (openmp_wait's spin) against
        # 1.17-1.20 on one, 8 rows 1.94-2.02 against 2.13-2.18; on an AMD EPYC with AVX2
        # one thread was the faster. Our kernel (rows_step) starts on every core (__call__).
        self.split_threads = model.num_params() >= SMALL_MODEL_PARAMS
        self._thread_choices: dict[tuple[int, int], ThreadChoice] = {}
        self.wide_threads = 1  # the products' and attention's count (__call__ sets it)
        self._eps = torch.finfo(self.dtype).eps  # F.rms_norm's default
        # fp32 on the CPU: the qk-norm in 4 ops (_qk_norm_lean), and sample rows fold each
        # RMSNorm into a per-row scale (_row_scales), but only where every product takes its
        # rows as floats: fbgemm's int8 kernel quantizes a product's input with one scale for
        # all its rows, which must see the rows normalised, as the module forward gives them.
        self.lean = self.dtype == torch.float32 and self.wte.device.type == "cpu"
        self.fold_norms = self.lean and all(c.float_activations for c in model.decode_weights())
        # The whole step, one row or many, in one call of our own kernel
        # (native_kernels.rows_step) where it compiles here: a small fp32 model's ~150 ops
        # of ~2-5 us each become one; a big model's fp16 copies are read from their own
        # panels, and the ~300 ops and thread hand-offs between its products go (d20 on a
        # 2-core Zen 3: 52 ms a token through fbgemm and torch's ops, see _native_rows).
        self._rows_model = self._native_rows()
        # ... and the rows it starts from (look-ups, norms, the smear) in one more call,
        # where they were ~10 torch ops (~150 us of the embedded model's ~600 us token).
        self._embed_native = self._rows_model is not None and rows_step().embeds(self.wte)
        self._rows_cache: object | None = None  # the last cache checked for the kernel
        self._rows_takes = False  # and whether the kernel reads it
        self._rows_prefix: tuple[torch.Tensor, torch.Tensor] | None = None  # its shared prompt
        # eps times the squared divisors _row_scales is asked for: 1, the qk scale, the softcap
        self._eps_scaled = {
            t: torch.tensor(self._eps * t * t, dtype=self.dtype)
            for t in (1.0, 1.0 / self.qk_scale, self.softcap)
        }
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def _native_rows(self) -> RowsModel | None:
        """The model as rows_step reads it, or None where it does not apply: matrices
        neither all fp32 and small (weight_t) nor all fp16 copies in half panels nor all
        int8 copies in int8 panels (int4, bf16 copies; fp16 where the CPU lacks F16C, int8
        where it lacks AVX2), tables other than fp32 or bf16, no compiler."""
        if not (self.fold_norms and self.head_dim % 2 == 0):
            return None
        kernel = rows_step()
        if kernel is None:
            return None
        source: dict[int, Matrix] = {}
        for m in self.matrices:
            if m.weight_t is not None:
                source[id(m)] = m.weight_t
                continue
            copies = m.copies  # one fp16 or int8 copy (a stacked one for q, k, v) keeps panels
            one = copies[0] if len(copies) == 1 else None
            panels = getattr(one, "half_panels", None) or getattr(one, "int8_panels", None)
            if panels is None:
                return None
            source[id(m)] = panels
        tables = {t.dtype for la in self.layers if (t := la.ve_table) is not None}
        if not tables <= {torch.float32} and tables != {torch.bfloat16}:
            return None
        t = 1.0 / self.qk_scale
        layers = [
            RowsLayer(
                *(source[id(m)] for m in (la.qkv, la.proj, la.fc, la.fc_proj)),
                la.ve_gate,
                la.ve_table,
                window=la.window,
                resid_lambda=la.resid_lambda,
                x0_lambda=la.x0_lambda,
            )
            for la in self.layers
        ]
        try:
            return kernel.model(
                layers,
                source[id(self.lm_head)],
                n_head=self.n_head,
                n_kv_head=self.n_kv_head,
                ve_scale=self.ve_scale,
                eps=self._eps,
                norm_scale=t * t / self.head_dim,
                norm_eps=self._eps * t * t,
                softcap=self.softcap,
                backout_layer=self.backout_layer,
                backout_lambda=self.backout_lambda,
            )
        except ValueError:  # e.g. fp32 beside fp16, widths not in the kernel's blocks
            return None

    def _rows_caches(
        self, cache: KVCache | SharedPrefixCache
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, int, tuple[torch.Tensor, torch.Tensor]]:
        """(the shared prefix's K/V or None, its length, the rows' own K/V) of a cache."""
        if isinstance(cache, SharedPrefixCache):
            p, s = cache.prefix, cache.suffix
            return (p.k_cache, p.v_cache), cache.prefix_len, (s.k_cache, s.v_cache)
        return None, 0, (cache.k_cache, cache.v_cache)

    def _kernel_takes(self, cache: KVCache | SharedPrefixCache, rows: int) -> bool:
        """Whether rows_step reads this cache, checked once a cache (a layout is for life),
        and its shared prefix's keys and values as the kernel reads them (pack_prefix),
        made once: the prefix does not change while sample rows decode over it."""
        if self._rows_model is None:
            return False
        if cache is not self._rows_cache:
            prefix, prefix_len, suffix = self._rows_caches(cache)
            self._rows_takes = rows_step().takes(self._rows_model, rows, prefix, suffix)
            self._rows_cache, self._rows_prefix = cache, None
            if self._rows_takes and prefix is not None and prefix_len > 0:
                self._rows_prefix = rows_step().pack_prefix(prefix, prefix_len, available_cores())
        return self._rows_takes

    @property
    def kernel(self) -> str | None:
        """Our kernel that runs the whole step where it applies (reported by the bench)."""
        if self._rows_model is None:
            return None
        narrow = {"float16": " fp16", "int8": " int8"}
        return "rows_step" + narrow.get(self._rows_model.weights, "")

    def threads_by_rows(self) -> dict[int, int]:
        """The thread count each row count's step has settled on so far (the bench
        reports it: a small model's plan is one thread, yet its kernel may run on more)."""
        return {rows: c.current for (rows, _), c in sorted(self._thread_choices.items())}

    @staticmethod
    def supports(model: object) -> bool:
        """Whether this step reproduces `model`'s forward: our fp32 GPT on the CPU, with or
        without compact decode copies of its matrices, its embedding tables fp32 or
        narrower (their rows widen as they are looked up)."""
        if not isinstance(model, GPT) or model.get_device().type != "cpu":
            return False
        return model.compute_dtype == torch.float32 and all(
            p.dtype == torch.float32
            for name, p in model.named_parameters()
            if not is_embedding_table(name)
        )

    def _embed(
        self, idx: torch.Tensor, cache: KVCache | SharedPrefixCache, smear: bool, fold: bool
    ) -> torch.Tensor:
        """The rows (N, C) the layers start from, through torch's ops: the tokens'
        normalised embeddings, plus the smear of the previous tokens' where `smear`."""
        x = self._look_up(idx, self.wte)
        x = x.mul_(self._row_scales(x)) if fold else F.rms_norm(x, (x.size(1),))
        if smear:
            prev = F.rms_norm(self._look_up(cache.prev_token, self.wte), (x.size(1),))
            gate = torch.sigmoid(torch.mv(x[:, :SMEAR_CHANNELS], self.smear_gate))
            x = torch.addcmul(x, prev, gate.mul_(self.smear_lambda).unsqueeze(1))
        return x

    def _look_up(self, idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(idx, table)
        return rows if table.dtype == self.dtype else rows.to(self.dtype)

    def _room_for_one(self, cache: KVCache | SharedPrefixCache) -> int:
        """The position the next token goes to; a ValueError if the model or cache is full
        (said before anything is written, as KVCache.advance would say it after)."""
        pos = cache.get_pos()
        if pos + 1 > self.model.max_positions:
            raise ValueError(f"position {pos + 1} exceeds the model's {self.model.max_positions}")
        rows = cache.suffix if isinstance(cache, SharedPrefixCache) else cache
        if rows.get_pos() + 1 > rows.max_seq_len:
            raise ValueError(f"KV cache overflow: {rows.get_pos() + 1} > {rows.max_seq_len}")
        return pos

    def _qk_v(
        self,
        layer: _Layer,
        x: torch.Tensor,
        idx: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fold: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows x (N, C) -> (q and k after rope and qk-norm (N, H+Hkv, D), v (N, Hkv, D)).

        fold: the RMSNorm before the product is a per-row scale applied after it
        (_row_scales)."""
        N, H, Hkv, D = x.size(0), self.n_head, self.n_kv_head, self.head_dim
        if fold:
            s = self._row_scales(x)
            qkv = layer.qkv.mm(x).mul_(s)
            h = x
        else:
            s, h = None, F.rms_norm(x, (x.size(1),))
            qkv = layer.qkv.mm(h)
        k_end = (H + Hkv) * D
        # Every head of every row as one (N*(H+Hkv), D) matrix: the rope's product is then
        # one mm, where the (N, H+Hkv, D) view of the rows' strided slice made it an
        # expand and a batched product.
        qk = qkv[:, :k_end].reshape(N * (H + Hkv), D)
        v = qkv[:, k_end:].view(N, Hkv, D)
        if layer.ve_table is not None:
            z = F.linear(h[:, : self.ve_channels], layer.ve_gate)
            gate = torch.sigmoid(z if s is None else z.mul_(s))
            ve = self._look_up(idx, layer.ve_table).view(N, Hkv, D)
            v = torch.addcmul(v, gate.unsqueeze(-1), ve, value=self.ve_scale)
        qk = torch.addcmul(qk * cos, qk @ self.rotate_half, sin)  # rope before the norm
        qk = self._qk_norm_lean(qk) if self.lean else self._qk_norm(qk)
        return qk.view(N, H + Hkv, D), v

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        D = self.head_dim
        if self.qk_norm_weight is not None:
            return F.rms_norm(qk, (D,), weight=self.qk_norm_weight)
        normed = F.rms_norm(qk, (D,))
        return normed * self.qk_scale if self.qk_scale != 1.0 else normed

    def _qk_norm_lean(self, qk: torch.Tensor) -> torch.Tensor:
        """_qk_norm in 4 ops where F.rms_norm dispatches ~9 on the CPU (pow, sum, div,
        add, rsqrt, mul, weight, casts): every head's RMSNorm scale divided by 1/qk_scale.
        In place: qk is a temporary."""
        return qk.mul_(self._row_scales(qk, times=1.0 / self.qk_scale))

    def _row_scales(self, x: torch.Tensor, times: float = 1.0) -> torch.Tensor:
        """(..., 1) RMSNorm scales of x's last dimension, divided by `times` (1, 1/qk_scale
        or the softcap): 1 / (times * sqrt(mean(x^2) + eps)). rms_norm(x) @ W.T =
        scales * (x @ W.T), so a norm feeding a product costs 3 ops on its scales instead of
        ~8 on x."""
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return torch.addcmul(
            self._eps_scaled[times], n, n, value=times * times / x.size(-1)
        ).rsqrt_()

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        # (positions, D) tables with cos/sin repeated over both halves, from the model's own
        # (possibly bf16-rounded) tables, so the rotation is the same numbers.
        if self._cos_sin is None:
            if self.model.cos.numel() == 0:
                self.model.init_rotary()
            cos, sin = self.model.cos[0, :, 0], self.model.sin[0, :, 0]
            self._cos_sin = (torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
        return self._cos_sin

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache: KVCache | SharedPrefixCache) -> torch.Tensor:
        """ids (N, 1), one token per cache row -> float32 logits (N, vocab_size)."""
        caller = torch.get_num_threads()  # the caller's count may change between calls
        # The products' count: a big model's is the caller's, or one while a second thread
        # does not pay (another process busy on the cores; openmp_wait.py); a small model's
        # every core (our kernel) or one (torch's ops), each moving to the other where that
        # measured faster. Chosen per row count.
        wide = caller if self.split_threads else available_cores()
        if wide == 1:
            self._set_wide_threads(1)
            return self._step(ids, cache)
        choice = self._thread_choices.get((ids.size(0), wide))
        if choice is None:
            # Our whole-step kernel shares each product among the cores (a small model's
            # step on two: 0.11 against 0.2 ms for one row, 0.35 against 0.63 for 8); torch's
            # ops paid a fork/join each.
            many = self.split_threads or self._rows_model is not None
            preferred, other = (wide, 1) if many else (1, wide)
            choice = self._thread_choices[(ids.size(0), wide)] = ThreadChoice(preferred, other)
        self._set_wide_threads(choice.threads())
        torch.set_num_threads(1)
        try:
            t0 = time.perf_counter()
            logits = self._step(ids, cache)
            choice.record(time.perf_counter() - t0)
            return logits
        finally:
            torch.set_num_threads(caller)

    def _set_wide_threads(self, threads: int) -> None:
        """The count the attention (wide_threads) and every product (_Matrix.threads) use."""
        self.wide_threads = threads
        if self.matrices[0].threads != threads:
            for m in self.matrices:
                m.threads = threads

    def _step(self, ids: torch.Tensor, cache: KVCache | SharedPrefixCache) -> torch.Tensor:
        H, D = self.n_head, self.head_dim
        N = ids.size(0)
        pos = self._room_for_one(cache)
        cos_table, sin_table = self._rope_tables()
        cos, sin = cos_table[pos], sin_table[pos]  # (D,), broadcast over rows and heads
        idx = ids.view(N)
        native = ids.device.type == "cpu" and self._kernel_takes(cache, N)
        if N == 1 and type(cache) is KVCache and ids.device.type == "cpu" and not native:
            return self._one_row(idx, cache, pos, cos, sin)
        C = self.wte.size(1)
        fold = self.fold_norms
        smear = self.smear and pos > 0 and cache.prev_token is not None
        if native:  # every layer and the vocabulary's products in one call
            kernel = rows_step()
            if self._embed_native:
                prev = cache.prev_token if smear else None  # no smear: gate, lambda unread
                x = kernel.embed(self.wte, idx, self._eps, prev, self.smear_gate, self.smear_lambda)
            else:
                x = self._embed(idx, cache, smear, fold)
            _, prefix_len, suffix = self._rows_caches(cache)
            logits = kernel.run(
                self._rows_model, x, idx, cos, sin, self._rows_prefix, prefix_len, suffix,
                pos, self.wide_threads,
            )  # fmt: skip
            cache.prev_token = idx
            cache.advance(1)
            return logits[:, : self.vocab_size]  # the softcap taken in the kernel
        x = self._embed(idx, cache, smear, fold)
        x0 = x
        saved = None
        shared = isinstance(cache, SharedPrefixCache)
        for i, layer in enumerate(self.layers):
            if self.lambdas:
                x = torch.add(x * layer.resid_lambda, x0, alpha=layer.x0_lambda)
            qk, v = self._qk_v(layer, x, idx, cos, sin, fold)
            q, k = qk[:, :H], qk[:, H:]
            if shared:
                y = self._attend_shared(i, q, k, v, layer.window, cache, pos)
            else:
                y = self._attend(i, q, k, v, layer.window, cache, pos)
            x = layer.proj.addmm(x, y.reshape(N, H * D))
            if fold:  # relu(s * z) = s * relu(z) for the row's scale s > 0
                u = layer.fc.mm(x).relu_().mul_(self._row_scales(x))
            else:
                u = layer.fc.mm(F.rms_norm(x, (C,))).relu_()
            x = layer.fc_proj.addmm(x, u.mul_(u))
            if i == self.backout_layer:
                saved = x
        if saved is not None:
            x = torch.add(x, saved, alpha=-self.backout_lambda)
        cap = self.softcap
        cache.prev_token = idx
        cache.advance(1)
        if fold:  # the last norm joins the softcap's division
            logits = self.lm_head.mm(x)[:, : self.vocab_size]
            scales = self._row_scales(x, times=cap)
            return _run_on(self.wide_threads, _soft_cap, logits, cap, scales)
        logits = self.lm_head.mm(F.rms_norm(x, (C,)))[:, : self.vocab_size].float()
        return _run_on(self.wide_threads, _soft_cap, logits, cap)

    def _one_row(
        self, idx: torch.Tensor, cache: KVCache, pos: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Batch 1 on the CPU, where a host read costs ~3 us: every RMSNorm that feeds a
        matrix becomes a scalar, rms_scale(x) = 1/sqrt(mean(x^2) + eps), computed on the host
        and folded into what follows: W @ norm(x) = s * (W @ x); in the MLP relu(s*z)^2 =
        s^2 * relu(z)^2, so the scale rides in addmv's alpha; before the vocabulary it joins
        the softcap's division. ~13 norm kernels per step become a dot product each."""
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        C = self.wte.size(1)
        eps = self._eps
        x = self._look_up(idx, self.wte)[0]
        x = x * _rms_scale(x, C, eps)
        if self.smear and pos > 0 and cache.prev_token is not None:
            prev = self._look_up(cache.prev_token.view(1), self.wte)[0]
            gate = torch.sigmoid(torch.dot(self.smear_gate, x[:SMEAR_CHANNELS]))
            value = self.smear_lambda * _rms_scale(prev, C, eps)
            x = torch.addcmul(x, prev, gate, value=value)
        x0 = x
        saved = None
        k_end = (H + Hkv) * D
        k_all, v_all = cache.k_cache, cache.v_cache
        for i, layer in enumerate(self.layers):
            if self.lambdas:
                x = torch.add(x * layer.resid_lambda, x0, alpha=layer.x0_lambda)
            s = _rms_scale(x, C, eps)
            qkv = layer.qkv.mv(x).mul_(s)
            qk = qkv[:k_end].view(H + Hkv, D)
            v = qkv[k_end:].view(Hkv, D)
            if layer.ve_table is not None:
                gate = torch.sigmoid(torch.mv(layer.ve_gate, x[: self.ve_channels]).mul_(s))
                ve = self._look_up(idx, layer.ve_table).view(Hkv, D)
                v = torch.addcmul(v, gate.unsqueeze(-1), ve, value=self.ve_scale)
            start = max(0, pos - layer.window)
            qk = torch.addcmul(qk * cos, qk @ self.rotate_half, sin)
            qk = self._qk_norm_lean(qk) if self.lean else self._qk_norm(qk)
            k_all[i, 0, pos] = qk[H:]
            v_all[i, 0, pos] = v
            # 4-D, so that it is one fused kernel: 3-D inputs take the unfused math path
            # (~6 ops: 290 against 190 us at d20's shapes over 300 positions).
            y = _run_on(
                self.wide_threads,
                F.scaled_dot_product_attention,
                qk[:H].view(1, H, 1, D),
                k_all[i, :1, start : pos + 1].transpose(1, 2),
                v_all[i, :1, start : pos + 1].transpose(1, 2),
                enable_gqa=Hkv != H,
            )
            x = layer.proj.addmv(x, y.view(-1))
            s = _rms_scale(x, C, eps)
            u = layer.fc.mv(x).relu_()
            x = layer.fc_proj.addmv(x, u.mul_(u), alpha=s * s)
            if i == self.backout_layer:
                saved = x
        if saved is not None:
            x = torch.add(x, saved, alpha=-self.backout_lambda)
        logits = self.lm_head.mv(x)[: self.vocab_size]
        cache.prev_token = idx
        cache.advance(1)
        cap = self.softcap
        scale = _rms_scale(x, C, eps) / cap
        return _run_on(self.wide_threads, _soft_cap, logits, cap, scale).view(1, -1)

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int,
        cache: KVCache,
        pos: int,
    ) -> torch.Tensor:
        # q (N, H, D), k/v (N, Hkv, D) -> (N, H, D), over each row's own cached keys.
        k_cache, v_cache = cache.get_layer_cache(layer)  # (N, T, Hkv, D)
        k_cache[:, pos] = k
        v_cache[:, pos] = v
        start = max(0, pos - window)
        y = _run_on(
            self.wide_threads,
            F.scaled_dot_product_attention,
            q.unsqueeze(2),
            k_cache[:, start : pos + 1].transpose(1, 2),
            v_cache[:, start : pos + 1].transpose(1, 2),
            enable_gqa=q.size(1) != k.size(1),
        )
        return y

    def _attend_shared(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int,
        cache: SharedPrefixCache,
        pos: int,
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
        out_s, lse_s = _run_on(
            self.wide_threads,
            _attention_with_lse,
            qg,
            sk[:, max(0, start - P) : s + 1].transpose(1, 2),
            sv[:, max(0, start - P) : s + 1].transpose(1, 2),
        )
        if start >= P:  # the window no longer reaches the prompt
            return out_s.reshape(N, H, D)
        qp = qg.transpose(0, 1).reshape(1, Hkv, N * r, D)
        out_p, lse_p = _run_on(
            self.wide_threads,
            _attention_with_lse,
            qp,
            pk[:, start:P].transpose(1, 2),
            pv[:, start:P].transpose(1, 2),
        )
        out_p = out_p.view(Hkv, N, r, D).transpose(0, 1)
        lse_p = lse_p.view(Hkv, N, r).transpose(0, 1)
        weight = torch.sigmoid(lse_p - lse_s.view(N, Hkv, r)).unsqueeze(-1).to(out_s.dtype)
        return torch.lerp(out_s.view(N, Hkv, r, D), out_p, weight).reshape(N, H, D)


def has_decode_copies(model: GPT) -> bool:
    return bool(model.decode_weights())


def _soft_cap(
    logits: torch.Tensor, cap: float, scale: torch.Tensor | float | None = None
) -> torch.Tensor:
    """cap * tanh(logits * scale), or of logits / cap without a scale, in place. Over a big
    vocabulary tanh is the step's costliest elementwise op (8 rows of 65536: 1.95 ms on one
    thread, 0.96 on two), so a big model runs it on the products' threads."""
    scaled = logits.div_(cap) if scale is None else logits.mul_(scale)
    return scaled.tanh_().mul_(cap)


def _rms_scale(x: torch.Tensor, size: int, eps: float) -> float:
    """1 / sqrt(mean(x^2) + eps) of a vector, as F.rms_norm computes it, read on the host."""
    return (torch.dot(x, x).item() / size + eps) ** -0.5


def _attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention (B, Hkv, Lq, D) x (B, Hkv, Lk, D) and the log-sum-exp of its scores
    (B, Hkv, Lq), through the CPU flash kernel that computes both."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    return out, lse


class StaticDecodeStep(DecodeStep):
    """The same step with every shape fixed by the cache rather than by the position.

    Keys are read over the whole preallocated cache under a mask, the position is a tensor
    and the K/V writes are index_copy_ at that position. Nothing depends on a host value, so
    the step can be captured once as a CUDA graph and replayed (CudaGraphStep). Plain
    KVCache rows only, one or many (Engine.fork copies the prompt into each sample row for
    it); rows over a shared prompt, should any come, take the dynamic step. (Through
    torch.compile on the CPU it was 3x slower than the fused eager step, so it is not
    compiled there.)
    """

    reads_whole_cache = True  # under a mask: the Engine zeroes the caches it makes for it
    # Its shapes are the cache's: one row gets the whole context, the same shape every call.
    wants_full_cache = True

    def __init__(self, model: GPT) -> None:
        super().__init__(model)
        self.cos_table, self.sin_table = self._rope_tables()

    @staticmethod
    def supports(model: object) -> bool:
        """Our GPT, any device or size, without compact decode copies (it reads the weights)."""
        return isinstance(model, GPT) and not has_decode_copies(model)

    def forward_static(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        prev: torch.Tensor,
        has_prev: torch.Tensor,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
    ) -> torch.Tensor:
        """ids (N,) at position pos (a 1-element long tensor), prev (N,) the tokens before
        them, used only where has_prev (a 1-element 0/1 tensor) is 1; k_all/v_all the
        cache's (L, N, T, Hkv, D) tensors, written at pos. Returns logits (N, vocab_size)."""
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        N, T = ids.size(0), k_all.size(2)
        C = self.wte.size(1)
        cos = self.cos_table.index_select(0, pos)  # (1, D)
        sin = self.sin_table.index_select(0, pos)
        x = F.rms_norm(self._look_up(ids, self.wte), (C,))
        if self.smear:
            prev_x = F.rms_norm(self._look_up(prev, self.wte), (C,))
            gate = torch.sigmoid(torch.mv(x[:, :SMEAR_CHANNELS], self.smear_gate))
            gate = gate * (self.smear_lambda * has_prev.to(x.dtype))  # none without one
            x = torch.addcmul(x, prev_x, gate.unsqueeze(1))
        x0 = x
        saved = None
        keys = torch.arange(T, device=ids.device)
        masks: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if self.lambdas:
                x = torch.add(x * layer.resid_lambda, x0, alpha=layer.x0_lambda)
            qk, v = self._qk_v(layer, x, ids, cos, sin)
            k_cache, v_cache = k_all[i], v_all[i]  # (N, T, Hkv, D)
            k_cache.index_copy_(1, pos, qk[:, H:].unsqueeze(1))
            v_cache.index_copy_(1, pos, v.unsqueeze(1))
            if layer.window not in masks:
                masks[layer.window] = ((keys <= pos) & (keys >= pos - layer.window)).view(
                    1, 1, 1, T
                )
            y = F.scaled_dot_product_attention(
                qk[:, :H].unsqueeze(2),
                k_cache.transpose(1, 2),
                v_cache.transpose(1, 2),
                attn_mask=masks[layer.window],
                enable_gqa=Hkv != H,
            )
            x = layer.proj.addmm(x, y.reshape(N, H * D))
            u = F.relu(layer.fc.mm(F.rms_norm(x, (C,))))
            x = layer.fc_proj.addmm(x, u * u)
            if i == self.backout_layer:
                saved = x
        if saved is not None:
            x = torch.add(x, saved, alpha=-self.backout_lambda)
        logits = self.lm_head.mm(F.rms_norm(x, (C,)))[:, : self.vocab_size]
        cap = self.softcap
        return torch.tanh(logits.float() / cap) * cap

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache: KVCache | SharedPrefixCache) -> torch.Tensor:
        if not isinstance(cache, KVCache):
            return super().__call__(ids, cache)
        pos = self._room_for_one(cache)
        device = ids.device
        idx = ids.view(-1)
        pos_t = torch.tensor([pos], device=device)
        prev, has_prev = _previous(cache, idx)
        logits = self.forward_static(idx, pos_t, prev, has_prev, cache.k_cache, cache.v_cache)
        cache.prev_token = idx
        cache.advance(1)
        return logits


class CudaGraphStep:
    """A StaticDecodeStep captured as a CUDA graph per cache, replayed every decode step.

    Inputs are copied into static buffers (no host sync: the position is written by a fill
    kernel), the graph writes K/V into the cache's own memory, and the logits come back in a
    static buffer. A new cache (a new conversation, a rebuilt context) is captured afresh, on
    the cache's own device (a server runs one worker per GPU).
    """

    wants_full_cache = True
    reads_whole_cache = True
    # One capture at a time in a process (torch.cuda.CUDAGraph's rule): a server's workers,
    # one a GPU, each capture a new request's cache on their own thread.
    _capturing = threading.Lock()

    def __init__(self, step: StaticDecodeStep) -> None:
        self.step = step
        self._graph: torch.cuda.CUDAGraph | None = None
        # The cache the graph was captured on, held so its memory cannot be reused by
        # another tensor while the graph still points at it.
        self._captured_on: torch.Tensor | None = None

    def _capture(self, cache: KVCache, idx: torch.Tensor) -> None:
        self._ids = idx.clone()
        self._prev, self._has_prev = (t.clone() for t in _previous(cache, idx))
        self._pos = torch.full((1,), cache.get_pos(), dtype=torch.long, device=idx.device)

        def run() -> torch.Tensor:
            return self.step.forward_static(
                self._ids, self._pos, self._prev, self._has_prev, cache.k_cache, cache.v_cache
            )

        # Warm-up and capture write this step's K/V at this position: the replay that
        # follows writes the same values there. Both on a stream of the cache's device:
        # torch.cuda.graph's default capture stream is made once, on whichever device was
        # current first, and a second GPU's kernels would run outside its capture.
        # thread_local: another worker's allocations on its own thread stay legal while
        # this one captures.
        side = torch.cuda.Stream(device=cache.k_cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager = run()  # also the check below; kernels pick their algorithms here
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with (
            self._capturing,
            torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"),
        ):
            self._logits = run()
        self._logits.fill_(float("nan"))  # a graph that recorded nothing fails the check
        graph.replay()
        if not torch.allclose(self._logits, eager, atol=0.1, rtol=0):
            raise RuntimeError("the captured decode step disagrees with the eager one")
        self._graph = graph
        self._captured_on = cache.k_cache

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache: KVCache | SharedPrefixCache) -> torch.Tensor:
        if not isinstance(cache, KVCache):
            return self.step(ids, cache)  # sample rows: the dynamic step
        pos = self.step._room_for_one(cache)
        idx = ids.view(-1)
        with torch.cuda.device(cache.k_cache.device):
            if self._captured_on is not cache.k_cache:
                self._capture(cache, idx)
            self._ids.copy_(idx)
            prev, has_prev = _previous(cache, idx)
            self._prev.copy_(prev)
            self._has_prev.copy_(has_prev)
            self._pos.fill_(pos)
            self._graph.replay()
            logits = self._logits.clone()
        cache.prev_token = idx.clone()
        cache.advance(1)
        return logits


class StepWithFallback(Fallback[torch.Tensor]):
    """A fast decode step (a CUDA graph's) that hands over to a plain one for good if it
    ever fails. The step's K/V writes happen before the cache advances, so the plain step
    simply redoes the same position. A ValueError is the caller's (a full context), not the
    fast path's: it passes through.

    It asks of the caches what the step in use asks: after a fallback, the plain step's
    (sample rows back over a shared prompt, caches no longer zeroed or whole)."""

    def __init__(
        self, fast: Callable[..., torch.Tensor], plain: Callable[..., torch.Tensor], what: str
    ) -> None:
        super().__init__(fast, plain, what, passes=(ValueError,))

    @property
    def wants_full_cache(self) -> bool:
        return self.current.wants_full_cache  # type: ignore[attr-defined]

    @property
    def reads_whole_cache(self) -> bool:
        return self.current.reads_whole_cache  # type: ignore[attr-defined]


class ModuleStep:
    """The model's own forward as a decode step: the last position's logits (N, V) of one
    token a row, over whatever cache it is given. What a failed CUDA graph hands over to:
    the static step it captured reads the whole context under a mask every token, which
    only a graph's single launch pays for."""

    wants_full_cache = False
    reads_whole_cache = False

    def __init__(self, model: GPT) -> None:
        self.model = model

    def __call__(self, ids: torch.Tensor, cache: KVCache | SharedPrefixCache) -> torch.Tensor:
        return self.model(ids, kv_cache=cache, last_only=True)[:, -1, :]


def _previous(cache: KVCache, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tokens before idx, 1 if there are any else 0) as tensors for a static step."""
    if cache.get_pos() > 0 and cache.prev_token is not None:
        return cache.prev_token, torch.ones(1, device=idx.device)
    return idx, torch.zeros(1, device=idx.device)
