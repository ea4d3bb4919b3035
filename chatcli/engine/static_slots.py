"""The static decode step for rows of independent sequences, and its CUDA graphs by batch size.

Owns: forward_slots_static (StaticDecodeStep's arithmetic for SlotRows: every shape fixed by
the SlotCache and the number of rows, each row's position, slot and previous token a tensor,
so nothing depends on a host value) and SlotGraphs (that step captured once per bucket of
rows, 1, 2, 4, 8, ... up to the cache's slots, and replayed: a server's GPU batch decodes in
one launch a step whatever its rows' lengths). Knows nothing about sampling or about which
conversation a slot holds.

A step of n rows runs in the smallest bucket that holds them; the rows past n repeat the
last row (its token, slot and position), so they write the same key and value to the same
place and their logits are dropped. Without a GPU, SlotGraphs runs the same bucketed step
eagerly over the same buffers (capture=False): the CPU stand-in the tests hold to the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from chatcli.model.gpt import SMEAR_CHANNELS
from chatcli.model.slot_cache import SlotCache, SlotRows

if TYPE_CHECKING:
    from chatcli.engine.static_step import StaticDecodeStep


def forward_slots_static(
    step: StaticDecodeStep,
    ids: torch.Tensor,
    pos: torch.Tensor,
    prev: torch.Tensor,
    slots: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
) -> torch.Tensor:
    """ids, pos, prev, slots (B,): row i's token, its position, the token before it and its
    slot of k_all/v_all ((L, S, T, Hkv, D), written at (slot, pos)). Returns logits
    (B, vocab_size). Every row continues a prompt (pos >= 1), so the smear always applies."""
    H, Hkv, D = step.n_head, step.n_kv_head, step.head_dim
    B, T = ids.size(0), k_all.size(2)
    C = step.wte.size(1)
    cos = step.cos_table.index_select(0, pos).repeat_interleave(H + Hkv, 0)  # (B*(H+Hkv), D)
    sin = step.sin_table.index_select(0, pos).repeat_interleave(H + Hkv, 0)
    x = F.rms_norm(step._look_up(ids, step.wte), (C,))
    if step.smear:
        prev_x = F.rms_norm(step._look_up(prev, step.wte), (C,))
        gate = torch.sigmoid(torch.mv(x[:, :SMEAR_CHANNELS], step.smear_gate)) * step.smear_lambda
        x = torch.addcmul(x, prev_x, gate.unsqueeze(1))
    x0 = x
    saved = None
    keys = torch.arange(T, device=ids.device)
    at = pos.unsqueeze(1)
    masks: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(step.layers):
        if step.lambdas:
            x = torch.add(x * layer.resid_lambda, x0, alpha=layer.x0_lambda)
        qk, v = step._qk_v(layer, x, ids, cos, sin)
        k_cache, v_cache = k_all[i], v_all[i]  # (S, T, Hkv, D)
        k_cache.index_put_((slots, pos), qk[:, H:])
        v_cache.index_put_((slots, pos), v)
        if layer.window not in masks:
            masks[layer.window] = ((keys <= at) & (keys >= at - layer.window)).view(B, 1, 1, T)
        y = F.scaled_dot_product_attention(
            qk[:, :H].unsqueeze(2),
            k_cache.index_select(0, slots).transpose(1, 2),
            v_cache.index_select(0, slots).transpose(1, 2),
            attn_mask=masks[layer.window],
            enable_gqa=Hkv != H,
        )
        x = step._mlp(layer, layer.proj.addmm(x, y.reshape(B, H * D)))
        if i == step.backout_layer:
            saved = x
    if saved is not None:
        x = torch.add(x, saved, alpha=-step.backout_lambda)
    return step._capped_logits(x)


def buckets_for(slots: int) -> list[int]:
    """The batch sizes graphs are captured for: powers of two below `slots`, and `slots`."""
    sizes, b = [], 1
    while b < slots:
        sizes.append(b)
        b *= 2
    return [*sizes, slots]


class _Bucket:
    """One bucket's fixed input buffers and its replay (a graph's, or the eager stand-in's)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.ids, self.pos, self.prev, self.slots = (
            torch.zeros(size, dtype=torch.long, device=device) for _ in range(4)
        )
        self.replay: Callable[[], None] | None = None
        self.logits: torch.Tensor | None = None
        self.graph: object | None = None  # the CUDA graph the replay runs, held


class SlotGraphs:
    """The static slot step of one SlotCache, a CUDA graph per bucket of rows, each captured
    at its first use and replayed after (capture=False: run eagerly over the same buffers)."""

    # One capture at a time in a process (torch.cuda.CUDAGraph's rule), as CudaGraphStep's.
    def __init__(self, step: StaticDecodeStep, cache: SlotCache, capture: bool = True) -> None:
        self.step, self.cache, self.capture = step, cache, capture
        self.device = cache.k_cache.device
        self.sizes = buckets_for(len(cache))
        self.buckets: dict[int, _Bucket] = {}

    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.sizes if b >= rows)

    def __call__(self, ids: torch.Tensor, rows: SlotRows) -> torch.Tensor:
        """ids (n, 1) for rows of this cache -> logits (n, V), each slot advanced by one."""
        if rows.cache is not self.cache:
            raise ValueError("these graphs were captured for another SlotCache")
        on_gpu = torch.cuda.device(self.device) if self.capture else contextlib.nullcontext()
        with on_gpu:
            return self._step(ids, rows)

    def _step(self, ids: torch.Tensor, rows: SlotRows) -> torch.Tensor:
        n = ids.size(0)
        if rows.chained:
            raise ValueError("the static slot step takes one row a slot")
        positions = rows.room(self.step.model.max_positions)
        size = self.bucket_for(n)
        bucket = self.buckets.get(size)
        fresh = bucket is None
        if fresh:
            bucket = self.buckets[size] = _Bucket(size, self.device)
        pad = size - n  # the last row again
        idx = ids.view(n)
        fill = [
            (bucket.ids, idx),
            (bucket.pos, torch.tensor(positions, device=self.device)),
            (bucket.prev, rows.previous(idx)),
            (bucket.slots, torch.tensor(rows.slots, device=self.device)),
        ]
        for buffer, values in fill:
            buffer[:n].copy_(values)
            if pad:
                buffer[n:].copy_(values[-1:].expand(pad))
        if fresh:
            self._prepare(bucket)
        assert bucket.replay is not None
        bucket.replay()
        assert bucket.logits is not None
        rows.advance(idx.clone())
        return bucket.logits[:n].clone()

    def _run(self, bucket: _Bucket) -> torch.Tensor:
        return forward_slots_static(
            self.step, bucket.ids, bucket.pos, bucket.prev, bucket.slots,
            self.cache.k_cache, self.cache.v_cache,
        )  # fmt: skip

    def _prepare(self, bucket: _Bucket) -> None:
        """The bucket's replay: eager over its buffers, or captured as a CUDA graph (the
        first run writes this step's K/V; the replay that follows writes the same)."""
        if not self.capture:

            def eager() -> None:
                bucket.logits = self._run(bucket)

            bucket.replay = eager
            return
        from chatcli.engine.static_step import CudaGraphStep

        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager_logits = self._run(bucket)  # kernels pick their algorithms here
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with (
            CudaGraphStep._capturing,
            torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"),
        ):
            bucket.logits = self._run(bucket)
        bucket.logits.fill_(float("nan"))  # a graph that recorded nothing fails the check
        graph.replay()
        if not torch.allclose(bucket.logits, eager_logits, atol=0.1, rtol=0):
            raise RuntimeError("the captured slot step disagrees with the eager one")
        bucket.graph = graph
        bucket.replay = graph.replay
