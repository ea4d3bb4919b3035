"""A streamed chat completion read back into chatcli's stream events.

Owns: the data of each server-sent event, and one reply as it arrives (StreamedReply): its
text deltas, its calculator calls (from chatcli's `chatcli_tool` field, whose status tells a
call the length limit cut from a failed one, or, from other servers, from the inline
`[calc ...]` markers), its finish reason in chatcli's words and the server's usage numbers.
Knows nothing of HTTP beyond the lines it is given.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from chatcli.chat.calc_markers import MarkerScanner, events_of_marker
from chatcli.chat.stream import StreamEvent, ToolResult, parts_from_events
from chatcli.errors import ChatcliError

# OpenAI's finish reasons in chatcli's words ("content_filter" and the like pass through).
FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


def sse_payloads(lines: Iterator[str]) -> Iterator[str]:
    """The data of each server-sent event (multi-line data joined); comments are skipped."""
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


class StreamedReply:
    """One streamed reply as it arrives: events out, text and calls kept for the message."""

    def __init__(self) -> None:
        self.scanner = MarkerScanner()
        self.events: list[StreamEvent] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.first_at: float | None = None
        self.deltas = 0
        self.done = False
        # choices[0].logprobs.content's entries as the server sent them, where it sent any.
        self.logprobs: list[dict[str, Any]] = []

    def read(self, payload: str) -> list[StreamEvent]:
        if payload == "[DONE]":
            self.done = True
            return []
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError as e:
            raise ChatcliError(f"The server sent an event that is not JSON: {payload[:200]}") from e
        if not isinstance(chunk, dict):
            return []
        if chunk.get("error"):
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise ChatcliError(f"The server failed mid-reply: {message}")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[StreamEvent] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
                self.logprobs += [e for e in logprobs["content"] if isinstance(e, dict)]
            tool = delta.get("chatcli_tool")
            if isinstance(tool, dict):
                # chatcli's own server: the content is just the marker; the field says it all.
                events += self.scanner.flush()
                events += _events_of_tool(tool)
                self.deltas += 1
            elif delta.get("content"):
                events += self.scanner.feed(delta["content"])
                self.deltas += 1
            if choice.get("finish_reason"):
                reason = choice["finish_reason"]
                self.finish = FINISH_REASONS.get(reason, reason)
        self.events += events
        return events

    def end(self) -> list[StreamEvent]:
        events = self.scanner.flush()
        self.events += events
        return events

    def parts(self) -> list[dict[str, str]]:
        """The reply as nanochat parts, as ChatSession records its own replies."""
        return parts_from_events(self.events)


def _events_of_tool(tool: dict[str, Any]) -> list[StreamEvent]:
    """A `chatcli_tool` field as the events a local TokenDecoder would have emitted.

    Only the status tells a call the length limit or the context cut ("cut", as a local
    session says) from one the calculator refused: both have output null. A server from
    before the status field sends none, and then output null reads as failed, as it did.
    """
    expression = str(tool.get("expression", ""))
    output = tool.get("output")
    output = None if output is None else str(output)
    events = events_of_marker(expression, output)
    if tool.get("status") == "cut":
        events[-1] = ToolResult(expression, output, cut=True)
    return events
