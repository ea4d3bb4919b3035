"""Model replicas behind a server: workers, the pool that lends them out, one generation each.

Owns: a Worker (one model + tokenizer + Engine on one device, taking one request at a time or,
with batch N, N at once as the rows of one batch; and the counters /stats shows), the
WorkerPool (an asyncio queue of the workers' free rows: a request waits there, in arrival
order, while every row is in use), and running each generation in a thread so the event loop stays free, passing its stream events
back through an asyncio queue. A generation whose consumer goes away (a client disconnect
cancels it) is told to stop and its row returns to the pool as soon as the generation lets
go of it: never earlier, so a worker never runs more generations than it has rows. Closing the pool (the server is shutting down) stops every running generation
and refuses every queued and later request with ShuttingDown.

Knows nothing of HTTP or the OpenAI format: it takes prompt token ids and yields batches of
chatcli.chat.stream events, then one Finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from chatcli.chat.stream import StreamEvent
from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.logprobs import LogprobRecord
from chatcli.engine.warm_cache import WarmCache, choose
from chatcli.serve.replies import (
    Emit,
    Finished,
    GenerationParams,
    ReplyText,
    ToLoop,
)

log = logging.getLogger(__name__)


class ShuttingDown(Exception):
    """The pool was closed: a queued request never runs, a running one was stopped."""

    def __init__(self) -> None:
        super().__init__("The server is shutting down.")


@dataclass(frozen=True)
class Waiting:
    """Yielded while a request is still queued for a worker, every `waiting_every` seconds:
    the consumer's cue to show it is alive (a stream's keep-alive comment)."""


class Worker:
    """One model replica. `generate` is synchronous and runs in a thread: one at a time, or,
    with batch N > 1, up to N at once, each in its own thread, decoding together as the rows
    of one batch (batch_worker.BatchWorker)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str = "0",
        cache_slots: int = 1,
        batch: int = 1,
        prefill_chunk: int | None = None,
    ) -> None:
        if cache_slots < 1:
            raise ValueError("a worker needs at least one cache slot")
        if batch < 1:
            raise ValueError("a worker needs at least one row (batch 1: one request at a time)")
        self.engine = Engine(model, tokenizer)
        self.tokenizer = tokenizer
        self.name = name
        self.device = str(model.get_device())
        self.rows = batch  # requests it takes at once
        self.rows_in_use = 0  # of those, lent out by the pool now
        self.requests_served = 0
        self.tokens_served = 0
        self.drafts_accepted = 0  # of the served replies' tokens, those drafted (--speculate)
        self.requests_interrupted = 0  # stopped early: the client left, or the server closed
        self._batch: Any = None
        if batch > 1:
            # Here, not at the top: batch_worker builds on this module's types.
            from chatcli.serve.batch_worker import BatchWorker

            self._batch = BatchWorker(self.engine, tokenizer, batch, cache_slots, prefill_chunk)
            self.slots = self._batch.slots
        else:
            # The last conversations' K/V (each slot a whole context's worth of memory): a
            # client that resends its conversation with one more turn gets only that turn
            # prefilled. On CUDA the decode step keeps one graph, captured for a cache: one
            # slot keeps it for the worker's life, several capture again as requests switch.
            self.slots = [WarmCache(self.engine) for _ in range(cache_slots)]
        self.warm = self.slots[0]  # the slot the last request used (one row at a time)

    @property
    def busy(self) -> bool:
        """Whether any of its rows is lent out."""
        return self.rows_in_use > 0

    @property
    def context_len(self) -> int:
        return self.engine.context_len

    @property
    def scheduler(self) -> Any:
        """The Scheduler whose rows a worker of batch > 1 runs its requests in, else None."""
        return None if self._batch is None else self._batch.batch

    def generate(
        self, prompt: list[int], params: GenerationParams, emit: Emit, stop: threading.Event
    ) -> Finished:
        """Run one reply to the end (or until `stop` is set), emitting events as they form.

        The prompt goes to one of the worker's warm caches (warm_cache.choose) and is
        prefilled past the longest prefix it shares with what that cache holds (an earlier
        request's prompt and reply). With batch > 1 it joins the worker's batch (up to
        `rows` callers at once) and returns when its row is over."""
        if self._batch is not None:
            return self._batch.generate(prompt, params, emit, stop)
        self.warm = choose(self.slots, prompt)
        reply = ReplyText(self.tokenizer, params.stop, emit)
        stats = GenerationStats()
        record = None if params.logprobs is None else LogprobRecord(params.logprobs)
        steps = self.engine.generate(
            prompt,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            stats=stats,
            warm=self.warm,
            logprobs=record,
            grammar=params.grammar,
        )
        with contextlib.closing(steps):
            for column, masks in steps:
                logprob = record.columns[-1][0] if record is not None else None
                if stop.is_set() or reply.feed(column[0], masks[0], logprob):
                    break

        def finished(reason: str) -> Finished:
            cached = len(prompt) - stats.prefill_tokens
            accepted = stats.speculation.accepted
            return Finished(reason, len(prompt), reply.generated, cached, stats.decode_s, accepted)

        if stop.is_set():
            return finished("interrupted")
        if reply.stopped:
            return finished("stop")
        # Found in the text the decoder held back to the end, or the engine's reason.
        return finished("stop" if reply.flush() else stats.finish_reasons[0])

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": self.device,
            "busy": self.busy,
            "rows": self.rows,
            "rows_in_use": self.rows_in_use,
            "requests_served": self.requests_served,
            "tokens_served": self.tokens_served,
            "drafts_accepted": self.drafts_accepted,
            "requests_interrupted": self.requests_interrupted,
            "cache_slots": len(self.slots),
        }


class WorkerPool:
    """Lends workers' rows out, one a request (a worker of batch N has N); requests beyond
    the rows wait their turn."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        if not workers:
            raise ValueError("a WorkerPool needs at least one worker")
        self.workers = list(workers)
        # Python >= 3.10: the queue binds to the event loop on first use, not here. None in
        # it is the closed pool's answer: each waiter that takes it puts it back for the next.
        # A worker is in it once for each of its free rows; round-robin, so requests spread
        # over the workers before they share one.
        self._idle: asyncio.Queue[Worker | None] = asyncio.Queue()
        for i in range(max(w.rows for w in self.workers)):
            for w in self.workers:
                if i < w.rows:
                    self._idle.put_nowait(w)
        self.waiting = 0  # requests queued for a worker right now
        self.closed = False
        self._running: set[threading.Event] = set()  # the stop events of running generations

    @property
    def tokenizer(self) -> Any:
        """Every worker holds the same model, so any worker's tokenizer serves for prompts."""
        return self.workers[0].tokenizer

    @property
    def context_len(self) -> int:
        return self.workers[0].context_len

    def queue_full(self, max_queue: int) -> bool:
        """Whether a new request would find every row in use and `max_queue` already waiting."""
        return self._idle.empty() and self.waiting >= max_queue

    def close(self) -> None:
        """Stop every running generation and refuse every queued and later request (both
        raise ShuttingDown in `generate`). On the event loop; a stopped generation ends
        after the model step it is in."""
        if self.closed:
            return
        self.closed = True
        for stop in self._running:
            stop.set()
        self._idle.put_nowait(None)

    async def acquire(self) -> Worker:
        if self.closed:
            raise ShuttingDown()
        self.waiting += 1
        try:
            # Cancelling this wait (the client left while queued) takes no worker with it.
            worker = await self._idle.get()
        finally:
            self.waiting -= 1
        if worker is None or self.closed:
            self._idle.put_nowait(worker)  # for the next waiter, which must learn it too
            raise ShuttingDown()
        worker.rows_in_use += 1
        return worker

    def release(self, worker: Worker) -> None:
        worker.rows_in_use -= 1
        self._idle.put_nowait(worker)

    async def generate(
        self, prompt: list[int], params: GenerationParams, waiting_every: float | None = None
    ) -> AsyncIterator[list[StreamEvent] | Finished | Waiting]:
        """Wait for a worker, then yield batches of events and finally one Finished.

        Each batch holds every event the thread produced since the consumer last looked, so a
        slow consumer gets fewer, larger batches instead of falling behind one token at a time.
        With `waiting_every`, a Waiting comes every that many seconds the request is queued.
        Closing or cancelling this iterator stops the generation. Raises ShuttingDown when
        the pool is closed before or during the generation.
        """
        getting = asyncio.ensure_future(self.acquire())
        try:
            while not getting.done():
                await asyncio.wait({getting}, timeout=waiting_every)
                if not getting.done():
                    yield Waiting()
        except BaseException:  # closed or cancelled while queued
            # cancel() is False once the task is done: it may hold a worker, to give back.
            if not getting.cancel() and getting.exception() is None:
                self.release(getting.result())
            raise
        worker = getting.result()
        if self.closed:  # closed between the worker's coming free and this resuming
            self.release(worker)
            raise ShuttingDown()
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[list[StreamEvent] | Finished | BaseException] = asyncio.Queue()
        stop = threading.Event()
        self._running.add(stop)

        to_loop = ToLoop(loop, items, stop)

        def done(result: Finished | Exception) -> None:
            # On the loop. Runs whether or not anyone still reads `items`: the worker must
            # come back to the pool even when its client has gone.
            if isinstance(result, Finished) and result.finish_reason == "interrupted":
                worker.requests_interrupted += 1
            elif isinstance(result, Finished):
                worker.requests_served += 1
                worker.tokens_served += result.completion_tokens
                worker.drafts_accepted += result.drafts_accepted
            self.release(worker)
            items.put_nowait(result)

        def run() -> None:
            try:
                result: Finished | Exception = worker.generate(prompt, params, to_loop, stop)
            except Exception as e:  # handed to the consumer, which raises it on the loop
                log.exception("generation failed on worker %s", worker.name)
                result = e
            try:
                loop.call_soon_threadsafe(done, result)
            except RuntimeError:
                worker.rows_in_use -= 1

        threading.Thread(target=run, name=f"chatcli-worker-{worker.name}", daemon=True).start()
        try:
            while True:
                batch: list[StreamEvent] = []
                item = await items.get()
                while True:
                    if isinstance(item, BaseException):
                        raise item
                    if isinstance(item, Finished):
                        if batch:
                            yield batch
                        # Only close() stops a generation whose consumer is still here.
                        if item.finish_reason == "interrupted" and self.closed:
                            raise ShuttingDown()
                        yield item
                        return
                    batch += item
                    if items.empty():
                        break
                    item = items.get_nowait()
                yield batch
        finally:
            stop.set()
            self._running.discard(stop)

    def describe(self) -> dict[str, Any]:
        busy = sum(w.busy for w in self.workers)
        return {
            "workers": [w.describe() for w in self.workers],
            "busy": busy,
            "idle": len(self.workers) - busy,
            "rows": sum(w.rows for w in self.workers),
            "rows_in_use": sum(w.rows_in_use for w in self.workers),
            "queue_length": self.waiting,
            "requests_served": sum(w.requests_served for w in self.workers),
            "tokens_served": sum(w.tokens_served for w in self.workers),
            "drafts_accepted": sum(w.drafts_accepted for w in self.workers),
            "requests_interrupted": sum(w.requests_interrupted for w in self.workers),
        }
