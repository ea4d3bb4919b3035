"""What the HTTP app needs from whatever runs the model: the Backend protocol.

Owns: the small interface between chatcli.serve.app and the two things that run generations
behind it, the WorkerPool (replicas in this process, worker_pool.py) and the Ray Serve
deployment (replicas across a cluster, ray_backend.py); and the conversation key a back end
may route by, so a conversation's turns find the replica whose cache holds its earlier ones.

Knows nothing of HTTP, of Ray or of threads: the app validates a request, turns it into
prompt tokens and GenerationParams, and reads back batches of chatcli.chat.stream events,
then one Finished (worker_pool's types, shared by both back ends).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from chatcli.chat.stream import StreamEvent
from chatcli.serve.replies import Finished, GenerationParams
from chatcli.serve.worker_pool import Waiting

# What a generation yields: batches of events, Waiting while it is queued (when asked), and
# one Finished last.
Item = list[StreamEvent] | Finished | Waiting


class Backend(Protocol):
    """Runs generations for the app. WorkerPool and RayBackend implement it.

    generate() raises worker_pool.ShuttingDown once close() was called (for a request still
    queued, or one it stopped); any other exception is the generation's failure, which the
    app reports in-band (a stream) or as a 500. Leaving the iterator early (the client went
    away) stops the generation wherever it runs.
    """

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer: the app renders prompts with it."""

    @property
    def context_len(self) -> int:
        """The model's context, in tokens."""

    closed: bool  # close() was called: refuse new requests with a 503
    waiting: int  # requests queued for a replica right now (the 429 message names it)

    def queue_full(self, max_queue: int) -> bool:
        """Whether a new request would find every replica busy and `max_queue` waiting."""

    def generate(
        self, prompt: list[int], params: GenerationParams, waiting_every: float | None = None
    ) -> AsyncIterator[Item]:
        """Batches of events for `prompt`, then one Finished; with `waiting_every`, a
        Waiting every that many seconds the request is queued."""

    def describe(self) -> dict[str, Any]:
        """/stats's body, cheap enough for /health: at least "workers" (a list, one entry a
        replica), "busy", "idle" and "queue_length"."""

    def close(self) -> None:
        """Stop every running generation and refuse the queued and later ones (on the event
        loop, as the server shuts down)."""


def conversation_key(prompt: Sequence[int], first_turn_end: int) -> str:
    """A name for the conversation `prompt` belongs to: a hash of its tokens up to the end of
    the first user message (the system message, which nanochat folds into it, included).
    Every later turn of a conversation resends those tokens unchanged, so all its requests
    share the key. `first_turn_end`: the <|user_end|> token's id."""
    try:
        end = list(prompt).index(first_turn_end) + 1
    except ValueError:  # no user turn: the whole prompt names it
        end = len(prompt)
    head = b"".join(t.to_bytes(4, "little") for t in prompt[:end])
    return hashlib.blake2b(head, digest_size=8).hexdigest()
