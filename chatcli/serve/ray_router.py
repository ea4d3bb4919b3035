"""Ray Serve's request router for the chat deployment: a conversation goes home.

Owns ConversationRouter, the deployment's routing policy (Serve's documented extension
point, request_router_config). Each request carries its conversation's key as Serve's
multiplexed model id (backend.conversation_key). The router remembers which replica it last
sent each conversation to, its home, and sends the conversation's next turn there: that
replica's warm cache holds the turns before, so only the new one is prefilled. A home that
stays busy for HOME_WAIT_S loses the request to the least loaded of two other replicas (a
cold prefill costs less than a long wait); a home that died is forgotten. A conversation
this router has not seen goes where the replicas' multiplexing reports say it is held (so a
restarted front still finds it), else to the less loaded of two random replicas, Serve's
default power of two choices.

Remembering in the router, rather than waiting for the replicas' reports to reach it
through Serve's controller, is what lets a client send turn 2 the moment turn 1 ends.

Knows nothing of chat: only keys and replicas. It runs in the front's process, in the
router Serve builds for the deployment's handle.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

# How long a request waits for its busy home before another replica may take it.
HOME_WAIT_S = 1.0
# Conversations whose homes are remembered (the least recently served are forgotten).
HOMES_KEPT = 100_000


class ConversationRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    def initialize_state(
        self, home_wait_s: float = HOME_WAIT_S, homes_kept: int = HOMES_KEPT, **kwargs: Any
    ) -> None:
        self._home_wait_s = home_wait_s
        self._homes_kept = homes_kept
        self._homes: OrderedDict[str, ReplicaID] = OrderedDict()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas to try, best first: the home alone while it is worth waiting
        for, then the home and two others; without a home, two (see the module)."""
        key = pending_request.metadata.multiplexed_model_id if pending_request else ""
        home = self._homes.get(key) if key else None
        if home is not None and home in self._replicas:
            others = _two([r.replica_id for r in candidate_replicas if r.replica_id != home])
            waited = time.time() - pending_request.created_at
            if waited < self._home_wait_s or not others:
                pending_request.routing_context.should_backoff = True  # retry it, paced
                return [[self._replicas[home]]]
            return [[self._replicas[home]], [self._replicas[r] for r in others]]
        held = self.apply_multiplex_routing(pending_request) if key else self._replica_id_set
        return [[self._replicas[r] for r in _two(list(held)) if r in self._replicas]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        key = pending_request.metadata.multiplexed_model_id
        if key:
            self._homes[key] = replica_id
            self._homes.move_to_end(key)
            while len(self._homes) > self._homes_kept:
                self._homes.popitem(last=False)


def _two(ids: list[ReplicaID]) -> list[ReplicaID]:
    """Two of `ids` at random (all of them when fewer): the power of two choices."""
    return random.sample(ids, min(2, len(ids)))
