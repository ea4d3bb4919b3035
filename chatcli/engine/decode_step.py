"""The fused decode step of our GPT (one token per row) in as few operations as the math allows.

Owns: DecodeStep, the step every fp32 model runs on the CPU: through our C kernel where it
compiles (kernels.rows_step: a small fp32 model's whole step, one row or many, or a big
one's fp16, int8 or int4 copies read from their panels, in one call), else the same arithmetic
in torch ops, about half as many as the module forward's:

- q, k and v come from one product over the three matrices stacked (step_matrices.py);
- the rotary embedding of q and k is one (rows*(H+Hkv), D) @ (D, D) product with a fixed
  signed permutation plus one fused multiply-add, with the cos/sin rows picked once per step;
- the qk-norm of all heads is 4 ops on their norms, the era's qk scale folded in (fp32 on
  the CPU; elsewhere rms_norm, the scale its weight in fp32 or multiplied after in bf16);
- residual adds fuse into addmm/addmv, and the scalar lambdas become Python floats;
- every RMSNorm that feeds a matrix is folded into the product after it, as the rows'
  (N, 1) scales (row_scales), one row or many alike;
- sample rows over a shared prompt: two fused attention calls whose log-sum-exps combine
  the prompt's part and each row's own part exactly (step_attention.py).

A small model fits in cache, so its step costs what its ops cost to dispatch, not what they
compute; a big one is bandwidth-bound and reads the compact decode copies (quantize.py) its
modules keep. The step equals model.forward to float rounding (the tests hold every era to
2e-5, the kernel and torch's ops, and greedy output to identity). Its products and attention
run on the threads that measure faster (cpu_plan.ThreadChoice), the rest on one. The static
and CUDA graph forms are static_step.py's; step_choice.py picks one for a model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from chatcli.engine.cpu_plan import SMALL_MODEL_PARAMS, ThreadChoice, available_cores
from chatcli.engine.slot_step import visible_keys
from chatcli.engine.step_attention import attend_over_prefix, attend_rows, attend_slots
from chatcli.engine.step_matrices import StepLayer, StepMatrix, run_on_threads
from chatcli.kernels.panels import Matrix
from chatcli.kernels.rows_step import RowsLayer, RowsModel, RowsStep, rows_step
from chatcli.model.gpt import GPT, SMEAR_CHANNELS
from chatcli.model.kv_cache import KVCache, SharedPrefixCache
from chatcli.model.linear import is_embedding_table
from chatcli.model.slot_cache import SlotRows


class DecodeStep:
    """Callable (ids (N, 1), cache) -> logits (N, V); advances the cache like model.forward.

    The cache is a KVCache with N rows or a SharedPrefixCache over N sample rows.
    """

    wants_full_cache = False  # any cache shape: it reads what was written, nothing more
    reads_whole_cache = False
    takes_prompt_rows = True  # step_rows takes a prompt's chunk as rows of one slot

    def __init__(self, model: GPT, kernel: bool = True) -> None:
        """kernel=False: torch's ops even where our kernel compiles (the reference that the
        kernel is tested against)."""
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
        self.lm_head = StepMatrix([model.lm_head])
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
                StepLayer(
                    qkv=StepMatrix([a.c_q, a.c_k, a.c_v], stacked_in=a),
                    proj=StepMatrix([a.c_proj]),
                    fc=StepMatrix([m.c_fc]),
                    fc_proj=StepMatrix([m.c_proj]),
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
        # core, among hundreds of small ops, which on two threads pay a fork/join each: its
        # products and its attention (which streams the cache) run on the caller's threads,
        # everything else on one. A small model's products and attention read more than a
        # core's L2 holds, so they may gain from a second core too; which count is faster is
        # measured as it runs (ThreadChoice). Our kernel starts on every core (__call__).
        # The figures: docs/performance-notes.md, "Threads of the fused step".
        self.split_threads = model.num_params() >= SMALL_MODEL_PARAMS
        self._thread_choices: dict[tuple[int, int], ThreadChoice] = {}
        self.wide_threads = 1  # the products' and attention's count (__call__ sets it)
        self._eps = torch.finfo(self.dtype).eps  # F.rms_norm's default
        # fp32 on the CPU: the qk-norm in 4 ops (qk_norm_lean), and sample rows fold each
        # RMSNorm into a per-row scale (row_scales), but only where every product takes its
        # rows as floats: fbgemm's int8 kernel quantizes a product's input with one scale for
        # all its rows, which must see the rows normalised, as the module forward gives them.
        self.lean = self.dtype == torch.float32 and self.wte.device.type == "cpu"
        self.fold_norms = self.lean and all(c.float_activations for c in model.decode_weights())
        # The whole step, one row or many, in one call of our own kernel
        # (kernels/rows_step.py) where it compiles here: a small fp32 model's ~150 small ops
        # become one; a big model's fp16 copies are read from their own panels, and the ~300
        # ops and thread hand-offs between its products go.
        self._rows_model: RowsModel | None = None
        self._embed_native = False
        self.use_kernel(kernel)
        self._rows_cache: object | None = None  # the last cache checked for the kernel
        self._rows_takes = False  # and whether the kernel reads it
        self._rows_prefix: tuple[torch.Tensor, torch.Tensor] | None = None  # its shared prompt
        # eps times the squared divisors row_scales is asked for: 1, the qk scale, the softcap
        self._eps_scaled = {
            t: torch.tensor(self._eps * t * t, dtype=self.dtype)
            for t in (1.0, 1.0 / self.qk_scale, self.softcap)
        }
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def use_kernel(self, on: bool) -> None:
        """Run the step through our kernel where it compiles (on) or through torch's ops."""
        self._rows_model = self._native_rows() if on else None
        # ... and the rows it starts from (look-ups, norms, the smear) in one more call.
        self._embed_native = self._rows_model is not None and rows_step().embeds(self.wte)
        self._rows_cache = None

    @property
    def kernel_model(self) -> RowsModel | None:
        """The model as our kernel reads it, or None where the step runs torch's ops."""
        return self._rows_model

    @property
    def embeds_natively(self) -> bool:
        """Whether our kernel also looks up and normalises the rows a step starts from."""
        return self._embed_native

    def _native_rows(self) -> RowsModel | None:
        """The model as rows_step reads it (step_matrices.kernel_model), or None where the
        kernel does not apply: norms not folded, an odd head size, no compiler."""
        if not (self.fold_norms and self.head_dim % 2 == 0):
            return None
        kernel = rows_step()
        return None if kernel is None else self._kernel_model(kernel)

    def _kernel_model(self, kernel: RowsStep) -> RowsModel | None:
        """The step's model as the rows_step kernel reads it, or None where it does not apply:
        matrices neither all fp32 and small (weight_t) nor all fp16 copies in half panels nor
        all int8 or all int4 copies in their panels (bf16 copies; fp16 where the CPU lacks
        F16C, int8 where it lacks AVX2, int4 where it has no integer dot products or a width
        is not whole groups), tables other than fp32 or bf16."""
        source: dict[int, Matrix] = {}
        for m in self.matrices:
            if m.weight_t is not None:
                source[id(m)] = m.weight_t
                continue
            copies = m.copies  # one compact copy (a stacked one for q, k, v) keeps panels
            one = copies[0] if len(copies) == 1 else None
            panels = (
                getattr(one, "half_panels", None)
                or getattr(one, "int8_panels", None)
                or getattr(one, "int4_panels", None)
            )
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

    def kernel_takes(self, cache: KVCache | SharedPrefixCache, rows: int) -> bool:
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
        narrow = {"float16": " fp16", "int8": " int8", "int4": " int4"}
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

    def _embed(self, idx: torch.Tensor, prev: torch.Tensor | None, fold: bool) -> torch.Tensor:
        """The rows (N, C) the layers start from, through torch's ops: the tokens'
        normalised embeddings, plus the smear of the previous tokens `prev` where given (-1:
        a sequence's first token, left unsmeared as the model's forward leaves it)."""
        if prev is not None and not bool((prev >= 0).all()):
            x = self._embed(idx, None, fold)
            has = prev >= 0
            x[has] = self._embed(idx[has], prev[has], fold)
            return x
        x = self._look_up(idx, self.wte)
        x = x.mul_(self.row_scales(x)) if fold else F.rms_norm(x, (x.size(1),))
        if prev is not None:
            prev = F.rms_norm(self._look_up(prev, self.wte), (x.size(1),))
            gate = torch.sigmoid(torch.mv(x[:, :SMEAR_CHANNELS], self.smear_gate))
            x = torch.addcmul(x, prev, gate.mul_(self.smear_lambda).unsqueeze(1))
        return x

    def _look_up(self, idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(idx, table)
        return rows if table.dtype == self.dtype else rows.to(self.dtype)

    def room_for_one(self, cache: KVCache | SharedPrefixCache) -> int:
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
        layer: StepLayer,
        x: torch.Tensor,
        idx: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fold: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows x (N, C) -> (q and k after rope and qk-norm (N, H+Hkv, D), v (N, Hkv, D)).

        fold: the RMSNorm before the product is a per-row scale applied after it
        (row_scales)."""
        N, H, Hkv, D = x.size(0), self.n_head, self.n_kv_head, self.head_dim
        if fold:
            s = self.row_scales(x)
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
        qk = self.qk_norm_lean(qk) if self.lean else self.qk_norm(qk)
        return qk.view(N, H + Hkv, D), v

    def qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        D = self.head_dim
        if self.qk_norm_weight is not None:
            return F.rms_norm(qk, (D,), weight=self.qk_norm_weight)
        normed = F.rms_norm(qk, (D,))
        return normed * self.qk_scale if self.qk_scale != 1.0 else normed

    def qk_norm_lean(self, qk: torch.Tensor) -> torch.Tensor:
        """qk_norm in 4 ops where F.rms_norm dispatches ~9 on the CPU (pow, sum, div,
        add, rsqrt, mul, weight, casts): every head's RMSNorm scale divided by 1/qk_scale.
        In place: qk is a temporary."""
        return qk.mul_(self.row_scales(qk, times=1.0 / self.qk_scale))

    def _mlp(self, layer: StepLayer, x: torch.Tensor, fold: bool = False) -> torch.Tensor:
        """x plus the block's MLP, relu(fc(rms_norm(x)))^2 through fc_proj. fold: the norm as
        each row's scale after the product (relu(s * z) = s * relu(z) for a scale s > 0)."""
        if fold:
            u = layer.fc.mm(x).relu_().mul_(self.row_scales(x))
        else:
            u = layer.fc.mm(F.rms_norm(x, (x.size(1),))).relu_()
        return layer.fc_proj.addmm(x, u.mul_(u))

    def row_scales(self, x: torch.Tensor, times: float = 1.0) -> torch.Tensor:
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
        return self._on_threads(ids.size(0), self._step, ids, cache)

    @torch.inference_mode()
    def step_rows(
        self, ids: torch.Tensor, rows: SlotRows, out: list[int] | None = None
    ) -> torch.Tensor:
        """ids (N, 1), row i's token for slot rows.slots[i], each row at its own position
        (a slot's several rows: a prompt's chunk) -> float32 logits (len(out), vocab_size)
        of the rows `out` names (None: all); every slot advanced by its rows."""
        return self._on_threads(ids.size(0), self._step_slots, ids, rows, out)

    def _on_threads(self, rows: int, step: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """step(*args), a step of `rows` rows, on the threads chosen for that many rows."""
        caller = torch.get_num_threads()  # the caller's count may change between calls
        # The products' count: a big model's is the caller's, or one while a second thread
        # does not pay (another process busy on the cores; openmp_wait.py); a small model's
        # every core (our kernel) or one (torch's ops), each moving to the other where that
        # measured faster. Chosen per row count.
        wide = caller if self.split_threads else available_cores()
        if wide == 1:
            self._set_wide_threads(1)
            return step(*args)
        rows = 1 << (rows - 1).bit_length()  # by powers of two: a batch's rows vary a lot
        choice = self._thread_choices.get((rows, wide))
        if choice is None:
            # Our whole-step kernel shares each product among the cores; torch's ops pay a
            # fork/join each.
            many = self.split_threads or self._rows_model is not None
            preferred, other = (wide, 1) if many else (1, wide)
            choice = self._thread_choices[(rows, wide)] = ThreadChoice(preferred, other)
        self._set_wide_threads(choice.threads())
        torch.set_num_threads(1)
        try:
            t0 = time.perf_counter()
            logits = step(*args)
            choice.record(time.perf_counter() - t0)
            return logits
        finally:
            torch.set_num_threads(caller)

    def choose_threads(self, rows: int, wide: int, choice: ThreadChoice) -> None:
        """Start steps of `rows` rows (a power of two) with `wide` threads on hand from
        `choice` instead of the default one."""
        self._thread_choices[(rows, wide)] = choice

    @torch.inference_mode()
    def step_on(
        self, threads: int, ids: torch.Tensor, cache: KVCache | SharedPrefixCache
    ) -> torch.Tensor:
        """__call__ with its products and attention on `threads`, whatever was measured."""
        self._set_wide_threads(threads)
        return self._step(ids, cache)

    def _set_wide_threads(self, threads: int) -> None:
        """The count the attention (wide_threads) and every product (StepMatrix.threads) use."""
        self.wide_threads = threads
        if self.matrices[0].threads != threads:
            for m in self.matrices:
                m.threads = threads

    def _step(self, ids: torch.Tensor, cache: KVCache | SharedPrefixCache) -> torch.Tensor:
        N = ids.size(0)
        pos = self.room_for_one(cache)
        cos_table, sin_table = self._rope_tables()
        cos, sin = cos_table[pos], sin_table[pos]  # (D,), broadcast over rows and heads
        idx = ids.view(N)
        native = ids.device.type == "cpu" and self.kernel_takes(cache, N)
        fold = self.fold_norms
        smear = self.smear and pos > 0 and cache.prev_token is not None
        if native:  # every layer and the vocabulary's products in one call
            kernel = rows_step()
            if self._embed_native:
                prev = cache.prev_token if smear else None  # no smear: gate, lambda unread
                x = kernel.embed(self.wte, idx, self._eps, prev, self.smear_gate, self.smear_lambda)
            else:
                x = self._embed(idx, cache.prev_token if smear else None, fold)
            _, prefix_len, suffix = self._rows_caches(cache)
            logits = kernel.run(
                self._rows_model, x, idx, cos, sin, self._rows_prefix, prefix_len, suffix,
                pos, self.wide_threads,
            )  # fmt: skip
            cache.prev_token = idx
            cache.advance(1)
            return logits[:, : self.vocab_size]  # the softcap taken in the kernel
        x = self._embed(idx, cache.prev_token if smear else None, fold)
        threads = self.wide_threads
        if isinstance(cache, SharedPrefixCache):

            def attend(i: int, window: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                return attend_over_prefix(i, q, k, v, window, cache, pos, threads)

        else:

            def attend(i: int, window: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                return attend_rows(i, q, k, v, window, cache, pos, threads)

        x = self._layers(x, idx, cos, sin, attend)
        cache.prev_token = idx
        cache.advance(1)
        return self._logits(x)

    @torch.inference_mode()
    def _step_slots(
        self, ids: torch.Tensor, rows: SlotRows, out: list[int] | None = None
    ) -> torch.Tensor:
        """step_rows: each row its own slot's next token, at its own position, with its own
        rotary angles, previous token and window; a slot's several rows (a prompt's chunk)
        each attend the ones before it. Through our kernel's rows_step_slots where it applies
        (every row's products in one pass over the weights), else _layers, each row's keys
        written at their positions in one indexed write and read back under a mask that
        shows each row its own window only."""
        N = ids.size(0)
        if rows.batch_size != N:
            raise ValueError(f"{N} tokens for {rows.batch_size} rows")
        positions = rows.room(self.model.max_positions)
        pos = torch.tensor(positions, dtype=torch.long, device=ids.device)
        cos_table, sin_table = self._rope_tables()
        cos, sin = cos_table[pos], sin_table[pos]  # (N, D): each row's own angles
        idx = ids.view(N)
        prev = rows.previous(idx) if self.smear else None  # -1: a sequence's first token
        cache = rows.cache
        kernel = rows_step() if self._rows_model is not None and ids.device.type == "cpu" else None
        layout = (cache.k_cache, cache.v_cache)
        if kernel is not None and kernel.has_slots and kernel.takes_slots(self._rows_model, layout):
            if self._embed_native:
                x = kernel.embed(self.wte, idx, self._eps, prev, self.smear_gate, self.smear_lambda)
            else:
                x = self._embed(idx, prev, self.fold_norms)
            slots = torch.tensor(rows.slots, dtype=torch.long)
            logits = kernel.run_slots(
                self._rows_model, x, idx, cos, sin, slots, pos, layout, self.wide_threads, out
            )
            rows.advance(idx)
            return logits[:, : self.vocab_size]  # the softcap taken in the kernel
        heads = self.n_head + self.n_kv_head
        # Every head of a row turns by the row's angle: (N * (H + Hkv), D), as _qk_v lays them.
        cos, sin = cos.repeat_interleave(heads, 0), sin.repeat_interleave(heads, 0)
        slots = torch.tensor(rows.slots, dtype=torch.long, device=idx.device)
        cache.make_finite(rows.slots, max(positions) + 1)  # the keys the masks hide
        masks: dict[int, tuple[int, torch.Tensor]] = {}  # window -> (first key, mask)
        threads = self.wide_threads
        x = self._embed(idx, prev, self.fold_norms)

        def attend(i: int, window: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if window not in masks:
                masks[window] = visible_keys(positions, window, x.dtype, x.device)
            first, mask = masks[window]
            return attend_slots(i, q, k, v, cache, slots, pos, first, mask, threads)

        x = self._layers(x, idx, cos, sin, attend)
        rows.advance(idx)
        if out is not None:  # only these rows' logits: a prompt's tokens but its last need none
            x = x[out]
        return self._logits(x)

    def _layers(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[int, int, Tensor, Tensor, Tensor], Tensor],
    ) -> torch.Tensor:
        """The transformer's layers over rows x (N, C) in torch's ops: the one layer loop of
        this step, whatever the rows are (a cache's rows at one position, sample rows over a
        shared prompt, a server's slots); attend(layer, window, q, k, v) writes the rows'
        keys and values where they go and returns each row's attention (N, H, D)."""
        H, D, fold = self.n_head, self.head_dim, self.fold_norms
        N = x.size(0)
        x0 = x
        saved = None
        for i, layer in enumerate(self.layers):
            if self.lambdas:
                x = torch.add(x * layer.resid_lambda, x0, alpha=layer.x0_lambda)
            qk, v = self._qk_v(layer, x, idx, cos, sin, fold)
            y = attend(i, layer.window, qk[:, :H], qk[:, H:], v)
            x = self._mlp(layer, layer.proj.addmm(x, y.reshape(N, H * D)), fold)
            if i == self.backout_layer:
                saved = x
        if saved is not None:
            x = torch.add(x, saved, alpha=-self.backout_lambda)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The rows' logits (N, V) from the last layer's x: the last norm, the vocabulary's
        product, the softcap."""
        cap = self.softcap
        if self.fold_norms:  # the last norm joins the softcap's division
            logits = self.lm_head.mm(x)[:, : self.vocab_size]
            scales = self.row_scales(x, times=cap)
            return run_on_threads(self.wide_threads, _soft_cap, logits, cap, scales)
        logits = self.lm_head.mm(F.rms_norm(x, (x.size(1),)))[:, : self.vocab_size].float()
        return run_on_threads(self.wide_threads, _soft_cap, logits, cap)


def has_decode_copies(model: GPT) -> bool:
    return bool(model.decode_weights())


def _soft_cap(
    logits: torch.Tensor, cap: float, scale: torch.Tensor | float | None = None
) -> torch.Tensor:
    """cap * tanh(logits * scale), or of logits / cap without a scale, in place. Over a big
    vocabulary tanh is the step's costliest elementwise op, so a big model runs it on the
    products' threads."""
    scaled = logits.div_(cap) if scale is None else logits.mul_(scale)
    return scaled.tanh_().mul_(cap)
