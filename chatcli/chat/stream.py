"""From the engine's token stream to typed display events.

Owns: decoding generated tokens into text without ever splitting a UTF-8 character, and
reading the calculator tool protocol out of the stream. The model writes
`<|python_start|> expr <|python_end|>`; when the tool succeeds the engine forces
`<|output_start|> result <|output_end|>` (mask 0) right after it, and when it fails the model's
own next token (mask 1) follows instead. Also turns a finished reply into nanochat message parts.

Does not know: torch, the model or the engine (only that it asks chatcli.engine.calculator, which
this module asks too, to tell a refused call from one the stream cut), how events are drawn
(render.py), or anything of the tokenizer beyond the two methods of `TokenText`.
"""

from __future__ import annotations

import codecs
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from chatcli.engine.calculator import use_calculator
from chatcli.model.special_tokens import (
    ASSISTANT_END,
    BOS,
    OUTPUT_END,
    OUTPUT_START,
    PYTHON_END,
    PYTHON_START,
    SPECIAL_TOKENS,
)


@dataclass(frozen=True)
class TextDelta:
    """Text the model wrote, to show as it comes."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """The model opened a calculator call (`<|python_start|>`)."""


@dataclass(frozen=True)
class ToolCallDelta:
    """More of the calculator expression, as the model writes it."""

    text: str


@dataclass(frozen=True)
class ToolResult:
    """A finished calculator call. `output` is None when the tool failed or refused, or the
    call never closed. `cut` says the stream ended (length limit, context) before the call
    did, inside its expression or its result: not a failure, /continue finishes it. `off`
    says the calculator was switched off (`/tools off`), so nothing was asked of it."""

    expression: str
    output: str | None
    cut: bool = False
    off: bool = False

    @property
    def status(self) -> str:
        """How the call ended: ok (answered), failed (refused, or ended by the model), cut,
        or off (the tools were off: not run)."""
        if self.cut:
            return "cut"
        if self.off and self.output is None:
            return "off"
        return "failed" if self.output is None else "ok"


@dataclass(frozen=True)
class SpecialToken:
    """A special token by name; only emitted in raw mode."""

    name: str


StreamEvent = TextDelta | ToolCallStart | ToolCallDelta | ToolResult | SpecialToken


class TokenText(Protocol):
    """What the decoder needs of a tokenizer."""

    def decode_bytes(self, ids: list[int]) -> bytes: ...

    def encode_special(self, name: str) -> int: ...


class _Where(enum.Enum):
    TEXT = "text"  # ordinary reply text
    PYTHON = "python"  # inside python_start ... python_end: the expression
    AFTER_PYTHON = "after_python"  # python_end seen; the next token says if the tool answered
    OUTPUT = "output"  # inside output_start ... output_end: the forced tool result
    ENDED = "ended"  # assistant_end or bos seen: the reply is over


class TokenDecoder:
    """Feeds on (token, mask) pairs and returns the events each one completes.

    One incremental UTF-8 decoder runs over the bytes of every token, so a character split
    across tokens comes out whole once its last byte arrives. A special token cannot be part of
    a character, so it cuts off any partial one (shown as U+FFFD: those bytes were never going
    to form valid text).
    """

    def __init__(self, tokenizer: TokenText, raw: bool = False, tools: bool = True) -> None:
        """tools: whether the engine runs the calculator in this stream; with it off, a call
        the model closes is reported as not run (`off`), not as failed."""
        self.raw = raw
        self._tools = tools
        self._tokenizer = tokenizer
        self._names = {tokenizer.encode_special(name): name for name in SPECIAL_TOKENS}
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._where = _Where.TEXT
        self._expression = ""
        self._output = ""

    def feed(self, token: int, mask: int) -> list[StreamEvent]:
        if self._where is _Where.ENDED and not self.raw:
            return []
        name = self._names.get(token)
        events: list[StreamEvent] = []
        if self._where is _Where.AFTER_PYTHON and not (name == OUTPUT_START and mask == 0):
            # Anything but a forced output_start means the tool gave no answer.
            events.append(ToolResult(self._expression, None, off=not self._tools))
            self._where = _Where.TEXT
        if name is None:
            text = self._utf8.decode(self._tokenizer.decode_bytes([token]))
            return events + self._route(text)
        events += self._route(self._utf8.decode(b"", final=True))
        self._utf8.reset()
        if self.raw:
            return [*events, SpecialToken(name)]
        return events + self._on_special(name)

    def resume(self, tokens: Iterable[int], masks: Iterable[int]) -> None:
        """Read tokens already shown (the reply a /continue extends) without emitting them,
        so that what follows decodes in their context: inside a calculator call, with its
        expression so far, or in the middle of a character."""
        for token, mask in zip(tokens, masks, strict=True):
            self.feed(token, mask)

    def flush(self) -> list[StreamEvent]:
        """The stream is over: emit what was held back and close an open tool call. A call
        stopped inside its expression or its result is cut. One stopped right after
        <|python_end|> failed where the calculator refuses its expression: the engine writes
        a result right after that token, even past max_tokens, so none coming means none
        was given, unless the stream ended first (the context's last position, Ctrl-C), and
        then a call the calculator answers was cut. The decoder is then ready for a new
        stream."""
        events = self._route(self._utf8.decode(b"", final=True))
        self._utf8.reset()
        if self._where in (_Where.PYTHON, _Where.OUTPUT):
            events.append(ToolResult(self._expression, None, cut=True))
        elif self._where is _Where.AFTER_PYTHON:
            due = self._tools and use_calculator(self._expression) is not None
            events.append(ToolResult(self._expression, None, cut=due, off=not self._tools))
        self._where = _Where.TEXT
        return events

    def _route(self, text: str) -> list[StreamEvent]:
        """Sends decoded text to wherever the stream currently is."""
        if not text:
            return []
        if self.raw or self._where is _Where.TEXT:
            return [TextDelta(text)]
        if self._where is _Where.PYTHON:
            self._expression += text
            return [ToolCallDelta(text)]
        if self._where is _Where.OUTPUT:
            self._output += text
        return []

    def _on_special(self, name: str) -> list[StreamEvent]:
        where = self._where
        if name == PYTHON_START and where is _Where.TEXT:
            self._where, self._expression = _Where.PYTHON, ""
            return [ToolCallStart()]
        if name == PYTHON_END and where is _Where.PYTHON:
            self._where = _Where.AFTER_PYTHON
            return []
        if name == OUTPUT_START and where is _Where.AFTER_PYTHON:
            # feed() already turned an output_start the model wrote itself (mask 1) into a failure.
            self._where, self._output = _Where.OUTPUT, ""
            return []
        if name == OUTPUT_END and where is _Where.OUTPUT:
            self._where = _Where.TEXT
            return [ToolResult(self._expression, self._output)]
        if name in (ASSISTANT_END, BOS):
            self._where = _Where.ENDED
            if where in (_Where.PYTHON, _Where.OUTPUT):
                return [ToolResult(self._expression, None)]
        # Any other special token out of place is invisible outside raw mode.
        return []


def decode_assistant_parts(
    tokens: Iterable[int], masks: Iterable[int], tokenizer: TokenText
) -> list[dict[str, str]]:
    """A whole reply as nanochat message parts: `text`, `python` (the expression) and
    `python_output` (only for a call the tool answered). Adjacent text is merged; the closing
    assistant_end, like anything after it, leaves no trace."""
    decoder = TokenDecoder(tokenizer)
    events: list[StreamEvent] = []
    for token, mask in zip(tokens, masks, strict=True):
        events += decoder.feed(token, mask)
    events += decoder.flush()

    return parts_from_events(events)


def parts_from_events(events: Iterable[StreamEvent]) -> list[dict[str, str]]:
    """Stream events as nanochat message parts: merged text, calculator calls and outputs."""
    parts: list[dict[str, str]] = []
    for event in events:
        if isinstance(event, TextDelta):
            if parts and parts[-1]["type"] == "text":
                parts[-1]["text"] += event.text
            else:
                parts.append({"type": "text", "text": event.text})
        elif isinstance(event, ToolResult):
            parts.append({"type": "python", "text": event.expression})
            if event.output is not None:
                parts.append({"type": "python_output", "text": event.output})
    return parts
