"""The Backend over a Ray Serve deployment of ChatReplica: the front's side of `--ray`.

Owns: sending each request to the deployment through a streaming DeploymentHandle, named by
its conversation (carried as Serve's multiplexed model id, which the deployment's router
reads to send a conversation's turns back to the replica holding its cache); reading the replica's stream back as the app's items (Waiting while Serve
still queues it); what the front counts (requests waiting for a replica, replicas busy, the
totals), and the replicas' own rows for /stats; and the faults: a replica that dies ends its
requests with ReplicaLost (a request it had not yet started is sent again, to a live
replica), a client that leaves cancels its request on the replica, close() ends them all.

Knows nothing of HTTP (chatcli.serve.app) and nothing of starting a cluster or deploying
(ray_cluster.py): it is handed a handle, the model's card and a way to list live replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import ReplicaUnavailableError

from chatcli.serve.backend import Item, conversation_key
from chatcli.serve.ray_replica import Accepted, ModelCard, Report
from chatcli.serve.replies import Finished, GenerationParams
from chatcli.serve.worker_pool import ShuttingDown, Waiting

log = logging.getLogger(__name__)

# A request whose replica died before it started is sent again this many times at most.
RESENDS = 2
# How often /health and /stats look for the live replicas (one call to Ray's GCS).
REFRESH_EVERY_S = 2.0
_REPLICA_GONE = (RayActorError, ReplicaUnavailableError)


class ReplicaLost(Exception):
    """The replica running a request stopped (it died, or Ray killed it) mid-reply."""

    def __init__(self, replica: str | None) -> None:
        who = f"replica {short_name(replica)}" if replica else "replica"
        super().__init__(
            f"The {who} running this request stopped before it finished. Send the request "
            "again: the other replicas take it while Ray starts a new one."
        )


def short_name(actor: str) -> str:
    """A replica's id without its deployment's: Serve names a replica's actor
    SERVE_REPLICA::APP#DEPLOYMENT#ID."""
    return actor.rsplit("#", 1)[-1]


class RayBackend:
    """Generations on a Serve deployment, each replica taking as many requests at once as its
    Worker has rows (the model card says)."""

    def __init__(
        self,
        handle: Any,
        card: ModelCard,
        list_replicas: Callable[[], list[str]],
        *,
        refresh_every: float = REFRESH_EVERY_S,
    ) -> None:
        self._handle = handle
        self._card = card
        self._list_replicas = list_replicas
        self._refresh_every = refresh_every
        self._live = list_replicas()  # actor names
        self._refreshed_at = time.monotonic()
        self._refreshing: asyncio.Future[None] | None = None
        self.closed = False
        self.waiting = 0  # sent, not yet accepted by a replica
        self._busy: dict[str, int] = {}  # replica -> its requests this front is reading
        self._rows: dict[str, dict[str, Any]] = {}  # replica -> what it last reported
        self._closing: set[asyncio.Future[None]] = set()
        self.totals = {
            "requests_served": 0,
            "tokens_served": 0,
            "drafts_accepted": 0,  # of those tokens, drafted (--speculate auto)
            "requests_interrupted": 0,  # the client left, or the server closed
            "requests_lost": 0,  # their replica died mid-reply
        }

    @property
    def tokenizer(self) -> Any:
        return self._card.tokenizer

    @property
    def context_len(self) -> int:
        return self._card.context_len

    def queue_full(self, max_queue: int) -> bool:
        """Every replica's rows in use (each takes card.rows requests at once) and
        `max_queue` waiting."""
        in_use = sum(min(self._busy.get(r, 0), self._card.rows) for r in self._live)
        return in_use >= len(self._live) * self._card.rows and self.waiting >= max_queue

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for closing in self._closing:
            if not closing.done():
                closing.set_result(None)

    async def generate(
        self, prompt: list[int], params: GenerationParams, waiting_every: float | None = None
    ) -> AsyncIterator[Item]:
        """Send the request to a replica, then yield what it streams back (see Backend).

        A request goes back to the replica that served its conversation's last turn where
        that one comes free soon enough, else to another (ray_router.py). Until a replica
        accepts it, it is queued in Serve's router, and Waiting comes every `waiting_every`
        seconds."""
        if self.closed:
            raise ShuttingDown()
        conversation = conversation_key(prompt, self._card.first_turn_end)
        closing = asyncio.get_running_loop().create_future()
        self._closing.add(closing)
        try:
            for attempt in range(RESENDS + 1):
                stream = _Stream(self, prompt, params, conversation)
                try:
                    async with contextlib.aclosing(stream.items(closing, waiting_every)) as items:
                        async for item in items:
                            yield item
                    return
                except _REPLICA_GONE as e:
                    if stream.replica is not None or attempt == RESENDS:
                        self.totals["requests_lost"] += 1
                        log.warning("replica %s died mid-request: %s", stream.replica, e)
                        raise ReplicaLost(stream.replica) from None
                    log.warning("replica died before taking a request; sending it again")
        finally:
            self._closing.discard(closing)

    def _accepted(self, replica: str, state: dict[str, Any]) -> None:
        self.waiting -= 1
        self._busy[replica] = self._busy.get(replica, 0) + 1
        self._rows[replica] = state

    def _ended(self, replica: str | None, finished: Finished | None, lost: bool) -> None:
        """One try at a request is over: finished, stopped early, or lost with its replica."""
        if replica is None:  # still queued
            self.waiting -= 1
            return
        self._busy[replica] -= 1
        if not self._busy[replica] and replica not in self._live:  # a replica that is gone
            del self._busy[replica]
            self._rows.pop(replica, None)
        if finished is not None and finished.finish_reason != "interrupted":
            self.totals["requests_served"] += 1
            self.totals["tokens_served"] += finished.completion_tokens
            self.totals["drafts_accepted"] += finished.drafts_accepted
        elif not lost:
            self.totals["requests_interrupted"] += 1

    def describe(self) -> dict[str, Any]:
        # Reads only: tests and scripts call this from other threads while the loop changes
        # the counts, and a rebuilt dict would lose a change made between read and write.
        self._refresh_soon()
        rows = []
        for actor in self._live:
            row = {
                "name": short_name(actor),
                "actor": actor,
                **{k: v for k, v in self._rows.get(actor, {}).items() if k != "name"},
                "busy": self._busy.get(actor, 0) > 0,
                "rows_in_use": self._busy.get(actor, 0),
            }
            rows.append(row)
        busy = sum(r["busy"] for r in rows)
        return {
            "backend": "ray",
            "workers": rows,
            "busy": busy,
            "idle": len(rows) - busy,
            "rows": len(rows) * self._card.rows,
            "rows_in_use": sum(self._busy.get(a, 0) for a in self._live),
            "queue_length": self.waiting,
            **self.totals,
        }

    def _refresh_soon(self) -> None:
        """Look for the live replicas when the last look is old, in a thread from the event
        loop: /health then answers from the last look rather than wait on the cluster."""
        if time.monotonic() - self._refreshed_at < self._refresh_every:
            return
        if self._refreshing is not None and not self._refreshing.done():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # called from outside the app (a script, a test): just look
            self._look()
            return
        self._refreshing = asyncio.ensure_future(asyncio.to_thread(self._look))

    def _look(self) -> None:
        try:
            self._live = self._list_replicas()
        except Exception as e:  # the cluster is unreachable: keep the last rows
            log.warning("cannot list the replicas: %s", e)
        self._refreshed_at = time.monotonic()


class _Stream:
    """One try at a request: its DeploymentResponseGenerator and where it got to."""

    def __init__(
        self, backend: RayBackend, prompt: list[int], params: GenerationParams, conversation: str
    ) -> None:
        self.backend = backend
        handle = backend._handle.options(stream=True, multiplexed_model_id=conversation)
        self.response = handle.generate.remote(prompt, params)
        self.replica: str | None = None

    async def items(
        self, closing: asyncio.Future[None], waiting_every: float | None
    ) -> AsyncIterator[Item]:
        backend = self.backend
        backend.waiting += 1
        finished: Finished | None = None
        lost = False
        step: asyncio.Future[Any] | None = None
        try:
            source = self.response.__aiter__()
            while finished is None:
                step = asyncio.ensure_future(source.__anext__())
                step.add_done_callback(_retrieve)
                while not step.done():
                    # Waiting only while queued: a replica that has the request streams.
                    every = waiting_every if self.replica is None else None
                    await asyncio.wait(
                        {step, closing}, timeout=every, return_when=asyncio.FIRST_COMPLETED
                    )
                    if closing.done():
                        raise ShuttingDown()
                    if not step.done():
                        yield Waiting()
                try:
                    item = step.result()
                except StopAsyncIteration:
                    raise RuntimeError("the replica's stream ended without a finish") from None
                except _REPLICA_GONE:
                    lost = True
                    raise
                except RayTaskError as e:  # the replica's generate raised: say what
                    raise (e.cause if isinstance(e.cause, Exception) else e) from None
                if isinstance(item, Accepted):
                    self.replica = item.replica
                    backend._accepted(item.replica, item.state)
                    continue
                if isinstance(item, Report):
                    backend._rows[item.replica] = item.state
                    continue
                if isinstance(item, Finished):
                    # Counted before the consumer sees it: one that stops reading at the
                    # Finished (a whole reply) may leave this generator suspended.
                    finished = item
                    backend._ended(self.replica, finished, lost=False)
                yield item
        finally:
            if finished is None:
                if step is not None and not step.done():
                    step.cancel()
                # Stops the generation on its replica (Serve cancels the replica's task).
                self.response.cancel()
                backend._ended(self.replica, None, lost)


def _retrieve(step: asyncio.Future[Any]) -> None:
    """Read a finished step's outcome, so one nobody awaited (cancelled, or left behind by a
    closing stream) logs no "exception was never retrieved"."""
    if not step.cancelled():
        step.exception()
