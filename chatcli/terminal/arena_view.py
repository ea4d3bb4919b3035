"""The arena on the terminal: two replies streamed side by side, and the vote's keys.

Owns `DuelView` (two panels, A and B, repainted as their events come: side by side where two
panels fit, stacked where they do not; on a stream that is not a terminal, printed once
when both are done) and `ArenaUI`, the chat's `ChatUI` plus the duel and the vote's question
(a, b, t or x decide at one key on a terminal; a line from piped input).

Does not know: sessions, votes or what a turn does (arena_turns.py, arena_commands.py);
tokens or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from prompt_toolkit import PromptSession
from prompt_toolkit.history import InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from chatcli.chat.stream import StreamEvent, parts_from_events
from chatcli.chat.turns import readable_text
from chatcli.terminal.render import visible
from chatcli.terminal.render_panels import PANEL_GAP, panels_per_row, reply_text
from chatcli.terminal.repl import ChatUI

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

VOTE_KEYS = ("a", "b", "t", "x")  # one key each: A, B, tie, both bad
REFRESH_PER_S = 12
PANEL_FRAME = 4  # columns a panel takes around its text: two borders, one space each side
SCREEN_MARGIN = 3  # rows left free under streaming panels: the notices and prompt to come


class DuelView:
    """Two replies drawn as they stream, in panels titled by `titles` (A and B, with the
    model's name where the vote is open)."""

    def __init__(self, console: Console, titles: Sequence[str], tools: bool = True) -> None:
        self.console = console
        self.titles = list(titles)
        self.tools = tools
        self.events: list[list[StreamEvent]] = [[] for _ in titles]
        self.subtitles = [""] * len(titles)
        self._live: Live | None = None
        if console.is_terminal:
            # While streaming, each panel shows the end of its reply, as much as the screen
            # holds: a Live view taller than the screen cannot be repainted in place. Live
            # draws the whole of each once it stops.
            self._live = Live(
                self._panels(tail=True),
                console=console,
                refresh_per_second=REFRESH_PER_S,
                transient=False,
            )
            self._live.start()

    def handle(self, side: int, event: StreamEvent) -> None:
        self.events[side].append(event)
        if self._live is not None:
            self._live.update(self._panels(tail=True))

    def finish(self, subtitles: Sequence[str]) -> None:
        """Both replies are over: their last state, with a subtitle each (tokens, finish)."""
        self.subtitles = list(subtitles)
        if self._live is not None:
            self._live.update(self._panels(), refresh=True)
            self._live.stop()
            self._live = None
        else:
            self.console.print(self._panels())

    def _panels(self, tail: bool = False) -> RenderableType:
        side_by_side = panels_per_row(self.console.width, len(self.titles)) == len(self.titles)
        texts = [reply_text(parts_from_events(events), self.tools) for events in self.events]
        if tail:
            room = max(self.console.height - SCREEN_MARGIN, 3)
            rows = room - 2 if side_by_side else room // len(texts) - 2  # less the borders
            width = (self.console.width - PANEL_GAP) // 2 if side_by_side else self.console.width
            texts = [self._tail(text, width - PANEL_FRAME, rows) for text in texts]
        panels = [
            Panel(
                text,
                title=visible(title),
                subtitle=visible(subtitle) or None,
                title_align="left",
            )
            for title, text, subtitle in zip(self.titles, texts, self.subtitles, strict=True)
        ]
        if not side_by_side:
            return Group(*panels)  # a narrow terminal: one above the other
        grid = Table.grid(expand=True, padding=(0, PANEL_GAP))
        for _ in panels:
            grid.add_column(ratio=1)
        grid.add_row(*panels)
        return grid

    def _tail(self, text: Text, width: int, rows: int) -> Text:
        """The last `rows` lines of `text` wrapped at `width` columns."""
        lines = text.wrap(self.console, max(width, 1))
        if len(lines) <= rows:
            return text
        return Text("\n").join(lines[len(lines) - max(rows, 1) :])


class ArenaUI(ChatUI):
    """The chat's terminal, plus the arena's duel and its vote."""

    _vote: PromptSession[str] | None = None

    def duel(self, titles: Sequence[str], tools: bool = True) -> DuelView:
        return DuelView(self.console, titles, tools)

    def ask_vote(self, question: str) -> str | None:
        """The vote typed: on a terminal one of VOTE_KEYS decides at once (anything else,
        `/retry` say, is a line ended by Enter); from piped input the next line. None on
        Ctrl-C, Ctrl-D, or the end of the input."""
        if self._lines is not None:
            try:
                line = self._lines.readline()
            except KeyboardInterrupt:
                return None
            return readable_text(line.strip()) if line else None
        if self._vote is None:
            self._vote = PromptSession(
                history=InMemoryHistory(),
                key_bindings=self._vote_keys(),
                input=self._input,
                output=self._output,
            )
        try:
            return readable_text(self._vote.prompt(question).strip())
        except (KeyboardInterrupt, EOFError):
            return None

    def _vote_keys(self) -> KeyBindings:
        bindings = KeyBindings()

        def decide(key: str) -> None:
            @bindings.add(key)
            def _(event: KeyPressEvent) -> None:
                buffer = event.current_buffer
                if buffer.text:  # inside a typed command (/retry): just a letter
                    buffer.insert_text(key)
                else:
                    event.app.exit(result=key)

        for key in VOTE_KEYS:
            decide(key)
        return bindings

    def edit(self, text: str) -> str | None:
        """`text` at a prompt to edit, Enter keeps it; None on Ctrl-C, or from piped input
        (where /edit TEXT gives the text)."""
        if self._lines is not None:
            return None
        session: PromptSession[str] = PromptSession(
            history=InMemoryHistory(), input=self._input, output=self._output
        )
        try:
            return readable_text(session.prompt("Edit the reply › ", default=text))
        except (KeyboardInterrupt, EOFError):
            return None

    def tally(self, rows: Sequence[Mapping[str, object]]) -> None:
        """This session's votes per model (/stats in the arena)."""
        headers = ("model", "wins", "losses", "ties", "both bad")
        self.table(headers, [[str(row[h]) for h in headers] for row in rows])
