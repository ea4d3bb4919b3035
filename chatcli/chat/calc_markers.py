"""The inline calculator marker: how a calculator call travels inside plain chat text.

Owns: writing one call as `[calc EXPR = RESULT]` (or `[calc EXPR]` when the tool gave no
answer), and reading such markers back, either out of a whole message (into nanochat message
parts, so a conversation a client sends back replays the calls the model made) or out of a
stream of text chunks (into stream events, for servers that only send plain text).

OpenAI-format messages are strings, so this marker is what lets a generic client show a call
and a later request reproduce it token for token. Does not know HTTP, JSON, the tokenizer or the
engine. Known limit: an expression containing `[` or `]` cannot be written as a marker
(`[calc x [calc 1+1 = 2]` reads as the text `[calc x ` and one call).
"""

from __future__ import annotations

import re

from chatcli.chat.stream import StreamEvent, TextDelta, ToolCallDelta, ToolCallStart, ToolResult

MARKER_OPEN = "[calc "
# A marker that never closes is text after all: past this many characters, stop holding it back.
MAX_MARKER_CHARS = 2000
# Neither part may hold `[`: a match attempt then stops at the next `[`, so text full of
# unclosed `[calc ` openings is scanned once, not once per opening (which was quadratic: a
# client's message of 8000 characters took 0.2 s on the event loop).
_MARKER = re.compile(r"\[calc (?P<expression>[^\[\]]*?)(?: = (?P<output>[^\[\]=]*))?\]")

Part = dict[str, str]


def format_marker(expression: str, output: str | None) -> str:
    """`[calc 1234*56 = 69104]`, or `[calc 1/0]` for a call the tool did not answer."""
    if output is None:
        return f"{MARKER_OPEN}{expression}]"
    return f"{MARKER_OPEN}{expression} = {output}]"


def parts_from_text(text: str) -> list[Part]:
    """A message's text as nanochat parts: `text`, `python` and `python_output`.

    The inverse of `text_from_parts`: text around the markers is kept exactly (no spaces are
    added or removed), so a reply sent back by a client renders to the tokens it came from.
    """
    parts: list[Part] = []
    at = 0
    for m in _MARKER.finditer(text):
        if m.start() > at:
            parts.append({"type": "text", "text": text[at : m.start()]})
        parts.append({"type": "python", "text": m.group("expression")})
        if m.group("output") is not None:
            parts.append({"type": "python_output", "text": m.group("output")})
        at = m.end()
    if at < len(text) or not parts:
        parts.append({"type": "text", "text": text[at:]})
    return parts


def text_from_parts(parts: list[Part] | str) -> str:
    """nanochat parts as one string with inline markers (a plain string passes through)."""
    if isinstance(parts, str):
        return parts
    out: list[str] = []
    i = 0
    while i < len(parts):
        kind, text = parts[i]["type"], parts[i]["text"]
        if kind == "python":
            following = parts[i + 1] if i + 1 < len(parts) else None
            answered = following is not None and following["type"] == "python_output"
            out.append(format_marker(text, following["text"] if answered else None))
            i += 2 if answered else 1
            continue
        if kind == "text":
            out.append(text)
        # A python_output with no call before it has nothing to attach to: it is dropped.
        i += 1
    return "".join(out)


def events_of_marker(expression: str, output: str | None) -> list[StreamEvent]:
    """The events TokenDecoder would have emitted for this call."""
    return [ToolCallStart(), ToolCallDelta(expression), ToolResult(expression, output)]


class MarkerScanner:
    """Reads markers out of text that arrives in chunks, which may split a marker anywhere.

    Text that might still become a marker (a trailing `[`, `[ca`, `[calc 12*`) is held back
    until the next chunk says what it is; everything else is emitted at once.
    """

    def __init__(self) -> None:
        self._held = ""

    def feed(self, text: str) -> list[StreamEvent]:
        buffer = self._held + text
        events: list[StreamEvent] = []
        at = 0
        for m in _MARKER.finditer(buffer):
            if m.start() > at:
                events.append(TextDelta(buffer[at : m.start()]))
            events += events_of_marker(m.group("expression"), m.group("output"))
            at = m.end()
        rest = buffer[at:]
        cut = _pending_marker_start(rest)
        if cut > 0:
            events.append(TextDelta(rest[:cut]))
        self._held = rest[cut:]
        return events

    def flush(self) -> list[StreamEvent]:
        """The stream is over: whatever was held back was text."""
        held, self._held = self._held, ""
        return [TextDelta(held)] if held else []


def _pending_marker_start(text: str) -> int:
    """Where an unfinished marker may start in `text` (its length if nowhere)."""
    start = text.rfind("[")
    if start < 0:
        return len(text)
    tail = text[start:]
    could_open = MARKER_OPEN.startswith(tail) or tail.startswith(MARKER_OPEN)
    # A `]` in the tail means the regex already saw the whole thing and it is not a marker.
    if could_open and "]" not in tail and len(tail) <= MAX_MARKER_CHARS:
        return start
    return len(text)
