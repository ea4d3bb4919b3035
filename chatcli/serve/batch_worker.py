"""A worker's batch: up to N requests generating together, one decode step for all.

Owns: BatchWorker, what a Worker of batch N > 1 runs its requests through. Each request's
thread (the WorkerPool's, one a request as for batch 1) hands its prompt in and waits; one
loop thread of the worker's own takes requests into the engine's Scheduler as rows come free,
steps it, turns each row's tokens into that request's stream events (worker_pool.ReplyText)
and ends a row when it finishes, matches a stop sequence, or its request is stopped (the
client left, the server closes), which frees its slot before the next step. The thread runs
while there is work and ends when there is none; the next request starts it again.

A slot of the batch keeps its conversation's K/V between requests (a WarmCache, as batch 1's
cache slots): a client's next turn, sent to the same worker, prefills only what is new.
Knows nothing of HTTP or the event loop (the WorkerPool's side).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from chatcli.engine.engine import Engine
from chatcli.engine.scheduler import Generation, RowRequest, Scheduler, default_prefill_chunk
from chatcli.engine.warm_cache import WarmCache
from chatcli.serve.replies import Emit, Finished, GenerationParams, ReplyEvent, ReplyText, emit_all

log = logging.getLogger(__name__)

# A step's events go to the event loop at most this often (a row's first token and its end
# at once): each hand-over wakes the loop's thread, which then writes every stream's chunk
# and holds the GIL while it does. 8 streams of the embedded model handed over every step
# spent a fifth to a third of the batch's thread waiting for the GIL; 20 ms is a frame and
# a bit, below what a reader sees as text arriving in bursts.
HAND_OVER_EVERY_S = 0.02


@dataclass(eq=False)
class _Job:
    """One request's way through the batch, between its thread and the loop's."""

    prompt: list[int]
    params: GenerationParams
    stop: threading.Event
    emit: Emit
    reply: ReplyText
    pending: list[ReplyEvent]  # events not yet handed over (emit_all)
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False  # some event was handed over already
    row: Generation | None = None
    result: Finished | None = None
    error: Exception | None = None


class BatchWorker:
    """The rows of one Worker: `generate` may be called from up to `rows` threads at once."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        rows: int,
        cache_slots: int = 1,
        prefill_chunk: int | None = None,
    ) -> None:
        chunk = prefill_chunk or default_prefill_chunk(engine.model.get_device())
        self.batch = Scheduler(engine, rows, slots=cache_slots, prefill_chunk=chunk)
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._incoming: deque[_Job] = deque()
        self._jobs: dict[Generation, _Job] = {}  # the loop's own: rows running now
        self._loop: threading.Thread | None = None
        self._handed_at = 0.0  # when the last step's events went over

    @property
    def slots(self) -> list[WarmCache]:
        return self.batch.slots

    def generate(
        self, prompt: list[int], params: GenerationParams, emit: Emit, stop: threading.Event
    ) -> Finished:
        """Worker.generate for one row of the batch: joins at the next step where a row is
        free, returns when the row is over (raises what its generation raised)."""
        pending: list[ReplyEvent] = []
        reply = ReplyText(self.tokenizer, params.stop, pending.extend)
        job = _Job(prompt, params, stop, emit, reply, pending)
        with self._lock:
            self._incoming.append(job)
            if self._loop is None:
                self._loop = threading.Thread(target=self._run, name="chatcli-batch", daemon=True)
                self._loop.start()
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def _run(self) -> None:
        """The loop: take requests in, step, hand tokens out, end rows; until no work is left.
        Should it break, every request it holds or that waits for it fails with the error
        (none is left waiting), and the next request starts a new loop."""
        try:
            while self._turn():
                pass
        except Exception as e:
            log.exception("the batch loop failed")
            with self._lock:
                jobs = [*self._jobs.values(), *self._incoming]
                self._incoming.clear()
                self._jobs.clear()
                self._loop = None
            for job in jobs:
                if job.row is not None:
                    self.batch.leave(job.row)
                job.error = e
                job.done.set()

    def _turn(self) -> bool:
        """One turn of the loop; False when no work is left (the loop then ends)."""
        with self._lock:
            if not self._incoming and not self._jobs:
                self._loop = None  # a request after this starts a new loop
                return False
            joining = []
            while self._incoming and len(joining) < self.batch.free_rows:
                joining.append(self._incoming.popleft())
        for job in joining:
            self._join(job)
        for job in [j for j in self._jobs.values() if j.stop.is_set()]:
            assert job.row is not None
            self.batch.leave(job.row)
            self._end(job)
        if not self._jobs:
            return True
        try:
            stepped = self.batch.step()
        except Exception as e:  # the rows shared the step: each one's request fails
            log.exception("a batched decode step failed")
            for job in list(self._jobs.values()):
                assert job.row is not None
                self.batch.leave(job.row)
                self._end(job, e)
            return True
        for row, token, mask in stepped.tokens:  # one token a row at most
            logprob = row.logprobs[0] if row.logprobs is not None else None
            if self._jobs[row].reply.feed(token, mask, logprob) and not row.done:
                self.batch.leave(row, "stop")  # a stop sequence: the row ends here
                stepped.finished.append(row)
        jobs = list(self._jobs.values())
        now = time.perf_counter()
        if now - self._handed_at >= HAND_OVER_EVERY_S or any(
            job.pending and not job.started for job in jobs
        ):
            self._hand_over(jobs)
            self._handed_at = now
        for row in stepped.finished:
            if row in self._jobs:
                self._end(self._jobs[row])
        return True

    def _join(self, job: _Job) -> None:
        if job.stop.is_set():  # stopped while it waited for a row
            job.result = Finished("interrupted", len(job.prompt), 0)
            job.done.set()
            return
        p = job.params
        request = RowRequest(
            job.prompt,
            p.max_tokens,
            p.temperature,
            p.top_k,
            p.top_p,
            p.seed,
            logprobs=p.logprobs,
            grammar=p.grammar,
        )
        try:
            job.row = self.batch.join(request)
        except Exception as e:  # the request's own fault (ContextOverflowError, ValueError)
            job.error = e
            job.done.set()
            return
        self._jobs[job.row] = job

    def _end(self, job: _Job, error: Exception | None = None) -> None:
        """The row is over (batch.leave was called): the request's result, its thread woken."""
        row = job.row
        assert row is not None
        del self._jobs[row]
        if error is not None:
            job.error = error
        else:
            reason = row.finish_reason
            if reason != "interrupted" and (job.reply.stopped or job.reply.flush()):
                reason = "stop"  # a stop sequence, maybe in the text held back to the end
            stats = row.stats
            cached = len(job.prompt) - stats.prefill_tokens
            job.result = Finished(
                reason,
                len(job.prompt),
                job.reply.generated,
                cached,
                stats.decode_s,
                stats.speculation.accepted,
            )
            self._hand_over([job])  # the text held back, before the result
        job.done.set()

    @staticmethod
    def _hand_over(jobs: list[_Job]) -> None:
        """The jobs' events so far to their consumers, in one call where they share a loop."""
        pending = [(job.emit, list(job.pending)) for job in jobs if job.pending]
        for job in jobs:
            job.started = job.started or bool(job.pending)
            job.pending.clear()
        if pending:
            emit_all(pending)
