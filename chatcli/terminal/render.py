"""Drawing a chat on the terminal: the streamed reply, the status line, errors and notices.
The chat's Rich lives here and in render_panels.py (the banner, tables, a recap and replies
side by side): repl.py and the commands hand a console through and never call Rich themselves.

Owns the theme, the console set-up, and the live reply renderer. The renderer never redraws
the whole answer: in markdown mode the reply is cut into blocks (paragraphs, fenced code,
headings, top-level list items: chatcli.terminal.markdown_blocks cuts them); a block is printed
once, when it is finished, and stays in scrollback; only the block still being written is
repainted (a transient Rich `Live`), and of a long one only what fits on the screen, so a
repaint costs a screenful at most.

Does not know: tokens, tokenizers or torch (it consumes the events of stream.py), prompts and
key bindings (repl), what a command does (chat_commands), or where settings come from (cli).
Everything it draws comes in as plain data: strings, mappings, stream events.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import IO

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.segment import Segment
from rich.text import Text
from rich.theme import Theme

from chatcli.chat.stream import SpecialToken, StreamEvent, TextDelta, ToolResult
from chatcli.errors import ConfigError
from chatcli.terminal.keyboard import interrupts_deferred
from chatcli.terminal.markdown_blocks import TAG, Block, BlockSplitter, markdown_kept

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
        # /probs: a reply's tokens by how likely the model found them (render_probs.py).
        "prob.high": "default",
        "prob.mid": "yellow",
        "prob.low": "red",
        "prob.rare": "reverse red",
        "prob.forced": "dim",
        "prob.unknown": "default",
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


def print_line(console: Console, text: Text) -> None:
    # On a terminal Rich wraps at word boundaries; into a pipe or a file, a line stays whole.
    # Its text may come from a server or a file: visible() keeps control characters inert.
    clean = visible(text.plain)
    if clean != text.plain:  # (its spans would no longer fit: one style for the whole)
        text = Text(clean, style=text.style)
    console.print(text, soft_wrap=not console.is_terminal)


def make_console(force_plain: bool = False, file: IO[str] | None = None) -> Console:
    """A console with the chat theme. force_plain gives plain text; NO_COLOR, text without
    colour (bold, dim and the like stay, as no-color.org has it: a calculator badge is still
    set apart); a stdout that is not a terminal gets neither from Rich's own detection."""
    # Model text is always printed as Text, but highlight and emoji stay off so nothing the
    # model writes (":smile:", "[1, 2]") is ever reinterpreted.
    return Console(
        file=file,
        theme=CHAT_THEME,
        color_system=None if force_plain else "auto",
        no_color=os.environ.get("NO_COLOR", "") != "",
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
            and not console.no_color  # NO_COLOR: plain text, as a pipe gets
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


# Text that follows a badge straight on gets a space between (`[calc 2+3 = 5] The answer`),
# unless it opens with a space or with punctuation that closes a phrase (`[calc 2+3 = 5].`).
_CLOSES_PHRASE = ".,;:!?)]}…"


def space_after_badge(text: str) -> str:
    """`text`, which comes right after a calculator badge, as it is shown there."""
    first = text[:1]
    return " " + text if first and not first.isspace() and first not in _CLOSES_PHRASE else text


def _markdown_escape(text: str) -> str:
    """Markdown that shows `text` literally: every ASCII punctuation character escaped."""
    return re.sub(r"([!-/:-@\[-`{-~])", r"\\\1", text)


def _markdown_badge(
    expression: str, output: str | None, cut: bool = False, off: bool = False
) -> str:
    """The badge in Markdown source: `[calc 12*7 = 84]` as in plain mode, escaped so that
    neither `*` nor `[` is read as Markdown, inside <kbd>, the one inline tag Rich draws in a
    style of its own (the theme's markdown.kbd: dim, as the plain badge)."""
    badge = _markdown_escape(f"[{format_badge(expression, output, cut, off)}]")
    return f"{TAG}kbd>{badge}{TAG}/kbd>"  # tags of ours: see TAG


def _code_span(text: str) -> str:
    """Markdown inline code holding `text` verbatim, whatever backticks it contains."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


class _BlockView:
    """Draws one block as markdown. Rich puts a blank line before a list; it is dropped here
    because `Block.gap` decides spacing. With `tail`, only the last lines that fit on screen
    are drawn, so a live area never outgrows the screen (rows pushed into scrollback could not
    be erased and would stay there as duplicates)."""

    def __init__(self, block: Block | None, tail: bool = False) -> None:
        self.block = block
        self.tail = tail

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.block is None:
            return
        # hyperlinks off: a link shows its URL, where many terminals would hide it
        markdown = Markdown(markdown_kept(self.block.text), hyperlinks=False)
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
    """The live area's renderable: always the tail of the splitter's current open block, so
    printing a finished block above the live area never repaints stale text below it."""

    def __init__(self, splitter: BlockSplitter) -> None:
        self.splitter = splitter

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        block = self.splitter.live_block(options.size.height, options.max_width)
        yield _BlockView(block, tail=True)


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
        self._after_badge = False  # the last thing shown is a calculator badge
        self._blocks = BlockSplitter()
        self._unprinted: deque[Block] = deque()  # finished blocks not yet printed
        self._live: Live | None = None
        self._last_paint = 0.0
        self._unpainted = False  # text in the open block that the screen does not show yet
        # The repaint of text that came too soon after the last one, due when the interval
        # is up: without it, that text would wait for the next token, which may be seconds
        # away (a slow server, a calculator call drawing nothing). It runs on a timer thread:
        # _lock keeps it and the writer from using the splitter or the console at once.
        self._trailing_paint: threading.Timer | None = None
        self._lock = threading.Lock()
        self._finished = False

    def handle(self, event: StreamEvent) -> None:
        if isinstance(event, TextDelta):
            text = visible(event.text)
            if self._after_badge and text:
                text, self._after_badge = space_after_badge(text), False
            self._write(text, Text(text, style="assistant"))
        elif isinstance(event, ToolResult):
            expression = visible(event.expression)
            output = None if event.output is None else visible(event.output)
            markdown = _markdown_badge(expression, output, event.cut, event.off)
            self._write(markdown, _badge(expression, output, event.cut, event.off))
            self._after_badge = True
        elif isinstance(event, SpecialToken):
            self._write(_code_span(event.name), Text(event.name, style="special"))
            self._after_badge = False
        # ToolCallStart and ToolCallDelta draw nothing: the badge comes with the result.

    def finish(self, finish_reason: str) -> None:
        """Commits what is still open, marks an interrupted reply, ends on a fresh line."""
        if self._finished:
            return
        self._finished = True
        interrupted = finish_reason == "interrupted"
        if self.markdown:
            with self._lock:
                if self._trailing_paint is not None:
                    self._trailing_paint.cancel()
                    self._trailing_paint = None
                self._unprinted.extend(self._blocks.close())
                try:
                    self._print_finished()
                finally:  # a Ctrl-C meanwhile must not leave the live view up, cursor hidden
                    if self._live is not None:
                        self._live.stop()  # the open block is empty now: nothing left behind
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
        with self._lock:
            finished = self._blocks.feed(source)
            self._unprinted.extend(finished)
            console = self.console
            if self._live is None and console.is_terminal and not console.is_dumb_terminal:
                self._live = Live(
                    _OpenBlockView(self._blocks),
                    console=console,
                    transient=True,
                    auto_refresh=False,
                    redirect_stdout=False,
                    redirect_stderr=False,
                )
                self._live.start()
            self._print_finished()
            if self._live is None:
                return
            if finished:
                self._painted()
                return
            wait = self._last_paint + self._refresh_interval_s - time.monotonic()
            if wait <= 0:
                self._live.refresh()
                self._painted()
                return
            self._unpainted = True
            if self._trailing_paint is None:
                self._trailing_paint = threading.Timer(wait, self._paint_trailing)
                self._trailing_paint.daemon = True  # never keeps the program from exiting
                self._trailing_paint.start()

    def _print_finished(self) -> None:
        """Prints the finished blocks, each whole and once: above the live area, which Rich
        repaints below them. A block leaves the queue only once printed, and a Ctrl-C waits
        for the block being printed, so one that lands meanwhile loses nothing: finish()
        prints what is still queued."""
        while self._unprinted:
            with interrupts_deferred():
                self.console.print(_BlockView(self._unprinted[0]))
                self._unprinted.popleft()

    def _paint_trailing(self) -> None:
        with self._lock:
            if self._trailing_paint is not threading.current_thread():
                return  # cancelled, too late to stop it: a repaint came first
            self._trailing_paint = None
            if self._live is not None and self._unpainted:
                self._live.refresh()
                self._painted()

    def _painted(self) -> None:
        """The screen shows the open block as it stands. The interval counts from the end of
        a repaint: however long one takes, writing gets the time between."""
        self._last_paint = time.monotonic()
        self._unpainted = False
        if self._trailing_paint is not None:
            self._trailing_paint.cancel()
            self._trailing_paint = None

    def _print_plain(self, text: Text) -> None:
        # soft_wrap: no line breaks of Rich's own; each piece lands where the last one ended.
        self.console.print(text, end="", soft_wrap=True)
        if text.plain:
            self._at_line_start = text.plain.endswith("\n")


# --- one-line messages -------------------------------------------------------------------


def stat_number(stats: Mapping[str, object], key: str) -> float | None:
    value = stats.get(key)
    return float(value) if isinstance(value, (int, float)) else None


# A speed is shown only when it was measured over this many tokens and this long: below
# them the first decode step (the sampler's first allocations, a CUDA graph's first replay),
# one scheduler time slice or one page fault moves the rate by a large part
# (docs/performance-notes.md, "Figures behind the code").
MIN_RATE_TOKENS = 16
MIN_RATE_S = 0.1


def _rate(tokens: float | None, per_s: float | None) -> float | None:
    """`per_s` where `tokens` at that speed took long enough to mean something, else None."""
    if not tokens or not per_s or tokens < MIN_RATE_TOKENS or tokens / per_s < MIN_RATE_S:
        return None
    return per_s


def render_status(console: Console, stats: Mapping[str, object]) -> None:
    """`ttft 0.12s · prefill 850 tok/s · decode 120 tok/s · 35 in / 20 out · ctx 55/512 · stop`;
    a piece whose numbers are missing is left out, and so is a time of 0: not measured (a
    reply stopped before its first token). A speed is shown only for enough tokens over
    enough time (MIN_RATE_TOKENS, MIN_RATE_S): the prefill's for the tokens actually
    prefilled (a warm cache skips the rest), the decode's for the steps after the first."""
    pieces = []
    ttft = stat_number(stats, "ttft_s")
    tokens_in, tokens_out = stat_number(stats, "tokens_in"), stat_number(stats, "tokens_out")
    prefill = _rate(stat_number(stats, "prefill_tokens"), stat_number(stats, "prefill_tps"))
    steps = tokens_out - 1 if tokens_out else None  # the first token came with the prefill
    decode = _rate(steps, stat_number(stats, "decode_tps"))
    used, length = stat_number(stats, "context_used"), stat_number(stats, "context_len")
    if ttft:
        pieces.append(f"ttft {ttft:.2f}s")
    if prefill:
        pieces.append(f"prefill {prefill:.0f} tok/s")
    if decode:
        pieces.append(f"decode {decode:.0f} tok/s")
    if tokens_in is not None and tokens_out is not None:
        pieces.append(f"{tokens_in:.0f} in / {tokens_out:.0f} out")
    if used is not None and length:  # 0: a server that does not say its context
        pieces.append(f"ctx {used:.0f}/{length:.0f}")
    if stats.get("finish_reason"):
        pieces.append(str(stats["finish_reason"]))
    print_line(console, Text(" · ".join(pieces), style="status"))


def render_error(console: Console, message: str) -> None:
    print_line(console, Text(f"Error: {visible(message)}", style="error"))


def render_notice(console: Console, message: str) -> None:
    print_line(console, Text(visible(message), style="notice"))


def render_hint(console: Console, message: str) -> None:
    """A quiet line of advice, in the status style (e.g. how to leave)."""
    console.print(Text(visible(message), style="status"))


def render_text(console: Console, message: str) -> None:
    """Plain text printed as it is: no markup; wrapped at words on a terminal only."""
    print_line(console, Text(visible(message)))


def render_interrupted(console: Console) -> None:
    console.print(Text("[interrupted]", style="interrupted"))
