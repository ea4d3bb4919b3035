"""The static decode step for rows of independent sequences, and its CUDA graphs by batch size.

Owns: SlotGraphs (the static step over SlotRows, StaticDecodeStep.forward_static with each
row's position, slot and previous token a tensor, so nothing depends on a host value,
captured once per bucket of rows, 1, 2, 4, 8, ... up to the cache's slots, and replayed: a
server's GPU batch decodes in one launch a step whatever its rows' lengths) and CAPTURE, the
process's one lock around a CUDA graph capture. Knows nothing about sampling or about which
conversation a slot holds.

A step of n rows runs in the smallest bucket that holds them; the rows past n repeat the
last row (its token, slot and position), so they write the same key and value to the same
place and their logits are dropped. Without a GPU, SlotGraphs runs the same bucketed step
eagerly over the same buffers (capture=False): the CPU stand-in the tests hold to the model.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from chatcli.model.slot_cache import SlotCache, SlotRows

# One capture at a time in a process (torch.cuda.CUDAGraph's rule): a server's workers, one a
# GPU, each capture on their own thread (CudaGraphStep's one-row graphs and these).
CAPTURE = threading.Lock()


class StaticRows(Protocol):
    """The static step as SlotGraphs runs it (StaticDecodeStep)."""

    model: Any  # max_positions

    def forward_static(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        prev: torch.Tensor,
        has_prev: torch.Tensor,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


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

    def __init__(self, step: StaticRows, cache: SlotCache, capture: bool = True) -> None:
        self.step, self.cache, self.capture = step, cache, capture
        self.device = cache.k_cache.device
        self.sizes = buckets_for(len(cache))
        self.buckets: dict[int, _Bucket] = {}
        self._has_prev = torch.ones(1, device=self.device)

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
        # Every row continues its sequence (pos >= 1): the smear always applies.
        return self.step.forward_static(
            bucket.ids, bucket.pos, bucket.prev, self._has_prev, self.cache.k_cache,
            self.cache.v_cache, bucket.slots,
        )  # fmt: skip

    def _prepare(self, bucket: _Bucket) -> None:
        """The bucket's replay: eager over its buffers, or captured as a CUDA graph (the
        first run writes this step's K/V; the replay that follows writes the same)."""
        if not self.capture:

            def eager() -> None:
                bucket.logits = self._run(bucket)

            bucket.replay = eager
            return
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager_logits = self._run(bucket)  # kernels pick their algorithms here
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with (
            CAPTURE,
            torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"),
        ):
            bucket.logits = self._run(bucket)
        bucket.logits.fill_(float("nan"))  # a graph that recorded nothing fails the check
        graph.replay()
        if not torch.allclose(bucket.logits, eager_logits, atol=0.1, rtol=0):
            raise RuntimeError("the captured slot step disagrees with the eager one")
        bucket.graph = graph
        bucket.replay = graph.replay
