"""Drawing a chat on the terminal: the streamed reply, status line, errors, notices, banner,
tables and alternative replies side by side. The chat's Rich lives here: repl.py and
chat_commands.py hand a console through and never call Rich themselves.

Owns the theme, the console set-up, and the live reply renderer. The renderer never redraws
the whole answer: in markdown mode the reply is cut into blocks (paragraphs, fenced code,
headings, top-level list items); a block is printed once, when it is finished, and stays in
scrollback; only the block still being written is repainted (a transient Rich `Live`).

Does not know: tokens, tokenizers or torch (it consumes the events of stream.py), prompts and
key bindings (repl), what a command does (chat_commands), or where settings come from (cli).
Everything it draws comes in as plain data: strings, mappings, stream events.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.panel import Panel
from rich.segment import Segment
from rich.table import Table
from rich.text import Text
from rich.theme import Theme

from chatcli.errors import ConfigError
from chatcli.stream import SpecialToken, StreamEvent, TextDelta, ToolResult

CHAT_THEME = Theme(
    {
        "calc": "dim",
        # The calculator badge in Markdown mode is drawn as <kbd> (see _markdown_badge).
        "markdown.kbd": "dim",
        "calc.expr": "cyan",
        "calc.result": "green",
        "calc.failed": "red",
        "calc.cut": "yellow",
        "calc.off": "dim",
        "special": "magenta",
        "interrupted": "italic yellow",
        "status": "dim",
        "error": "bold red",
        "notice": "yellow",
        "banner": "bold",
        "user": "bold green",
        "assistant": "default",
    }
)

HELP_LINE = "Type /help for commands, Ctrl-D to exit."

# Control characters but newline and tab: C0, DEL and C1. Rich drops only a few of them, and
# the rest would reach the terminal as they are: ESC starts sequences that clear the screen,
# set the window title or write the clipboard, and a model (or a server) may write any of it.
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """`text` safe to print: each control character shown as its Unicode control picture
    (ESC as ␛), or as � where it has none (C1). Newlines and tabs stay."""

    def picture(match: re.Match[str]) -> str:
        code = ord(match[0])
        if code == 0x0D:  # a carriage return (a model's \r\n): dropped, as Rich drops it
            return ""
        return chr(0x2400 + code) if code < 0x20 else "\u2421" if code == 0x7F else "\ufffd"

    return _CONTROLS.sub(picture, text)


def _print_line(console: Console, text: Text) -> None:
    # On a terminal Rich wraps at word boundaries; into a pipe or a file, a line stays whole.
    # Its text may come from a server or a file: visible() keeps control characters inert.
    clean = visible(text.plain)
    if clean != text.plain:  # (its spans would no longer fit: one style for the whole)
        text = Text(clean, style=text.style)
    console.print(text, soft_wrap=not console.is_terminal)


def make_console(force_plain: bool = False, file: IO[str] | None = None) -> Console:
    """A console with the chat theme. NO_COLOR (or force_plain) gives plain text; a stdout that
    is not a terminal gets no colour from Rich's own detection."""
    plain = force_plain or os.environ.get("NO_COLOR", "") != ""
    # Model text is always printed as Text, but highlight and emoji stay off so nothing the
    # model writes (":smile:", "[1, 2]") is ever reinterpreted.
    return Console(
        file=file,
        theme=CHAT_THEME,
        color_system=None if plain else "auto",
        highlight=False,
        emoji=False,
    )


def use_markdown(console: Console, mode: str = "auto") -> bool:
    """Resolves `--markdown auto|always|never`: auto means a real, colourful terminal."""
    if mode == "always":
        return True
    if mode == "never":
        return False
    if mode == "auto":
        return (
            console.is_terminal
            and not console.is_dumb_terminal
            and console.color_system is not None
        )
    raise ConfigError(f"--markdown must be auto, always or never, not {mode!r}")


CUT_MARK = "… cut"  # a call the length limit stopped: neither answered nor failed
OFF_MARK = "not run (tools off)"  # a call written under /tools off: nothing was asked


def format_badge(expression: str, output: str | None, cut: bool = False, off: bool = False) -> str:
    """One line for a calculator call: `calc 12*7 = 84`, `calc 1/0 failed`,
    `calc 12* … cut` for one the reply's length limit stopped before it finished, or
    `calc 12*7 not run (tools off)` for one written while the calculator was off."""
    expression = " ".join(expression.split())
    if cut:
        return f"calc {expression} {CUT_MARK}"
    if output is None:
        return f"calc {expression} {OFF_MARK if off else 'failed'}"
    return f"calc {expression} = {' '.join(output.split())}"


def _badge(expression: str, output: str | None, cut: bool = False, off: bool = False) -> Text:
    """The styled plain-mode badge: `[calc 12*7 = 84]`, `[calc 1/0 failed]`,
    `[calc 12* … cut]` or `[calc 12*7 not run (tools off)]`."""
    badge = Text("[calc ", style="calc")
    badge.append(" ".join(expression.split()), style="calc.expr")
    if cut:
        badge.append(f" {CUT_MARK}", style="calc.cut")
    elif output is None and off:
        badge.append(f" {OFF_MARK}", style="calc.off")
    elif output is None:
        badge.append(" failed", style="calc.failed")
    else:
        badge.append(" = ")
        badge.append(" ".join(output.split()), style="calc.result")
    badge.append("]")
    return badge


def _markdown_escape(text: str) -> str:
    """Markdown that shows `text` literally: every ASCII punctuation character escaped."""
    return re.sub(r"([!-/:-@\[-`{-~])", r"\\\1", text)


def _markdown_badge(
    expression: str, output: str | None, cut: bool = False, off: bool = False
) -> str:
    """The badge in Markdown source: `[calc 12*7 = 84]` as in plain mode, escaped so that
    neither `*` nor `[` is read as Markdown, inside <kbd>, the one inline tag Rich draws in a
    style of its own (the theme's markdown.kbd: dim, as the plain badge)."""
    return f"<kbd>{_markdown_escape(f'[{format_badge(expression, output, cut, off)}]')}</kbd>"


def _code_span(text: str) -> str:
    """Markdown inline code holding `text` verbatim, whatever backticks it contains."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


# --- markdown blocks --------------------------------------------------------------------

_FENCE_OPEN = re.compile(r"^( *)(`{3,}|~{3,})(.*)$")
_FENCE_CLOSE = re.compile(r"^ *(`{3,}|~{3,}) *$")
_HEADING = re.compile(r"^ {0,3}#{1,6}(\s|$)")
# Only items at column 0 split the reply: nested items stay with their parent.
_LIST_ITEM = re.compile(r"^(?:[-+*]|(\d{1,9})[.)])(\s|$)")


@dataclass(frozen=True)
class _Block:
    """One block of markdown source, and whether a blank line goes before it."""

    text: str
    gap: bool


class _BlockSplitter:
    """Cuts streamed markdown into blocks at line ends. A blank line ends a block (except in
    a code fence); a closing fence ends the fenced block; a heading is a block of its own; a
    new top-level list item starts a block, so a long list is committed item by item."""

    def __init__(self) -> None:
        self._lines: list[str] = []  # complete lines of the open block
        self._partial = ""  # the line being written
        self._fence: str | None = None  # the opening fence while inside fenced code
        self._fence_indent = 0
        self._blank_before = False
        self._last_was_item: bool | None = None  # None: nothing committed yet

    def feed(self, text: str) -> list[_Block]:
        """Adds text; returns the blocks it finished."""
        self._partial += text
        done: list[_Block] = []
        while "\n" in self._partial:
            line, self._partial = self._partial.split("\n", 1)
            done += self._take_line(line.rstrip("\r"))
        return done

    def close(self) -> list[_Block]:
        """The reply is over: the open block, if any, is finished as it stands."""
        if self._partial:
            self._lines.append(self._dedent(self._partial))
            self._partial = ""
        return self._commit()

    def open_block(self) -> _Block | None:
        lines = [*self._lines, self._dedent(self._partial)] if self._partial else self._lines
        return self._block(lines)

    def _take_line(self, line: str) -> list[_Block]:
        if self._fence is not None:
            self._lines.append(self._dedent(line))
            closing = _FENCE_CLOSE.match(line)
            if closing and closing.group(1).startswith(self._fence):
                self._fence = None
                return self._commit()
            return []
        if not line.strip():
            done = self._commit()
            self._blank_before = self._last_was_item is not None
            return done
        fence = _FENCE_OPEN.match(line)
        if fence and fence.group(2)[0] == "`" and "`" in fence.group(3):
            fence = None  # a backtick fence's info string may not hold backticks: inline code
        heading = _HEADING.match(line)
        done = self._commit() if fence or heading or self._starts_item(line) else []
        if fence:
            self._fence, self._fence_indent = fence.group(2), len(fence.group(1))
            line = self._dedent(line)
        self._lines.append(line)
        if heading:
            done += self._commit()
        return done

    def _starts_item(self, line: str) -> bool:
        item = _LIST_ITEM.match(line)
        if item is None:
            return False
        # As in CommonMark, only a bullet or "1." may interrupt a paragraph; "2019. was" may not.
        number = item.group(1)
        in_list = not self._lines or _LIST_ITEM.match(self._lines[0]) is not None
        return number is None or int(number) == 1 or in_list

    def _dedent(self, line: str) -> str:
        """Fenced code is moved left by its fence's indent, so a fence inside a list item still
        renders as code when it stands alone as a block."""
        if self._fence is None:
            return line
        indent = len(line) - len(line.lstrip(" "))
        return line[min(indent, self._fence_indent) :]

    def _block(self, lines: list[str]) -> _Block | None:
        if not "".join(lines).strip():
            return None
        is_item = _LIST_ITEM.match(lines[0]) is not None
        # Rich's Markdown puts a blank line between top-level blocks; items of one list touch.
        gap = self._last_was_item is not None and (
            self._blank_before or not (is_item and self._last_was_item)
        )
        return _Block("\n".join(lines), gap)

    def _commit(self) -> list[_Block]:
        block = self._block(self._lines)
        self._lines = []
        if block is None:
            return []
        self._last_was_item = _LIST_ITEM.match(block.text) is not None
        self._blank_before = False
        return [block]


_STAR_IN_ARITHMETIC = re.compile(r"(?<=[\d)])\*(?=[\d(])")
# Code spans and autolinks (<http://...>): escapes would show in both.
_CODE_SPAN_SPLIT = re.compile(r"(`+[^`]*`+|<[A-Za-z][A-Za-z0-9+.-]*:[^<>\s]*>)")


def _arithmetic_kept(text: str) -> str:
    """Markdown source whose `*` between digits (6*7*7, (2+3)*4) stays a star: Markdown reads
    `*7*` as emphasis and the reply would show 677. Code, fenced or inline, is left as it is."""
    if _FENCE_OPEN.match(text.partition("\n")[0]) or text.startswith(("    ", "\t")):
        return text
    pieces = _CODE_SPAN_SPLIT.split(text)  # the odd pieces are code spans
    return "".join(
        piece if i % 2 else _STAR_IN_ARITHMETIC.sub(r"\*", piece) for i, piece in enumerate(pieces)
    )


class _BlockView:
    """Draws one block as markdown. Rich puts a blank line before a list; it is dropped here
    because `_Block.gap` decides spacing. With `tail`, only the last lines that fit on screen
    are drawn, so a live area never outgrows the screen (rows pushed into scrollback could not
    be erased and would stay there as duplicates)."""

    def __init__(self, block: _Block | None, tail: bool = False) -> None:
        self.block = block
        self.tail = tail

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.block is None:
            return
        # hyperlinks off: a link shows its URL, where many terminals would hide it
        markdown = Markdown(_arithmetic_kept(self.block.text), hyperlinks=False)
        lines = console.render_lines(markdown, options, pad=False)
        while lines and Segment.get_line_length(lines[0]) == 0:
            del lines[0]
        if self.block.gap:
            lines.insert(0, [])
        if self.tail:
            lines = lines[-max(1, options.size.height - 1) :]
        for line in lines:
            yield from line
            yield Segment.line()


class _OpenBlockView:
    """The live area's renderable: always the splitter's current open block, so printing a
    finished block above the live area never repaints stale text below it."""

    def __init__(self, splitter: _BlockSplitter) -> None:
        self.splitter = splitter

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield _BlockView(self.splitter.open_block(), tail=True)


# --- the reply ---------------------------------------------------------------------------


class ReplyRenderer:
    """Shows one streamed reply. Feed it every event (including the decoder's flush), then
    call `finish` exactly once, also when generation failed or was interrupted.

    Plain mode prints text as it comes, and a calculator call as an inline badge
    `[calc 12*7 = 84]` / `[calc 1/0 failed]` / `[calc 12* … cut]` once its result is known.
    Markdown mode puts the same badge into the block, escaped and dim (`_markdown_badge`), so
    it never breaks the markdown around it.
    """

    def __init__(
        self, console: Console, markdown: bool, refresh_interval_s: float = 1 / 20
    ) -> None:
        self.console = console
        self.markdown = markdown
        self._refresh_interval_s = refresh_interval_s  # repaints of the open block, at most
        self._at_line_start = True  # plain mode: whether the cursor is at column 0
        self._blocks = _BlockSplitter()
        self._live: Live | None = None
        self._last_paint = 0.0
        self._finished = False

    def handle(self, event: StreamEvent) -> None:
        if isinstance(event, TextDelta):
            text = visible(event.text)
            self._write(text, Text(text, style="assistant"))
        elif isinstance(event, ToolResult):
            expression = visible(event.expression)
            output = None if event.output is None else visible(event.output)
            markdown = _markdown_badge(expression, output, event.cut, event.off)
            self._write(markdown, _badge(expression, output, event.cut, event.off))
        elif isinstance(event, SpecialToken):
            self._write(_code_span(event.name), Text(event.name, style="special"))
        # ToolCallStart and ToolCallDelta draw nothing: the badge comes with the result.

    def finish(self, finish_reason: str) -> None:
        """Commits what is still open, marks an interrupted reply, ends on a fresh line."""
        if self._finished:
            return
        self._finished = True
        interrupted = finish_reason == "interrupted"
        if self.markdown:
            for block in self._blocks.close():
                self.console.print(_BlockView(block))
            if self._live is not None:
                self._live.stop()  # the open block is empty now, so nothing is left behind
                self._live = None
            if interrupted:
                self.console.print(Text("[interrupted]", style="interrupted"))
            return
        if interrupted:
            space = "" if self._at_line_start else " "
            self._print_plain(Text(f"{space}[interrupted]", style="interrupted"))
        if not self._at_line_start:
            self._print_plain(Text("\n"))

    def _write(self, source: str, plain: Text) -> None:
        if not self.markdown:
            self._print_plain(plain)
            return
        finished = self._blocks.feed(source)
        if self._live is None and self.console.is_terminal and not self.console.is_dumb_terminal:
            self._live = Live(
                _OpenBlockView(self._blocks),
                console=self.console,
                transient=True,
                auto_refresh=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._live.start()
        for block in finished:
            # Printed above the live area; the live area is repainted below it by Rich.
            self.console.print(_BlockView(block))
        now = time.monotonic()
        if self._live is not None and (
            finished or now - self._last_paint >= self._refresh_interval_s
        ):
            if not finished:
                self._live.refresh()
            self._last_paint = now

    def _print_plain(self, text: Text) -> None:
        # soft_wrap: no line breaks of Rich's own; each piece lands where the last one ended.
        self.console.print(text, end="", soft_wrap=True)
        if text.plain:
            self._at_line_start = text.plain.endswith("\n")


# --- one-line messages -------------------------------------------------------------------


def _number(stats: Mapping[str, object], key: str) -> float | None:
    value = stats.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def render_status(console: Console, stats: Mapping[str, object]) -> None:
    """`ttft 0.12s · prefill 850 tok/s · decode 120 tok/s · 35 in / 20 out · ctx 55/512 · stop`;
    a piece whose numbers are missing is left out."""
    pieces = []
    ttft, prefill, decode = (_number(stats, k) for k in ("ttft_s", "prefill_tps", "decode_tps"))
    tokens_in, tokens_out = _number(stats, "tokens_in"), _number(stats, "tokens_out")
    used, length = _number(stats, "context_used"), _number(stats, "context_len")
    if ttft is not None:
        pieces.append(f"ttft {ttft:.2f}s")
    if prefill is not None:
        pieces.append(f"prefill {prefill:.0f} tok/s")
    if decode is not None:
        pieces.append(f"decode {decode:.0f} tok/s")
    if tokens_in is not None and tokens_out is not None:
        pieces.append(f"{tokens_in:.0f} in / {tokens_out:.0f} out")
    if used is not None and length:  # 0: a server that does not say its context
        pieces.append(f"ctx {used:.0f}/{length:.0f}")
    if stats.get("finish_reason"):
        pieces.append(str(stats["finish_reason"]))
    _print_line(console, Text(" · ".join(pieces), style="status"))


def render_error(console: Console, message: str) -> None:
    _print_line(console, Text(f"Error: {visible(message)}", style="error"))


def render_notice(console: Console, message: str) -> None:
    _print_line(console, Text(visible(message), style="notice"))


def render_hint(console: Console, message: str) -> None:
    """A quiet line of advice, in the status style (e.g. how to leave)."""
    console.print(Text(visible(message), style="status"))


def render_text(console: Console, message: str) -> None:
    """Plain text printed as it is: no markup; wrapped at words on a terminal only."""
    _print_line(console, Text(visible(message)))


def render_interrupted(console: Console) -> None:
    console.print(Text("[interrupted]", style="interrupted"))


def _format_count(n: float) -> str:
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.1f}{suffix}"
    return f"{n:.0f}"


def render_banner(console: Console, info: Mapping[str, object]) -> None:
    """The start-up banner. Keys, each optional: path, tag, source, step, era, params,
    device, dtype, context_len, load_s."""

    def present(key: str) -> bool:
        return info.get(key) not in (None, "")

    title = ["chatcli"]
    title += [str(info[k]) for k in ("tag", "source") if present(k)]
    if present("step"):
        title.append(f"step {info['step']}")
    if present("era"):
        title.append(f"era {info['era']}")
    params = _number(info, "params")
    if params is not None:
        title.append(f"{_format_count(params)} params")
    _print_line(console, Text(" · ".join(title), style="banner"))
    if present("path"):
        _print_line(console, Text(str(info["path"]), style="status"))

    setup = [str(info[k]) for k in ("device", "dtype") if present(k)]
    context_len, load_s = _number(info, "context_len"), _number(info, "load_s")
    if context_len is not None:
        setup.append(f"context {context_len:.0f}")
    if load_s is not None:
        setup.append(f"loaded in {load_s:.1f}s")
    if setup:
        _print_line(console, Text(" · ".join(setup), style="status"))
    _print_line(console, Text(HELP_LINE, style="status"))


# --- tables and side-by-side replies -----------------------------------------------------


PIPED_TABLE_WIDTH = 10_000  # wider than any row: a table not on a terminal is never folded


def render_table(console: Console, headers: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    """A small table; a header of "" leaves the header row out."""
    table = Table(box=box.SIMPLE_HEAD, show_header=any(headers), show_edge=False, pad_edge=False)
    for header in headers:
        table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*(visible(cell) for cell in row))
    if not console.is_terminal:
        # Into a pipe or a file, rows at their natural width: folded at Rich's default 80
        # columns, a path split over lines and `chatcli models | grep` missed it. (A
        # console's print never goes wider than the console.)
        console = Console(
            file=console.file, width=PIPED_TABLE_WIDTH, color_system=None, highlight=False
        )
    console.print(table)


def reply_text(parts: Sequence[Mapping[str, str]], tools: bool = True) -> Text:
    """A finished reply's parts as text, each calculator call as its `[calc ...]` badge.
    tools: whether the calculator ran; if not, a call without a result was not run."""
    text = Text()
    pending: str | None = None  # the expression of a call whose result may follow
    for part in parts:
        if part["type"] == "python_output":
            text.append(f"[{format_badge(pending or '?', visible(part['text']))}]", style="calc")
            pending = None
            continue
        if pending is not None:
            text.append(f"[{format_badge(pending, None, off=not tools)}]", style="calc")
            pending = None
        if part["type"] == "python":
            pending = visible(part["text"])
        else:
            text.append(visible(part["text"]), style="assistant")
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
        _print_line(console, Text(f"… {earlier}", style="status"))
    for message in rest[start:]:
        content = message["content"]
        if message["role"] == "user":
            _print_line(console, Text(f"> {visible(str(content))}", style="user"))
        else:
            parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
            _print_line(console, reply_text(parts))  # type: ignore[arg-type]


def render_replies(
    console: Console,
    replies: Sequence[tuple[Sequence[Mapping[str, str]], str]],
    tools: bool = True,
) -> None:
    """Alternative replies, each given as its parts and a subtitle, in panels titled 1..N:
    side by side when each can have 40 columns, one after another otherwise. tools: whether
    the calculator ran for them (reply_text)."""
    panels = [
        Panel(
            reply_text(parts, tools), title=str(i), subtitle=visible(subtitle), title_align="left"
        )
        for i, (parts, subtitle) in enumerate(replies, start=1)
    ]
    if console.width < 40 * len(panels):
        for panel in panels:
            console.print(panel)
        return
    grid = Table.grid(expand=True, padding=(0, 1))
    for _ in panels:
        grid.add_column(ratio=1)
    grid.add_row(*panels)
    console.print(grid)
