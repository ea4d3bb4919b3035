"""A chat session whose model runs behind an OpenAI-compatible server (`chatcli serve`, vLLM,
ollama, ...): the same interface as ChatSession, so the REPL and `chatcli once` need not care.

Owns: the conversation (kept in chatcli's message format, assistant replies as nanochat parts),
the chat completions request (its server-sent events read back into chatcli.chat.stream events
by completion_events.py), and turn statistics from the server's usage numbers and our own
clock.
Closing the event iterator closes the HTTP stream, which makes the server stop generating.

Knows nothing of torch, tokens or the terminal. The server holds no state between requests:
every turn sends the whole conversation.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

from chatcli.chat.calc_markers import text_from_parts
from chatcli.chat.stream import StreamEvent, TextDelta, ToolResult
from chatcli.chat.turns import (
    CONTEXT_WARN_FRACTION,
    Message,
    Reply,
    SamplingOptions,
    TurnNotice,
    TurnStats,
    split_system,
)
from chatcli.errors import ChatcliError
from chatcli.serve.completion_events import StreamedReply, sse_payloads
from chatcli.serve.keys import check_key

# Waiting for a busy server's queue can take a while; a dead connection is found much sooner.
TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=10.0)


def _base_url(url: str) -> str:
    """The server's root: accepts http://host:8000, http://host:8000/ and http://host:8000/v1."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url.removesuffix("/v1")


@dataclass
class RemoteSession:
    # A server sends one reply per request: /samples, which needs one shared prefill, is
    # refused as soon as it is typed; and text, not the tokens `raw` would show.
    can_sample_replies: ClassVar[bool] = False
    can_show_raw: ClassVar[bool] = False
    can_show_probs: ClassVar[bool] = False  # /probs: a server's replies carry none here

    url: str
    api_key: str | None = None
    model: str | None = None  # None: the first model the server lists
    options: SamplingOptions = field(default_factory=SamplingOptions)
    system: str | None = None
    # The model's context in tokens where the caller knows it; None: the server is asked.
    known_context: int | None = None
    # How requests travel (None: the network; tests pass an httpx.MockTransport).
    transport: httpx.BaseTransport | None = field(default=None, repr=False)
    # Ask for each token's logprob and this many alternatives (`once --logprobs`); None: not.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self.url = _base_url(self.url)
        if self.api_key is not None:  # as a server reads it: whole, trimmed, sendable
            self.api_key = check_key(self.api_key, "--api-key (or CHATCLI_API_KEY)")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._client = httpx.Client(
            base_url=self.url, headers=headers, timeout=TIMEOUT, transport=self.transport
        )
        self._entries: list[Message] = []
        self._finishes: list[str | None] = []  # each entry's finish_reason, where known
        # Exchanges dropped from what is sent, oldest first, as the server's context ran out:
        # still the conversation's, for /save and /export (as a local session keeps them).
        self._earlier: list[Message] = []
        self._earlier_finishes: list[str | None] = []
        self._popped: tuple[Message, str | None] | None = None  # the reply a /retry replaces
        self._context_used: int | None = None  # by the conversation's last turn
        self._context_len: int | None = self.known_context
        self.last_reply: Reply | None = None
        # The last reply's logprobs as the server sent them (OpenAI's content entries).
        self.last_logprobs: list[dict[str, Any]] | None = None
        self.notices: list[TurnNotice] = []
        self.history_stats: list[TurnStats] = []
        self._told_tools = False

    # ---- the server ---------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Ask the server what it serves (and whether it is there at all): for the banner."""
        models = self._models()
        if self.model is None:
            if not models:
                raise ChatcliError(f"{self.url} lists no models. Name one with --model NAME.")
            self.model = str(models[0].get("id"))
        return {
            "path": f"{self.url} · {self.model}",
            "device": "remote",
            "context_len": self.context_len or None,
        }

    def _models(self) -> list[dict[str, Any]]:
        response = self._request("GET", "/v1/models")
        self._raise_for_status(response)
        try:
            data = response.json().get("data") or []
        except (json.JSONDecodeError, AttributeError):
            data = []
        models = [m for m in data if isinstance(m, dict) and "id" in m]
        mine = next((m for m in models if m["id"] == self.model), models[0] if models else {})
        # chatcli says context_length, vLLM max_model_len; other servers may say nothing.
        length = mine.get("context_length") or mine.get("max_model_len") or 0
        self._context_len = int(length) if isinstance(length, int | float) else 0
        return models

    @property
    def context_len(self) -> int:
        """The model's context in tokens, or 0 when the server does not say."""
        if self._context_len is None:
            try:
                self._models()
            except ChatcliError:
                self._context_len = 0
        return self._context_len or 0

    def close(self) -> None:
        self._client.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._client.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e

    def _unreachable(self, e: Exception) -> ChatcliError:
        return ChatcliError(
            f"Cannot reach {self.url}: is `chatcli serve` running? ({type(e).__name__}: {e})"
        )

    def _raise_for_status(self, response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        response.read()
        code = response.status_code
        message = _error_message(response)
        if message is None:  # no error body of an API's (an HTML page): the status says it
            said = f"{code} {response.reason_phrase}".strip()
            refused = f"The server refused the request: {said}."
        else:
            said = message
            refused = f"The server refused the request ({code}): {message}"
        if code in (401, 403):
            said = said.rstrip(".")
            fix = "Check" if self.api_key else "Pass the server's key with"
            raise ChatcliError(
                f"{self.url} refused the request ({code}): {said}. {fix} --api-key KEY "
                "or CHATCLI_API_KEY."
            )
        if code == 400 and is_context_full(response):
            raise _ContextFull(refused)
        if code == 404:
            raise ChatcliError(
                f"{self.url} has no OpenAI-compatible API at {response.request.url.path} "
                f"({said}). Point --url at the server's root."
            )
        raise ChatcliError(refused)

    # ---- the conversation ---------------------------------------------------------------------

    @property
    def messages(self) -> list[Message]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + list(self._entries)

    @property
    def transcript(self) -> tuple[list[Message], list[str | None]]:
        """The conversation and each message's finish_reason where known (/save keeps them,
        so /continue on a local model knows a finished reply)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        messages = head + self._earlier + self._entries
        return messages, [None] * len(head) + self._earlier_finishes + self._finishes

    def load_messages(
        self, messages: list[Message], finishes: Sequence[str | None] | None = None
    ) -> None:
        self.system, rest = split_system(messages)
        kept = zip(messages, finishes or [None] * len(messages), strict=True)
        self._finishes = [f for m, f in kept if m["role"] != "system"]
        self._entries = [dict(m) for m in rest]
        self._earlier, self._earlier_finishes = [], []
        self._context_used = None

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    def clear(self) -> None:
        self._entries, self._finishes = [], []
        self._earlier, self._earlier_finishes = [], []
        self.last_reply = None
        self._context_used = None

    def undo(self) -> bool:
        """Drop the last exchange (the last user message and whatever followed it)."""
        for i in range(len(self._entries) - 1, -1, -1):
            if self._entries[i]["role"] == "user":
                del self._entries[i:]
                del self._finishes[i:]
                self._context_used = None
                return True
        return False

    def pop_last_reply(self) -> Message | None:
        """Take the last reply out (for /retry); until a new one comes, it is kept to put
        back should the server not answer."""
        if self._entries and self._entries[-1]["role"] == "assistant":
            self._popped = self._entries.pop(), self._finishes.pop()
            return self._popped[0]
        return None

    def take_notices(self) -> list[TurnNotice]:
        notices, self.notices = self.notices, []
        return notices

    # ---- running a turn -----------------------------------------------------------------------

    def send(self, text: str) -> Iterator[StreamEvent]:
        """Add a user message and stream the reply; nothing is sent until iteration starts."""
        self._notice_before_turn()
        self._entries.append({"role": "user", "content": text})
        self._finishes.append(None)
        self._popped = None
        return self._stream(added_user=True)

    def _notice_before_turn(self) -> None:
        if not self.options.tools and not self._told_tools:
            self._told_tools = True
            self.notices.append(
                TurnNotice("The server runs the calculator itself: tools off has no effect here.")
            )

    def regenerate(self) -> Iterator[StreamEvent]:
        if not self._entries or self._entries[-1]["role"] != "user":
            raise ChatcliError("There is no user message to reply to.")
        return self._stream(added_user=False)

    def continue_reply(self) -> Iterator[StreamEvent]:
        raise ChatcliError("/continue is not supported against a server; use /retry.")

    def sample_replies(self, text: str, n: int) -> list[Reply]:
        raise ChatcliError("Sampling several replies is not supported against a server.")

    def accept_reply(self, reply: Reply) -> None:
        raise ChatcliError("Sampling several replies is not supported against a server.")

    def _body(self, seed: int) -> dict[str, Any]:
        opts = self.options
        wire = [
            {"role": m["role"], "content": text_from_parts(m["content"])} for m in self.messages
        ]
        body: dict[str, Any] = {
            "messages": wire,
            "stream": True,
            "stream_options": {"include_usage": True},  # vLLM and OpenAI send usage only then
            "temperature": opts.temperature,
            "max_tokens": opts.max_tokens,
            "seed": seed,
            # Not OpenAI's, but chatcli, vLLM and llama.cpp read it and ollama ignores it. Sent
            # even when off (0): chatcli's server would otherwise apply its default of 50.
            "top_k": opts.top_k or 0,
        }
        if self.model is not None:
            body["model"] = self.model
        if opts.top_p is not None and opts.top_p < 1:
            body["top_p"] = opts.top_p
        if self.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = self.logprobs
        if opts.json_schema is not None:
            spec = {"name": "reply", "schema": opts.json_schema, "strict": True}
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        return body

    def _stream(self, added_user: bool) -> Iterator[StreamEvent]:
        seed = self.options.turn_seed()
        turn = StreamedReply()
        answered = False  # the server took the request: from here on a reply is recorded
        earlier = len(self._earlier)  # exchanges dropped before this turn
        interrupted = False
        stats: TurnStats | None = None
        t0 = time.perf_counter()
        try:
            if self.model is None:
                self.describe()  # servers like vLLM insist on the right model name
            stats = TurnStats(context_len=self.context_len, seed=seed)
            dropped = 0
            while True:
                try:
                    with self._client.stream(
                        "POST", "/v1/chat/completions", json=self._body(seed)
                    ) as response:
                        self._raise_for_status(response)
                        answered = True
                        if dropped:
                            self._notice_dropped(dropped)
                        for payload in sse_payloads(response.iter_lines()):
                            for event in turn.read(payload):
                                if turn.first_at is None and isinstance(
                                    event, TextDelta | ToolResult
                                ):
                                    turn.first_at = time.perf_counter()
                                    stats.ttft_s = turn.first_at - t0
                                yield event
                    break
                except _ContextFull:
                    # The server keeps nothing between turns, so the conversation it is
                    # sent must fit: drop the oldest exchange and ask again, as a local
                    # session does. What cannot fit even alone is the server's to refuse.
                    if not self._drop_oldest():
                        raise
                    dropped += 1
            yield from turn.end()
            if turn.finish is None:
                raise ChatcliError(f"{self.url} ended the stream before the reply was finished.")
        except httpx.TransportError as e:
            turn.finish = "error"
            if not answered:
                raise self._unreachable(e) from e
            raise ChatcliError(f"Lost the connection to {self.url}: {e}") from e
        except ChatcliError:
            turn.finish = turn.finish or "error"
            raise
        except BaseException:
            # GeneratorExit (the caller closed the iterator: Ctrl-C) or KeyboardInterrupt.
            turn.finish = turn.finish or "interrupted"
            interrupted = True
            raise
        finally:
            if not answered:
                # Exchanges dropped for a request the server never took come back: the
                # conversation stays as it was (a local session puts them back too).
                self._put_back(earlier)
            if answered or interrupted:
                # Ctrl-C before the server answered closes the turn empty, as a local
                # model's does: the question stays, for /retry.
                self._close_turn(turn, stats or TurnStats(seed=seed), t0)
            else:
                if added_user and self._entries and self._entries[-1]["role"] == "user":
                    self._entries.pop()  # the server never took the question: take it back
                    self._finishes.pop()
                if self._popped is not None:  # a /retry the server refused: the reply stays
                    self._entries.append(self._popped[0])
                    self._finishes.append(self._popped[1])
            self._popped = None

    def _drop_oldest(self) -> bool:
        """Move the oldest exchange (never the system prompt, nor the turn being asked)
        into `_earlier`; False when there is none to drop."""
        ask = max((i for i, m in enumerate(self._entries) if m["role"] == "user"), default=0)
        if ask == 0:
            return False
        end = next((i for i in range(1, ask + 1) if self._entries[i]["role"] == "user"), ask)
        self._earlier += self._entries[:end]
        self._earlier_finishes += self._finishes[:end]
        del self._entries[:end], self._finishes[:end]
        return True

    def _put_back(self, earlier: int) -> None:
        """Undo _drop_oldest back to `earlier` dropped exchanges."""
        self._entries[:0] = self._earlier[earlier:]
        self._finishes[:0] = self._earlier_finishes[earlier:]
        del self._earlier[earlier:], self._earlier_finishes[earlier:]

    def _notice_dropped(self, dropped: int) -> None:
        self._context_used = None
        self.notices.append(
            TurnNotice(
                f"Context full: dropped the {dropped} oldest exchange"
                f"{'s' if dropped > 1 else ''}"
                f"{' (the system prompt is kept)' if self.system else ''}."
            )
        )

    def _close_turn(self, turn: StreamedReply, stats: TurnStats, t0: float) -> None:
        now = time.perf_counter()
        usage = turn.usage or {}
        stats.tokens_in = int(usage.get("prompt_tokens") or 0)
        stats.tokens_out = int(usage.get("completion_tokens") or turn.deltas)
        # The prompt's tokens the server computed: those its cache held were not prefilled.
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        cached = cached if isinstance(cached, int) and not isinstance(cached, bool) else 0
        stats.prefill_tokens = max(stats.tokens_in - cached, 0)
        decode_s = usage.get("chatcli_decode_s")
        if isinstance(decode_s, int | float) and not isinstance(decode_s, bool):
            # chatcli's server timed its decode: the first token came that long before the
            # end, whatever reached us first (a reply that opens with a calculator call
            # shows nothing until the call is over).
            stats.ttft_s = max(now - t0 - decode_s, 0.0)
            if stats.tokens_out > 1 and decode_s > 0:
                stats.decode_tps = (stats.tokens_out - 1) / decode_s
        elif turn.first_at is not None and stats.tokens_out > 1 and now > turn.first_at:
            stats.decode_tps = (stats.tokens_out - 1) / (now - turn.first_at)
        if stats.ttft_s > 0 and stats.prefill_tokens:
            # The wait for the first token bounds the prefill's time: a lower bound on its speed.
            stats.prefill_tps = stats.prefill_tokens / stats.ttft_s
        stats.context_used = stats.tokens_in + stats.tokens_out
        stats.finish_reason = turn.finish or "error"
        reply = Reply(turn.parts(), [], [], stats)
        self.last_reply = reply
        self.last_logprobs = turn.logprobs if self.logprobs is not None else None
        self.history_stats.append(stats)
        self._entries.append(reply.message)
        self._finishes.append(stats.finish_reason)
        self._context_used = stats.context_used
        limit = self._context_len or 0
        if limit and stats.context_used > CONTEXT_WARN_FRACTION * limit:
            # Said after the reply, as a local session does. The server keeps nothing
            # between turns: past its context, the oldest exchanges stop being sent.
            self.notices.append(
                TurnNotice(
                    f"Context {stats.context_used}/{limit} tokens: the next turns leave the "
                    "oldest exchanges out of what the server sees (/clear starts afresh)."
                )
            )

    def put_reply(self, message: Message, finish: str | None = None) -> None:
        """Make `message` (the arena's other model's reply) the answer to the last question,
        in place of this session's own: the next request sends it."""
        self.pop_last_reply()
        self._popped = None
        if not self._entries or self._entries[-1]["role"] != "user":
            raise ChatcliError("There is no question waiting for a reply.")
        self._entries.append(dict(message))
        self._finishes.append(finish)
        self._context_used = None


class _ContextFull(ChatcliError):
    """The server's 400 for a conversation longer than its model's context."""


# How servers say a conversation does not fit: chatcli's code (OpenAI's too), llama.cpp's
# type, and the message vLLM and others write ("maximum context length is 4096 tokens").
_CONTEXT_FULL_CODES = {"context_length_exceeded", "exceed_context_size_error"}
_CONTEXT_FULL_MESSAGE = re.compile(r"maximum context length|exceeds? (the )?context", re.I)


def is_context_full(response: httpx.Response) -> bool:
    """Whether a 400 says the conversation is longer than the model's context."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return False
    if not isinstance(error, dict):
        return False
    if error.get("code") in _CONTEXT_FULL_CODES or error.get("type") in _CONTEXT_FULL_CODES:
        return True
    return bool(_CONTEXT_FULL_MESSAGE.search(str(error.get("message", ""))))


def _error_message(response: httpx.Response) -> str | None:
    """The message of an OpenAI-style error body (or ollama's and llama.cpp's `{"error":
    "..."}`, FastAPI's `{"detail": "..."}`), on one line; None for a body that has none (an
    HTML error page, from a server that is no API, is not a message to print)."""
    try:
        body = response.json()
    except ValueError:  # not JSON, or not even text
        return None
    if isinstance(body, dict):
        error = body.get("error", body.get("detail"))
        if isinstance(error, dict) and "message" in error:
            error = str(error["message"])
        if isinstance(error, str) and error.strip():
            return " ".join(error.split())
    return None
