"""Drawing the chat's larger pieces: the start-up banner, tables, a resumed conversation's
recap, a whole conversation's transcript, and /samples' alternative replies side by side
(render.py draws the streamed reply and the one-line messages).

Does not know: tokens, commands or settings. Everything it draws comes in as plain data.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from chatcli.terminal.render import (
    HELP_LINE,
    format_badge,
    print_line,
    space_after_badge,
    stat_number,
    visible,
)


def _format_count(n: float) -> str:
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.1f}{suffix}"
    return f"{n:.0f}"


def render_banner(console: Console, info: Mapping[str, object]) -> None:
    """The start-up banner. Keys, each optional: path, tag, source, step, era, params,
    device, device_note (why --device auto chose it), dtype, context_len, load_s, kernels
    (why our C kernels do not run: a notice line)."""

    def present(key: str) -> bool:
        return info.get(key) not in (None, "")

    title = ["chatcli"]
    title += [str(info[k]) for k in ("tag", "source") if present(k)]
    if present("step"):
        title.append(f"step {info['step']}")
    if present("era"):
        title.append(f"era {info['era']}")
    params = stat_number(info, "params")
    if params is not None:
        title.append(f"{_format_count(params)} params")
    print_line(console, Text(" · ".join(title), style="banner"))
    if present("path"):
        print_line(console, Text(str(info["path"]), style="status"))

    setup = [str(info[k]) for k in ("device", "dtype") if present(k)]
    if present("device") and present("device_note"):
        setup[0] = f"{info['device']} ({info['device_note']})"
    context_len, load_s = stat_number(info, "context_len"), stat_number(info, "load_s")
    if context_len is not None:
        setup.append(f"context {context_len:.0f}")
    if load_s is not None:
        setup.append(f"loaded in {load_s:.1f}s")
    if setup:
        print_line(console, Text(" · ".join(setup), style="status"))
    if present("kernels"):
        print_line(console, Text(visible(str(info["kernels"])), style="notice"))
    print_line(console, Text(HELP_LINE, style="status"))


# --- tables and side-by-side replies -----------------------------------------------------


PIPED_TABLE_WIDTH = 10_000  # wider than any row: a table not on a terminal is never folded


# A cell that is a number, with its unit if any: 2455, 0.12s, 1,234,567, 561.0M, 3.87x, 2.1 GB.
_NUMBER = re.compile(r"^[-+]?\d[\d,]*(?:\.\d+)?(?: ?[A-Za-z%/]+)?$")
_NO_NUMBER = ("", "-")  # what a numeric column may show where it has no number
TOKEN_CELLS = 24  # a token cell this short is kept whole (_unbroken)
# A date, a time, an id: one or two words with digits in them (words alone may fold).
_TOKEN = re.compile(r"^(?=.*\d)\S+(?: \S+)?$")


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], widths: Sequence[int | None] = ()
) -> Table:
    table = Table(
        box=box.SIMPLE_HEAD,
        show_header=any(headers),
        show_edge=False,
        pad_edge=False,
        collapse_padding=bool(widths),  # squeezed: two spaces between columns, not three
    )
    for header, width in zip(headers, widths or [None] * len(headers), strict=True):
        table.add_column(header, overflow="fold", width=width)
    for row in rows:
        table.add_row(*row)
    return table


def _unbroken(column: Sequence[str]) -> bool:
    """Whether a column's cells are kept whole on a narrow terminal: numbers (2455, 0.12s),
    and short tokens such as a date and time or an id (`2026-11-26 09:19`, a conversation's
    id to copy into /load): cut in two, they no longer read, or no longer paste."""
    filled = [cell for cell in column if cell not in _NO_NUMBER]
    return bool(filled) and all(
        _NUMBER.match(cell) or (_TOKEN.match(cell) and cell_len(cell) <= TOKEN_CELLS)
        for cell in filled
    )


def _squeezed_widths(
    headers: Sequence[str], rows: Sequence[Sequence[str]], room: int
) -> list[int | None]:
    """Widths for a table that does not fit in `room` columns (its text, gaps left out).
    Rich, left to itself, folds every column alike: 2455 became 245 over 5. Here a numeric
    column is as wide as its longest number; then, while room is left, as its header's
    longest word, and (once the text columns have their natural width) as its whole header,
    the smallest steps first. Text columns (None) get what is left, and fold."""
    columns = [[row[i] if i < len(row) else "" for row in rows] for i in range(len(headers))]
    widths: list[int | None] = [
        max(map(cell_len, column)) if _unbroken(column) else None for column in columns
    ]
    text = [
        max(map(cell_len, (header, *column)))
        for header, column, width in zip(headers, columns, widths, strict=True)
        if width is None
    ]

    def widen(wanted: Callable[[str], int], spare: int) -> int:
        steps = sorted(
            (wanted(header) - width, i)
            for i, (header, width) in enumerate(zip(headers, widths, strict=True))
            if width is not None and wanted(header) > width
        )
        for step, i in steps:
            if step <= spare:
                widths[i] = wanted(headers[i])
                spare -= step
        return spare

    least = sum(min(4, width) for width in text)  # what text columns keep at least
    spare = room - least - sum(width or 0 for width in widths)
    if spare < 0:  # a date and time may wrap at its space first: each word stays whole
        for i, column in enumerate(columns):
            words = max((cell_len(w) for cell in column for w in cell.split()), default=0)
            if widths[i] is not None and not all(_NUMBER.match(c) for c in column if c):
                spare += widths[i] - words
                widths[i] = words
    if spare < 0:  # not even whole words fit: Rich folds every column alike
        return [None] * len(headers)
    spare = widen(lambda header: max(map(cell_len, header.split()), default=0), spare)
    widen(cell_len, spare - (sum(text) - least))
    return widths


def render_table(console: Console, headers: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    """A small table; a header of "" leaves the header row out. On a terminal too narrow for
    it, numbers stay whole and text folds (_squeezed_widths)."""
    cells = [[visible(cell) for cell in row] for row in rows]
    table = _table(headers, cells)
    if not console.is_terminal:
        # Into a pipe or a file, rows at their natural width: folded at Rich's default 80
        # columns, a path split over lines and `chatcli models | grep` missed it. (A
        # console's print never goes wider than the console.)
        console = Console(
            file=console.file, width=PIPED_TABLE_WIDTH, color_system=None, highlight=False
        )
    else:
        unbounded = console.options.update_width(PIPED_TABLE_WIDTH)
        if Measurement.get(console, unbounded, table).maximum > console.width:
            ones = _table(headers, cells, [1] * len(headers))  # as wide as its gaps, and 1 a column
            gaps = Measurement.get(console, unbounded, ones).maximum - len(headers)
            widths = _squeezed_widths(headers, cells, console.width - gaps)
            table = _table(headers, cells, widths)
    console.print(table)


def reply_text(parts: Sequence[Mapping[str, str]], tools: bool = True) -> Text:
    """A finished reply's parts as text, each calculator call as its `[calc ...]` badge.
    tools: whether the calculator ran; if not, a call without a result was not run."""
    text = Text()
    pending: str | None = None  # the expression of a call whose result may follow
    after_badge = False
    for part in parts:
        if part["type"] == "python_output":
            text.append(f"[{format_badge(pending or '?', visible(part['text']))}]", style="calc")
            pending, after_badge = None, True
            continue
        if pending is not None:
            text.append(f"[{format_badge(pending, None, off=not tools)}]", style="calc")
            pending, after_badge = None, True
        if part["type"] == "python":
            pending = visible(part["text"])
        elif part["text"]:
            shown = visible(part["text"])
            text.append(space_after_badge(shown) if after_badge else shown, style="assistant")
            after_badge = False
    if pending is not None:
        text.append(f"[{format_badge(pending, None, off=not tools)}]", style="calc")
    return text


def render_recap(console: Console, messages: Sequence[Mapping[str, object]]) -> None:
    """Where a resumed conversation left off: how many messages came before, then its last
    question and reply (calculator calls as badges), so the next message has its context."""
    rest = [m for m in messages if m["role"] != "system"]
    start = max(
        (i for i, m in enumerate(rest) if m["role"] == "user"), default=len(rest)
    )  # the last question, and whatever answered it
    if start > 0:
        earlier = f"{start} earlier message{'s' if start > 1 else ''}"
        print_line(console, Text(f"… {earlier}", style="status"))
    for message in rest[start:]:
        content = message["content"]
        if message["role"] == "user":
            print_line(console, Text(f"> {visible(str(content))}", style="user"))
        else:
            parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
            print_line(console, reply_text(parts))  # type: ignore[arg-type]


def render_transcript(console: Console, messages: Sequence[Mapping[str, object]]) -> None:
    """A whole conversation as the chat showed it: the system prompt, each question after
    `> `, each reply with its calculator calls as badges; a blank line between exchanges."""
    for i, message in enumerate(messages):
        content = message["content"]
        if message["role"] == "system":
            print_line(console, Text(f"system: {visible(str(content))}", style="status"))
        elif message["role"] == "user":
            if i > 0 and messages[i - 1]["role"] == "assistant":
                console.print()
            print_line(console, Text(f"> {visible(str(content))}", style="user"))
        else:
            parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
            print_line(console, reply_text(parts))  # type: ignore[arg-type]


# The narrowest panel that still reads well: about 26 columns of text inside its border.
MIN_PANEL_WIDTH = 30
PANEL_GAP = 1  # columns between two panels side by side


def panels_per_row(width: int, count: int) -> int:
    """How many of `count` panels go side by side on a `width`-column terminal: as many as
    get MIN_PANEL_WIDTH each, spread evenly over the rows they need (4 on 100 columns: 2
    and 2, not 3 and 1); 1 stacks them."""
    fit = max(1, (width + PANEL_GAP) // (MIN_PANEL_WIDTH + PANEL_GAP))
    rows = -(-count // fit)  # ceil
    return -(-count // rows) if count else 1


def render_replies(
    console: Console,
    replies: Sequence[tuple[Sequence[Mapping[str, str]], str]],
    tools: bool = True,
) -> None:
    """Alternative replies, each given as its parts and a subtitle, in panels titled 1..N:
    side by side, in rows of as many as fit (panels_per_row), one after another where not
    even two fit. tools: whether the calculator ran for them (reply_text)."""
    panels = [
        Panel(
            reply_text(parts, tools), title=str(i), subtitle=visible(subtitle), title_align="left"
        )
        for i, (parts, subtitle) in enumerate(replies, start=1)
    ]
    per_row = panels_per_row(console.width, len(panels))
    if per_row == 1:
        for panel in panels:
            console.print(panel)
        return
    # One grid, so the panels of a shorter last row line up under those above.
    grid = Table.grid(expand=True, padding=(0, PANEL_GAP))  # a grid's padding collapses
    for _ in range(per_row):
        grid.add_column(ratio=1)
    for start in range(0, len(panels), per_row):
        row = panels[start : start + per_row]
        grid.add_row(*row, *[""] * (per_row - len(row)))
    console.print(grid)
