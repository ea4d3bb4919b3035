"""Stop sequences: a reply's text cut where one of some strings first appears.

Owns: watching the text events of a stream for the stop strings an API request names
(OpenAI's `stop`), holding back the end of the text while it may be the start of one, and
cutting the text before the first found. The stop string itself is never passed on.

Only the model's text is watched: a calculator call's expression and result are not text
the reply says, so a stop string cannot begin in one, nor run across one.

Knows nothing of tokens, the engine or HTTP: it takes and gives chatcli.chat.stream events.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatcli.chat.stream import StreamEvent, TextDelta


class StopText:
    """Feed it a stream's events as they come; it passes on what may be shown and says when
    a stop string has appeared (then nothing more is passed on)."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
        self.stops = tuple(stops)
        self.stopped = False
        self._held = ""  # the text's end that may begin a stop string: not passed on yet

    def feed(self, events: Sequence[StreamEvent]) -> list[StreamEvent]:
        """The events that may be shown now. Once a stop string appears, the text before it
        is the last thing passed on and `stopped` is set."""
        out: list[StreamEvent] = []
        for event in events:
            if self.stopped:
                break
            if not isinstance(event, TextDelta):
                # Not text (a calculator call): what was held cannot grow into a stop string.
                out += self._release()
                out.append(event)
                continue
            text = self._held + event.text
            found = self._first_stop(text)
            if found is not None:
                self._held, self.stopped = "", True
                if found:
                    out.append(TextDelta(text[:found]))
                break
            keep = self._may_begin_stop(text)
            self._held = text[len(text) - keep :] if keep else ""
            if len(text) > keep:
                out.append(TextDelta(text[: len(text) - keep]))
        return out

    def flush(self) -> list[StreamEvent]:
        """The stream is over without a stop string: what was held back."""
        return [] if self.stopped else self._release()

    def _release(self) -> list[StreamEvent]:
        held, self._held = self._held, ""
        return [TextDelta(held)] if held else []

    def _first_stop(self, text: str) -> int | None:
        """Where the stop string in `text` that ends first starts, or None: the one a
        stream fed a character at a time meets first, however the text came in pieces."""
        found = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in self.stops) if i >= 0]
        return min(found)[1] if found else None

    def _may_begin_stop(self, text: str) -> int:
        """The length of the longest end of `text` that a stop string begins with."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[-n:]):
                    longest = n
                    break
        return longest
