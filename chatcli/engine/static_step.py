"""The decode step with static shapes, its CUDA graph, and what a failed graph falls back to.

Owns: StaticDecodeStep (the fused step's arithmetic with every shape fixed by the cache, so
that nothing depends on a host value), CudaGraphStep (that step captured once a cache and
replayed every token; a server's slot rows through static_slots.SlotGraphs), ModuleStep
(the model's own forward as a step) and StepWithFallback (the graph, or the module's forward
for good once the graph fails). StaticDecodeStep.forward_static is the static step's one
layer loop: a cache's rows at one position, or a server's slots each at its own. Every form equals
model.forward to float rounding. Knows nothing about sampling or the generation loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from chatcli.engine.decode_step import DecodeStep, has_decode_copies
from chatcli.engine.fallback import Fallback
from chatcli.engine.slot_step import forward_slots
from chatcli.engine.static_slots import CAPTURE, SlotGraphs
from chatcli.model.gpt import GPT, SMEAR_CHANNELS
from chatcli.model.kv_cache import KVCache, SharedPrefixCache
from chatcli.model.slot_cache import SlotRows


class StaticDecodeStep(DecodeStep):
    """The same step with every shape fixed by the cache rather than by the position.

    Keys are read over the whole preallocated cache under a mask, the position is a tensor
    and the K/V writes are index_copy_ at that position. Nothing depends on a host value, so
    the step can be captured once as a CUDA graph and replayed (CudaGraphStep). Plain
    KVCache rows only, one or many (Engine.fork copies the prompt into each sample row for
    it); rows over a shared prompt, should any come, take the dynamic step. It is not
    compiled on the CPU, where the fused eager step is faster.
    """

    reads_whole_cache = True  # under a mask: the Engine zeroes the caches it makes for it
    # Its shapes are the cache's: one row gets the whole context, the same shape every call.
    wants_full_cache = True
    takes_prompt_rows = False  # one row a slot: a GPU prefills a prompt in one forward

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
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The one layer loop of the static step: ids (N,), their tokens before `prev` (N,),
        used where has_prev (1 or N 0/1 values) is 1; k_all/v_all a cache's (L, S, T, Hkv,
        D) tensors. Without `slots`, the rows are the cache's rows, all at position pos (a
        1-element long tensor), and read their keys in place; with slots (N,), row i is
        slot slots[i] at position pos[i] (a server's batch, static_slots.SlotGraphs), its
        keys gathered. Returns logits (N, vocab_size)."""
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        N, T = ids.size(0), k_all.size(2)
        C = self.wte.size(1)
        cos = self.cos_table.index_select(0, pos)  # (1 or N, D)
        sin = self.sin_table.index_select(0, pos)
        if slots is not None:  # each row's heads its own angle: (N*(H+Hkv), D), as _qk_v lays them
            cos, sin = cos.repeat_interleave(H + Hkv, 0), sin.repeat_interleave(H + Hkv, 0)
        x = F.rms_norm(self._look_up(ids, self.wte), (C,))
        if self.smear:
            prev_x = F.rms_norm(self._look_up(prev, self.wte), (C,))
            gate = torch.sigmoid(torch.mv(x[:, :SMEAR_CHANNELS], self.smear_gate))
            gate = gate * (self.smear_lambda * has_prev.to(x.dtype))  # none without one
            x = torch.addcmul(x, prev_x, gate.unsqueeze(1))
        x0 = x
        saved = None
        keys = torch.arange(T, device=ids.device)
        at = pos.unsqueeze(1)  # (1 or N, 1)
        masks: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if self.lambdas:
                x = torch.add(x * layer.resid_lambda, x0, alpha=layer.x0_lambda)
            qk, v = self._qk_v(layer, x, ids, cos, sin)
            k_cache, v_cache = k_all[i], v_all[i]  # (S, T, Hkv, D)
            if slots is None:
                k_cache.index_copy_(1, pos, qk[:, H:].unsqueeze(1))
                v_cache.index_copy_(1, pos, v.unsqueeze(1))
                k_rows, v_rows = k_cache, v_cache
            else:
                k_cache.index_put_((slots, pos), qk[:, H:])
                v_cache.index_put_((slots, pos), v)
                k_rows, v_rows = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
            if layer.window not in masks:
                seen = (keys <= at) & (keys >= at - layer.window)
                masks[layer.window] = seen.view(seen.size(0), 1, 1, T)
            y = F.scaled_dot_product_attention(
                qk[:, :H].unsqueeze(2),
                k_rows.transpose(1, 2),
                v_rows.transpose(1, 2),
                attn_mask=masks[layer.window],
                enable_gqa=Hkv != H,
            )
            x = self._mlp(layer, layer.proj.addmm(x, y.reshape(N, H * D)))
            if i == self.backout_layer:
                saved = x
        if saved is not None:
            x = torch.add(x, saved, alpha=-self.backout_lambda)
        return self._capped_logits(x)

    def _capped_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(N, vocab_size) fp32 logits of the last hidden state x, softcapped."""
        logits = self.lm_head.mm(F.rms_norm(x, (x.size(1),)))[:, : self.vocab_size]
        cap = self.softcap
        return torch.tanh(logits.float() / cap) * cap

    @torch.inference_mode()
    def step_rows(
        self, ids: torch.Tensor, rows: SlotRows, out: list[int] | None = None
    ) -> torch.Tensor:
        """The static step over slot rows, eagerly: one row a slot, each continuing its
        sequence (a prompt runs through the model's forward: takes_prompt_rows is False)."""
        if rows.chained:
            raise ValueError("the static slot step takes one row a slot")
        positions = rows.room(self.model.max_positions)
        device = ids.device
        idx = ids.view(-1)
        logits = self.forward_static(
            idx, torch.tensor(positions, device=device), rows.previous(idx),
            torch.ones(1, device=device), rows.cache.k_cache, rows.cache.v_cache,
            torch.tensor(rows.slots, device=device),
        )  # fmt: skip
        rows.advance(idx)
        return logits if out is None else logits[out]

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache: KVCache | SharedPrefixCache) -> torch.Tensor:
        if not isinstance(cache, KVCache):
            return super().__call__(ids, cache)
        pos = self.room_for_one(cache)
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
    takes_prompt_rows = False

    def __init__(self, step: StaticDecodeStep) -> None:
        self.step = step
        self._graph: torch.cuda.CUDAGraph | None = None
        # The cache the graph was captured on, held so its memory cannot be reused by
        # another tensor while the graph still points at it.
        self._captured_on: torch.Tensor | None = None
        # A server's batch: one SlotCache for the worker's life, its graphs by batch size.
        self._slot_graphs: SlotGraphs | None = None

    @torch.inference_mode()
    def step_rows(
        self, ids: torch.Tensor, rows: SlotRows, out: list[int] | None = None
    ) -> torch.Tensor:
        """Slot rows through SlotGraphs: a graph per bucket of rows, captured for the
        SlotCache at first use (a new SlotCache captures afresh)."""
        graphs = self._slot_graphs
        if graphs is None or graphs.cache is not rows.cache:
            graphs = self._slot_graphs = SlotGraphs(self.step, rows.cache)
        logits = graphs(ids, rows)
        return logits if out is None else logits[out]

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
            CAPTURE,
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
        pos = self.step.room_for_one(cache)
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

    def step_rows(
        self, ids: torch.Tensor, rows: SlotRows, out: list[int] | None = None
    ) -> torch.Tensor:
        """Slot rows through the fast step's step_rows until it fails, then the plain one's
        (the same for good: a failed graph fails both ways)."""
        return self.run(lambda step: step.step_rows(ids, rows, out))

    @property
    def takes_prompt_rows(self) -> bool:
        return self.current.takes_prompt_rows  # type: ignore[attr-defined]

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
    takes_prompt_rows = False  # its forward takes a prompt whole, faster

    def __init__(self, model: GPT) -> None:
        self.model = model

    def __call__(self, ids: torch.Tensor, cache: KVCache | SharedPrefixCache) -> torch.Tensor:
        return self.model(ids, kv_cache=cache, last_only=True)[:, -1, :]

    def step_rows(
        self, ids: torch.Tensor, rows: SlotRows, out: list[int] | None = None
    ) -> torch.Tensor:
        """A row at a time, each over its own slot's cache (slot_step.forward_slots)."""
        return forward_slots(self, ids, rows, out)


def _previous(cache: KVCache, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tokens before idx, 1 if there are any else 0) as tensors for a static step."""
    if cache.get_pos() > 0 and cache.prev_token is not None:
        return cache.prev_token, torch.ones(1, device=idx.device)
    return idx, torch.zeros(1, device=idx.device)
