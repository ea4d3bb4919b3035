"""One model replica inside a Ray Serve deployment: what runs on the cluster's machines.

Owns: ReplicaSpec (what every replica loads, sent to each of them), ChatReplica (the
deployment's class: the model loaded once, one Worker and its WorkerPool, a streaming
`generate`), and the items a replica streams besides the WorkerPool's (Accepted first, a
Report of its counters before Finished). A replica is our Worker unchanged: the same engine
path, warm caches and stop handling as `chatcli serve` on one machine; Serve only carries
the calls and the streams.

Conversations: each request carries its conversation's key as Serve's multiplexed model id
(backend.conversation_key). The front's router sends a conversation back to the replica it
last sent it to (ray_router.py); a replica also "loads" the key, a no-op through Serve's
model multiplexing that tells every router which conversations it holds, which a router
that has not seen the conversation (a restarted front) goes by. It forgets the least
recently used beyond its cache slots, as the Worker's warm caches do.

Knows nothing of HTTP or of the front: ray_cluster.py deploys this class, ray_backend.py
reads its streams. Imported only where Ray is installed (the `[ray]` extra).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from chatcli.model.special_tokens import USER_END
from chatcli.serve.replies import Finished, GenerationParams
from chatcli.serve.worker_pool import Waiting, Worker, WorkerPool

# The least time between two batches of a reply's tokens sent to the front.
STREAM_EVERY_S = 0.01


@dataclass(frozen=True)
class ReplicaSpec:
    """The model every replica loads, with `chatcli serve`'s options. The checkpoint must be
    at `model` on every machine a replica may run on (or be the embedded default)."""

    model: str | None = None
    source: str = "sft"
    step: int | None = None
    dtype: str = "auto"
    quantize: str = "none"
    softcap: float | None = None
    cache_slots: int = 1
    device: str = "cpu"  # "cuda" for a replica Ray gave a GPU (it sees that one only)
    batch: int = 1  # requests its Worker decodes together (`chatcli serve --batch`)
    speculate: bool = False  # drafts from the conversation (`--speculate auto`)

    def load(self) -> tuple[Any, Any]:
        """(model, tokenizer), as the replica's Worker takes them."""
        from chatcli.model.checkpoint import load_model

        model, tokenizer, _ = load_model(
            self.model,
            source=self.source,
            step=self.step,
            device=self.device,
            dtype=self.dtype,
            quantize=self.quantize,
            softcap=self.softcap,
        )
        return model, tokenizer


@dataclass(frozen=True)
class ModelCard:
    """What the front needs of the model to take requests: a replica sends it once."""

    name: str
    context_len: int
    tokenizer: Any
    first_turn_end: int  # <|user_end|>'s id: the end of a conversation's key (backend.py)
    device: str  # the replica's, as its model is on it
    threads: int | None  # torch's threads on a CPU replica (cpu_plan), None on a GPU
    rows: int = 1  # requests a replica takes at once (its Worker's batch)


@dataclass(frozen=True)
class Accepted:
    """A replica's first item for every request: it has the request (no longer queued)."""

    replica: str  # the replica's Ray actor name
    state: dict[str, Any]  # ChatReplica.describe(): the front's /stats row


@dataclass(frozen=True)
class Report:
    """A replica's counters, sent just before each Finished: the front's /stats rows."""

    replica: str
    state: dict[str, Any]


ReplicaItem = Accepted | Report | list[Any] | Finished | Waiting


def served_name(model: Any) -> str:
    """The name /v1/models gives the model, as `chatcli serve` names it."""
    info = getattr(model, "info", None)
    if info is None:
        return "chatcli"
    return "chatcli-default" if info.embedded else info.tag or "chatcli"


class ChatReplica:
    """The deployment's class: one model, one Worker of spec.batch rows, that many requests
    at a time (the deployment's max_ongoing_requests matches the Worker's rows)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from chatcli.engine.cpu_plan import apply_cpu_plan

        model, tokenizer = spec.load()
        # On a CPU replica Ray sets OMP_NUM_THREADS to the CPUs it reserved for this actor,
        # and the plan takes at most that many (cpu_plan.available_cores).
        plan = apply_cpu_plan(model)
        self.name = ray.get_runtime_context().get_actor_name() or "replica"
        self.worker = Worker(
            model, tokenizer, name=self.name, cache_slots=spec.cache_slots, batch=spec.batch
        )
        self.worker.engine.speculate = spec.speculate
        self.pool = WorkerPool([self.worker])
        self.threads = plan.threads if plan else None
        self.node = ray.get_runtime_context().get_node_id()
        self._card = ModelCard(
            name=served_name(model),
            context_len=self.worker.context_len,
            tokenizer=tokenizer,
            first_turn_end=tokenizer.encode_special(USER_END),
            device=self.worker.device,
            threads=self.threads,
            rows=self.worker.rows,
        )

        # Serve's model multiplexing, with conversations for models: holding one is free.
        # Made per replica, as its size is the conversations the replica keeps warm: its
        # cache slots, or its batch's slots where that has more.
        async def hold(conversation: str) -> str:
            return conversation

        warm = len(self.worker.slots)
        self._hold = serve.multiplexed(max_num_models_per_replica=warm)(hold)

    def card(self) -> ModelCard:
        return self._card

    async def generate(self, prompt: list[int], params: GenerationParams) -> AsyncIterator[Any]:
        """Accepted, then the WorkerPool's batches of events, a Report and Finished.

        Serve cancels this generator when the caller cancels the request (its client went
        away, or the front is closing): leaving the WorkerPool's iterator then stops the
        generation after the model step it is in."""
        conversation = serve.get_multiplexed_model_id()
        if conversation:
            await self._hold(conversation)
        yield Accepted(self.name, self.describe())
        async for item in self.pool.generate(prompt, params):
            if isinstance(item, Finished):
                yield Report(self.name, self.describe())
            yield item
            if not isinstance(item, Finished):
                # Each item is a Ray object on its way to the front, with a cost of its own;
                # a pause lets the next one carry every token made meanwhile (the WorkerPool
                # batches them) rather than one. The first token is not held back.
                await asyncio.sleep(STREAM_EVERY_S)

    def describe(self) -> dict[str, Any]:
        return {**self.worker.describe(), "threads": self.threads, "node": self.node}
