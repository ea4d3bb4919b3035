"""A generation's way back to whoever waits for it: its parameters, its events, its end.

Owns: GenerationParams (what a request asks a worker for), Finished (the last item of every
generation), ReplyText (a reply's tokens as stream events, cut at a stop sequence), and the
hand-over of events from a generation's thread to its consumer's event loop (ToLoop,
emit_all). Shared by a worker's one-at-a-time path (worker_pool.py) and its batch
(batch_worker.py). Knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from chatcli.chat.stop_text import StopText
from chatcli.chat.stream import StreamEvent, TokenDecoder
from chatcli.engine.logprobs import TokenLogprob


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    temperature: float
    top_k: int | None  # None: off
    top_p: float | None  # None: off
    seed: int
    stop: tuple[str, ...] = ()  # the reply ends before the first of these in its text
    # Each token's log-probability and this many alternatives (0 to 20); None: not asked.
    logprobs: int | None = None
    grammar: str | None = None  # the grammar its tokens follow (response_format); None: free


@dataclass(frozen=True)
class Finished:
    """The last item of every generation."""

    finish_reason: str  # stop | length | context (the engine's), or interrupted
    prompt_tokens: int
    completion_tokens: int  # every token generated, calculator-forced ones and the stop included
    cached_tokens: int = 0  # of the prompt's, those the worker's warm cache already held
    # The decode steps after the first token (GenerationStats.decode_s): a client cannot time
    # them where the reply starts with a calculator call, which reaches it only once over.
    decode_s: float = 0.0
    drafts_accepted: int = 0  # drafts from the conversation the reply took (speculation.py)


# A reply's events: the text's, and each token's TokenLogprob where the request asked (after
# the token's text events; not passed through the stop text, whose held text it would free).
ReplyEvent = StreamEvent | TokenLogprob
Emit = Callable[[list[ReplyEvent]], None]


class ReplyText:
    """One reply's tokens as stream events: decoded, cut at the first stop sequence, emitted
    as they form. Every worker's generation, one row or a batch's, reads its tokens so."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], emit: Emit) -> None:
        self.decoder = TokenDecoder(tokenizer)
        self.stop_text = StopText(tuple(stop))
        self.emit = emit
        self.generated = 0  # tokens fed: every token generated, forced ones and the stop too

    @property
    def stopped(self) -> bool:
        """Whether a stop sequence ended the reply."""
        return self.stop_text.stopped

    def feed(self, token: int, mask: int, logprob: TokenLogprob | None = None) -> bool:
        """One token of the reply (and its log-probability, where asked); True once a stop
        sequence ended it."""
        self.generated += 1
        events: list[ReplyEvent] = [*self.stop_text.feed(self.decoder.feed(token, mask))]
        if logprob is not None:
            events.append(logprob)
        if events:
            self.emit(events)
        return self.stop_text.stopped

    def flush(self) -> bool:
        """The reply is over: emit the text held back; True if a stop sequence was in it."""
        tail = self.stop_text.feed(self.decoder.flush())
        tail += self.stop_text.flush()
        if tail:
            self.emit(tail)
        return self.stop_text.stopped


class ToLoop:
    """An Emit that hands a generation's events, from its thread, to the asyncio queue its
    consumer reads on the event loop. Several at once (a batch's rows, one a request) go
    over in one call (emit_all)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, items: asyncio.Queue, stop: threading.Event
    ) -> None:
        self.loop, self.items, self.stop = loop, items, stop

    def __call__(self, events: list[ReplyEvent]) -> None:
        emit_all([(self, events)])


def emit_all(pending: Sequence[tuple[Emit, list[ReplyEvent]]]) -> None:
    """Hand each Emit its events: those of one event loop (ToLoop) in one call_soon_threadsafe,
    any other Emit called as it is. Each such call wakes the loop's thread, which then takes
    the GIL from the generation's thread: a batch's eight rows, handed over one by one,
    spent a fifth of the step's thread's time waiting to get it back."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[ToLoop, list[ReplyEvent]]]] = {}
    for emit, events in pending:
        if isinstance(emit, ToLoop):
            by_loop.setdefault(emit.loop, []).append((emit, events))
        else:
            emit(events)
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, group)
        except RuntimeError:  # the loop closed under us (server shutdown): nobody listens
            for emit, _ in group:
                emit.stop.set()


def _put_all(group: list[tuple[ToLoop, list[ReplyEvent]]]) -> None:
    for emit, events in group:
        emit.items.put_nowait(events)
