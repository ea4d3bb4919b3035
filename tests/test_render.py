from __future__ import annotations

import os
import re
import signal
import time
from io import StringIO

import pytest
from rich.console import Console
from rich.markdown import Markdown

import chatcli.terminal.render as render_module
from chatcli.chat.stream import (
    StreamEvent,
    TextDelta,
    TokenDecoder,
    ToolCallDelta,
    ToolCallStart,
    ToolResult,
)
from chatcli.errors import ConfigError
from chatcli.model.special_tokens import ASSISTANT_END, SPECIAL_TOKENS
from chatcli.terminal.render import (
    CHAT_THEME,
    ReplyRenderer,
    format_badge,
    make_console,
    render_error,
    render_notice,
    render_status,
    use_markdown,
    visible,
)
from chatcli.terminal.render_panels import (
    panels_per_row,
    render_banner,
    render_recap,
    render_replies,
    render_table,
    reply_text,
)


class ByteTokenizer:
    """Ids 0..255 are bytes; 256.. are the special tokens in nanochat order."""

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(ids)

    def encode_special(self, name: str) -> int:
        return 256 + SPECIAL_TOKENS.index(name)


def console(terminal: bool = False, height: int = 25) -> tuple[Console, StringIO]:
    out = StringIO()
    con = Console(
        file=out,
        width=80,
        height=height,
        force_terminal=terminal,
        color_system=None,
        theme=CHAT_THEME,
    )
    return con, out


def render(events: list[StreamEvent], finish: str = "stop", **kwargs) -> str:
    con, out = console(**kwargs)
    renderer = ReplyRenderer(con, markdown=False)
    for event in events:
        renderer.handle(event)
    renderer.finish(finish)
    return out.getvalue()


def tool(expression: str, output: str | None) -> list[StreamEvent]:
    return [ToolCallStart(), ToolCallDelta(expression), ToolResult(expression, output)]


# --- plain mode ----------------------------------------------------------------------------


def test_plain_text_streams_in_order_with_a_final_newline():
    events = [TextDelta("Hello"), TextDelta(", "), TextDelta("world.")]
    assert render(events) == "Hello, world.\n"


def test_plain_tool_success_is_an_inline_badge():
    events = [TextDelta("It is "), *tool("1234*56", "69104"), TextDelta(".")]
    assert render(events) == "It is [calc 1234*56 = 69104].\n"


def test_plain_tool_failure_is_marked_failed():
    events = [TextDelta("Try "), *tool("1/0", None), TextDelta(" no.")]
    assert render(events) == "Try [calc 1/0 failed] no.\n"


def markdown_lines(events: list[StreamEvent], finish: str = "stop") -> list[str]:
    """The lines a Markdown-mode renderer prints for `events`."""
    con, out = console()
    renderer = ReplyRenderer(con, markdown=True)
    for event in events:
        renderer.handle(event)
    renderer.finish(finish)
    return lines_of(out.getvalue())


def test_a_call_cut_by_the_length_limit_is_marked_cut_not_failed():
    events = [ToolCallStart(), ToolCallDelta("1111*2"), ToolResult("1111*2", None, cut=True)]
    assert render(events, finish="length") == "[calc 1111*2 … cut]\n"
    assert markdown_lines(events, "length") == ["[calc 1111*2 … cut]"]


def test_a_cut_call_is_yellow_and_a_failed_one_red_on_a_colour_terminal():
    out = StringIO()
    con = Console(file=out, width=80, color_system="standard", theme=CHAT_THEME)
    renderer = ReplyRenderer(con, markdown=False)
    renderer.handle(ToolResult("12*", None, cut=True))
    renderer.handle(ToolResult("1/0", None))
    renderer.finish("length")
    assert "\x1b[2;33m … cut\x1b[0m" in out.getvalue()  # dim, as the whole badge
    assert "\x1b[2;31m failed\x1b[0m" in out.getvalue()


def test_a_call_made_with_the_tools_off_says_not_run_in_every_mode():
    events = [*tool("2+2", None)[:2], ToolResult("2+2", None, off=True)]
    assert render(events) == "[calc 2+2 not run (tools off)]\n"
    assert markdown_lines(events) == ["[calc 2+2 not run (tools off)]"]
    parts = [{"type": "python", "text": "2+2"}, {"type": "text", "text": "4"}]
    assert reply_text(parts, tools=False).plain == "[calc 2+2 not run (tools off)] 4"
    assert reply_text(parts).plain == "[calc 2+2 failed] 4"


def test_badge_text_is_one_line():
    assert format_badge(" 12 *\n 7 ", "84\n") == "calc 12 * 7 = 84"
    assert format_badge("1/0", None) == "calc 1/0 failed"


def test_model_text_is_never_read_as_markup_emoji_or_wrapped():
    text = "[bold]not bold[/bold] :smile: " + "x" * 120
    out = StringIO()
    con = make_console(file=out)  # the app's own console: emoji and highlight off
    renderer = ReplyRenderer(con, markdown=False)
    renderer.handle(TextDelta(text))
    renderer.finish("stop")
    assert out.getvalue() == text + "\n"


def test_plain_output_ending_in_newline_gets_no_extra_line():
    assert render([TextDelta("done\n")]) == "done\n"


def test_interrupted_reply_is_marked():
    assert render([TextDelta("Partial")], finish="interrupted") == "Partial [interrupted]\n"
    assert render([TextDelta("line\n")], finish="interrupted") == "line\n[interrupted]\n"


def test_split_utf8_through_the_decoder_arrives_whole():
    tok = ByteTokenizer()
    decoder = TokenDecoder(tok)
    reply = "naïve € 😀 中文"
    events: list[StreamEvent] = []
    for token in [*reply.encode(), tok.encode_special(ASSISTANT_END)]:
        events += decoder.feed(token, 1)
    events += decoder.flush()
    assert render(events) == reply + "\n"


# --- markdown mode -------------------------------------------------------------------------

REPLY = (
    "First paragraph.\n"
    "\n"
    "Second paragraph.\n"
    "\n"
    "```python\n"
    "print('hi')\n"
    "\n"
    "x = 1\n"
    "```\n"
    "After the code.\n"
    "- one\n"
    "- two\n"
)

# What Rich draws for REPLY as a whole document, which block-by-block output must match.
REPLY_DRAWN = [
    "First paragraph.",
    "",
    "Second paragraph.",
    "",
    "",
    " print('hi')",
    "",
    " x = 1",
    "",
    "",
    "After the code.",
    "",
    " • one",
    " • two",
]


def stream_markdown(con: Console, reply: str, chunk: int = 3, finish: str = "stop") -> None:
    renderer = ReplyRenderer(con, markdown=True, refresh_interval_s=0)
    for i in range(0, len(reply), chunk):
        renderer.handle(TextDelta(reply[i : i + chunk]))
    renderer.finish(finish)


def lines_of(output: str) -> list[str]:
    return [line.rstrip() for line in output.splitlines()]


_CSI = re.compile(r"\x1b\[(\??)(\d*)([A-Za-z])")


def replay(output: str, height: int) -> list[str]:
    """What a terminal of `height` rows shows, scrollback included, after `output`. Handles the
    controls Rich's Live uses, and fails if the cursor is sent up into scrollback (rows there
    can no longer be erased: that is how duplicate rows are left behind)."""
    rows, row, col, i = [""], 0, 0, 0
    while i < len(output):
        control = _CSI.match(output, i)
        if control:
            private, n, command = control.groups()
            i = control.end()
            if private:
                continue  # cursor show / hide
            if command == "A":
                row -= int(n or 1)
                assert row >= len(rows) - height, "cursor moved up into scrollback"
            elif command == "K":
                rows[row] = ""
            else:
                raise AssertionError(f"unexpected control {control.group()!r}")
            continue
        char, i = output[i], i + 1
        if char == "\n":
            row, col = row + 1, 0
            if row == len(rows):
                rows.append("")
        elif char == "\r":
            col = 0
        else:
            line = rows[row].ljust(col)
            rows[row] = line[:col] + char + line[col + 1 :]
            col += 1
    return [r.rstrip() for r in rows]


def test_markdown_blocks_are_printed_once_each_when_not_a_terminal():
    con, out = console(terminal=False)
    stream_markdown(con, REPLY)
    assert lines_of(out.getvalue()) == REPLY_DRAWN
    assert out.getvalue().count("First paragraph.") == 1
    assert out.getvalue().count("print('hi')") == 1


def test_markdown_on_a_terminal_leaves_each_row_once_in_scrollback():
    con, out = console(terminal=True, height=10)
    stream_markdown(con, REPLY)
    screen = replay(out.getvalue(), height=10)
    assert screen[:-1] == REPLY_DRAWN
    assert screen[-1] == ""  # the cursor ends on a fresh line
    # The live area did repaint: the open block was shown part-written.
    assert "Second par" in out.getvalue().replace("Second paragraph.", "")


def test_markdown_block_taller_than_the_screen_shows_its_tail_and_commits_once():
    code = "".join(f"line_{n} = {n}\n" for n in range(20))
    con, out = console(terminal=True, height=6)
    renderer = ReplyRenderer(con, markdown=True, refresh_interval_s=0)
    renderer.handle(TextDelta("```\n" + code))
    live = replay(out.getvalue(), height=6)
    assert "line_19 = 19" in " ".join(live)
    assert "line_0 = 0" not in " ".join(live)
    renderer.handle(TextDelta("```\n"))
    renderer.finish("stop")
    screen = replay(out.getvalue(), height=6)
    assert [row for row in screen if row.strip()] == [f" line_{n} = {n}" for n in range(20)]


def render_markdown_badges(con: Console) -> None:
    renderer = ReplyRenderer(con, markdown=True)
    renderer.handle(TextDelta("The product is "))
    for event in tool("6*7*2", "84"):
        renderer.handle(event)
    renderer.handle(TextDelta("84, and "))
    for event in tool("x[0](1)", None):
        renderer.handle(event)
    renderer.handle(TextDelta(" *is not* defined."))
    renderer.finish("stop")


def test_markdown_badge_is_bracketed_like_the_plain_one_and_read_literally():
    con, out = console()
    render_markdown_badges(con)
    assert lines_of(out.getvalue()) == [
        "The product is [calc 6*7*2 = 84] 84, and [calc x[0](1) failed] is not defined."
    ]


def test_markdown_badge_is_dim_on_a_colour_terminal():
    out = StringIO()
    con = Console(file=out, width=100, color_system="standard", theme=CHAT_THEME)
    render_markdown_badges(con)
    assert "\x1b[2m[calc 6*7*2 = 84]\x1b[0m 84" in out.getvalue()
    assert "\x1b[2m[calc x[0](1) failed]\x1b[0m " in out.getvalue()


def test_markdown_interrupted_commits_the_open_block_then_marks_it():
    con, out = console(terminal=True)
    stream_markdown(con, "Done.\n\nHalf a sen", finish="interrupted")
    screen = replay(out.getvalue(), height=25)
    assert screen == ["Done.", "", "Half a sen", "[interrupted]", ""]


def test_markdown_heading_and_list_items_are_separate_blocks():
    con, out = console()
    stream_markdown(con, "# Title\nIntro:\n1. first\n2. second\n   more\n", chunk=1)
    assert lines_of(out.getvalue()) == [
        "                                     Title",
        "",
        "Intro:",
        "",
        " 1 first",
        " 2 second more",
    ]


# --- one-line messages ---------------------------------------------------------------------


def test_status_line_format():
    con, out = console()
    render_status(
        con,
        {
            "ttft_s": 0.1234,
            "prefill_tokens": 100,  # of 135: the rest came from the warm cache
            "prefill_tps": 850.4,
            "decode_tps": 120.0,
            "tokens_in": 135,
            "tokens_out": 20,
            "context_used": 155,
            "context_len": 512,
            "finish_reason": "stop",
        },
    )
    assert out.getvalue() == (
        "ttft 0.12s · prefill 850 tok/s · decode 120 tok/s · 135 in / 20 out · ctx 155/512 · stop\n"
    )


def test_status_line_leaves_out_what_is_missing():
    con, out = console()
    render_status(con, {"ttft_s": None, "tokens_in": 3, "tokens_out": 0, "finish_reason": "length"})
    assert out.getvalue() == "3 in / 0 out · length\n"


def test_error_and_notice_print_the_message_verbatim():
    con, out = console()
    render_error(con, "No checkpoint in [x]; pass --model")
    render_notice(con, "Context 80% full")
    assert out.getvalue() == "Error: No checkpoint in [x]; pass --model\nContext 80% full\n"


def test_banner_shows_model_setup_and_help():
    con, out = console()
    render_banner(
        con,
        {
            "path": "/ckpt/chatsft_checkpoints/d20",
            "tag": "d20",
            "source": "sft",
            "step": 650,
            "era": "E",
            "params": 560_988_160,
            "device": "cuda",
            "dtype": "bfloat16",
            "context_len": 2048,
            "load_s": 3.21,
        },
    )
    assert out.getvalue() == (
        "chatcli · d20 · sft · step 650 · era E · 561.0M params\n"
        "/ckpt/chatsft_checkpoints/d20\n"
        "cuda · bfloat16 · context 2048 · loaded in 3.2s\n"
        "Type /help for commands, Ctrl-D to exit.\n"
    )


def test_banner_with_little_information_still_says_how_to_get_help():
    con, out = console()
    render_banner(con, {"device": "cpu"})
    assert out.getvalue() == "chatcli\ncpu\nType /help for commands, Ctrl-D to exit.\n"


# --- console -------------------------------------------------------------------------------


def test_console_not_on_a_terminal_is_plain(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    con = make_console(file=StringIO())
    assert not con.is_terminal
    assert con.color_system is None
    assert use_markdown(con) is False


def test_no_color_gives_plain_text_even_on_a_terminal(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    con = make_console(file=StringIO())
    assert con.color_system is None
    assert use_markdown(con, "auto") is False
    assert use_markdown(con, "always") is True


def test_force_plain_has_no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert make_console(force_plain=True, file=StringIO()).color_system is None


def test_markdown_mode_must_be_known():
    con, _ = console()
    assert use_markdown(con, "never") is False
    with pytest.raises(ConfigError, match="auto, always or never"):
        use_markdown(con, "sometimes")


def test_reply_text_shows_each_calculator_call_as_its_badge():
    parts = [
        {"type": "text", "text": "It is "},
        {"type": "python", "text": "12*7"},
        {"type": "python_output", "text": "84"},
        {"type": "text", "text": ", and "},
        {"type": "python", "text": "1/0"},
    ]
    assert reply_text(parts).plain == "It is [calc 12*7 = 84], and [calc 1/0 failed]"


def test_table_without_headers_has_no_header_row():
    con, out = console()
    render_table(con, ("", ""), [("params", "1,234,567"), ("tag", "d4")])
    lines = [line.strip() for line in out.getvalue().splitlines() if line.strip()]
    assert lines == ["params   1,234,567", "tag      d4"]


def _line_of(text: str, lines: list[str]) -> int:
    (index,) = [i for i, line in enumerate(lines) if text in line]
    return index


def test_replies_sit_side_by_side_when_each_gets_30_columns():
    con, out = console()  # 80 columns: room for two
    render_replies(con, [([{"type": "text", "text": "left"}], "1 tok"), ([], "0 tok")])
    lines = out.getvalue().splitlines()
    assert _line_of("left", lines) == 1
    assert _line_of("1 tok", lines) == _line_of("0 tok", lines) == 2


def test_replies_that_do_not_fit_in_one_row_wrap_into_rows_of_panels():
    con, out = console()  # 80 columns: two to a row
    texts = ("left", "middle", "right")
    render_replies(con, [([{"type": "text", "text": t}], f"{i} tok") for i, t in enumerate(texts)])
    lines = out.getvalue().splitlines()
    assert [_line_of(t, lines) for t in texts] == [1, 1, 4]
    assert lines[4].index("right") == lines[1].index("left")  # under the first


def test_four_replies_on_100_columns_sit_two_by_two():
    con, out = console()
    con.width = 100
    texts = ("one", "two", "three", "four")
    render_replies(con, [([{"type": "text", "text": t}], "") for t in texts])
    lines = out.getvalue().splitlines()
    assert [_line_of(t, lines) for t in texts] == [1, 1, 4, 4]


def test_replies_stack_when_two_panels_would_be_narrower_than_30_columns():
    con, out = console()
    con.width = 50
    render_replies(con, [([{"type": "text", "text": t}], "") for t in ("left", "right")])
    lines = out.getvalue().splitlines()
    assert [_line_of(t, lines) for t in ("left", "right")] == [1, 4]


@pytest.mark.parametrize(
    ("width", "count", "per_row"),
    [
        (100, 3, 3),
        (100, 4, 2),
        (100, 5, 3),
        (80, 2, 2),
        (80, 3, 2),
        (61, 2, 2),
        (60, 2, 1),
        (124, 4, 4),
        (200, 8, 4),
        (120, 1, 1),
    ],
)
def test_panels_per_row_fits_30_column_panels_and_evens_out_the_rows(width, count, per_row):
    assert panels_per_row(width, count) == per_row


def test_a_table_into_a_pipe_keeps_each_row_on_one_line():
    con, out = console()  # not a terminal, 80 columns
    path = "/home/someone/.cache/nanochat/chatsft_checkpoints/d32/model_000650.pt"
    render_table(con, ("model", "path"), [("d32", path)])
    rows = [line.rstrip() for line in out.getvalue().splitlines()]
    assert rows[-1].split() == ["d32", path]


def markdown_render(events: list[StreamEvent], width: int = 80) -> str:
    con, out = console(terminal=True)
    con.width = width
    renderer = ReplyRenderer(con, markdown=True)
    for event in events:
        renderer.handle(event)
    renderer.finish("stop")
    return out.getvalue()


@pytest.mark.parametrize("markdown", [False, True])
def test_control_characters_in_a_reply_never_reach_the_terminal(markdown):
    hostile = "a \x1b]0;TITLE\x07 b \x1b[2J c \x9b d\x7f\n"
    events = [TextDelta(hostile), *tool("1\x1b[31m", "2\x1b[0m")]
    out = markdown_render(events) if markdown else render(events)
    # Rich's own output starts its sequences with ESC; none of the reply's are left.
    assert "]0;TITLE" not in out.replace("␛]0;TITLE", "")
    assert "␛]0;TITLE␇ b ␛[2J c \ufffd d␡" in out
    assert "1␛[31m" in out and "2␛[0m" in out


def test_visible_keeps_newlines_and_tabs():
    assert visible("x\n\ty\x00") == "x\n\ty␀"


def test_markdown_keeps_the_stars_of_arithmetic_and_shows_link_addresses():
    out = markdown_render(
        [TextDelta("So 6*7*7 = 294, (2+3)*4 = 20, `2*3*4` and [docs](http://x.example).\n\n")]
    )
    assert "So 6*7*7 = 294, (2+3)*4 = 20, 2*3*4 and docs (http://x.example)." in out


def test_one_line_messages_wrap_at_words_on_a_narrow_terminal():
    con, out = console(terminal=True)
    con.width = 40
    render_notice(con, "Your next message gets 3 replies side by side; you keep one.")
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    assert lines == ["Your next message gets 3 replies side by", "side; you keep one."]


def test_a_recap_shows_the_last_question_and_its_reply():
    con, out = console()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {"role": "user", "content": "What is 6*7?"},
        {
            "role": "assistant",
            "content": [
                {"type": "python", "text": "6*7"},
                {"type": "python_output", "text": "42"},
                {"type": "text", "text": " It is 42."},
            ],
        },
    ]
    render_recap(con, messages)
    assert out.getvalue().splitlines() == [
        "… 2 earlier messages",
        "> What is 6*7?",
        "[calc 6*7 = 42] It is 42.",
    ]


def test_text_from_a_server_in_status_tables_and_banner_is_made_visible():
    con, out = console(terminal=True)
    render_status(con, {"finish_reason": "stop\x1b[2J"})
    render_table(con, ("id", "preview"), [("a", "hi\x1b]0;T\x07")])
    render_banner(con, {"path": "model\x1b[31m"})
    text = out.getvalue()
    assert "stop␛[2J" in text and "hi␛]0;T␇" in text and "model␛[31m" in text
    assert "\x1b[2J" not in text and "\x1b]0;" not in text


def test_a_carriage_return_is_dropped_not_pictured():
    assert visible("one\r\ntwo") == "one\ntwo"


# --- long blocks: a repaint costs a screenful --------------------------------------------

LONG_OPEN_BLOCKS = {
    "code": "```python\n" + "".join(f"x_{n} = f({n})\n" for n in range(2000)),
    "table": "| n | square |\n|---|---|\n" + "".join(f"| {n} | {n * n} |\n" for n in range(2000)),
    "paragraph": " ".join(f"word{n}" for n in range(20_000)),
    "code in a list item": "1. Run:\n\n   ```bash\n"
    + "".join(f"   echo {n}\n" for n in range(2000)),
}
# What the live view keeps above its tail, so the tail is drawn as what it is.
LIVE_CONTEXT = {
    "code": "```python\n",
    "table": "| n | square |\n|---|---|\n",
    "paragraph": "…",
    "code in a list item": "1. …\n   ```bash\n",
}


@pytest.fixture
def markdown_sources(monkeypatch) -> list[str]:
    """Every Markdown source the renderer draws, in order."""
    sources: list[str] = []

    class RecordedMarkdown(render_module.Markdown):
        def __init__(self, markup: str, **kwargs) -> None:
            sources.append(markup)
            super().__init__(markup, **kwargs)

    monkeypatch.setattr(render_module, "Markdown", RecordedMarkdown)
    return sources


@pytest.mark.parametrize("kind", LONG_OPEN_BLOCKS)
def test_repainting_a_long_open_block_draws_about_a_screenful_of_it(kind, markdown_sources):
    con = Console(file=StringIO(), width=100, height=30, force_terminal=True, theme=CHAT_THEME)
    renderer = ReplyRenderer(con, markdown=True, refresh_interval_s=0)
    source = LONG_OPEN_BLOCKS[kind]
    step = len(source) // 20
    for i in range(0, len(source), step):
        renderer.handle(TextDelta(source[i : i + step]))
    repaints = markdown_sources[2:]  # once it is longer than a screen
    assert len(repaints) >= 18
    for drawn in repaints:
        assert drawn.startswith(LIVE_CONTEXT[kind])
        # 30 rows of 100 columns: a few screenfuls at most, where the whole is 20-190k
        assert len(drawn) <= 8_000 and drawn.count("\n") <= 160
    markdown_sources.clear()
    renderer.finish("stop")
    assert markdown_sources == [source.rstrip("\n")]  # the whole block, drawn once


def test_a_1000_line_code_block_streamed_token_by_token_leaves_each_line_once():
    # Its speed is the test above's (a screenful a repaint, counted): this one checks that
    # the tails repainted on the way leave nothing behind in scrollback.
    con = Console(file=StringIO(), width=100, height=30, force_terminal=True, color_system=None)
    renderer = ReplyRenderer(con, markdown=True, refresh_interval_s=0.01)
    lines = [f"value_{n} = compute({n}) * 2" for n in range(1000)]
    source = "```python\n" + "\n".join(lines) + "\n```\n"
    for i in range(0, len(source), 4):
        renderer.handle(TextDelta(source[i : i + 4]))
    renderer.finish("stop")
    screen = replay(con.file.getvalue(), height=30)
    assert [row.strip() for row in screen if row.strip()] == lines


# --- text that looks like HTML ------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "shown"),
    [
        ("In Rust, use Vec<String> for a list.", "In Rust, use Vec<String> for a list."),
        ("#include <iostream>", "#include <iostream>"),
        ("If a<b and c>d then swap.", "If a<b and c>d then swap."),
        ("<div>\nhello\n</div>", "<div> hello </div>"),
        ("Press <kbd>Ctrl</kbd> or \\<b>.", "Press <kbd>Ctrl</kbd> or <b>."),
    ],
)
def test_markdown_shows_text_that_looks_like_html_as_it_was_written(reply, shown):
    con, out = console(terminal=True)
    renderer = ReplyRenderer(con, markdown=True, refresh_interval_s=0)
    renderer.handle(TextDelta(reply))
    assert shown in " ".join(replay(out.getvalue(), height=25))  # the live view
    renderer.finish("stop")
    assert shown in " ".join(replay(out.getvalue(), height=25))  # the committed block


def test_angle_brackets_in_code_stay_as_they_are_without_backslashes():
    reply = (
        "Use `Vec<T>` here:\n\n"
        "```cpp\n#include <vector>\n```\n"
        "- in a list:\n\n      template <typename T>\n"
    )
    out = markdown_render([TextDelta(reply)])
    assert "Use Vec<T> here:" in out
    assert "#include <vector>" in out and "template <typename T>" in out
    assert "\\" not in out


# --- lists written over several blocks ---------------------------------------------------

LIST_REPLIES = [
    "- a\n\n  more a\n- b\n",
    "1. Step:\n\n   ```bash\n   ls -la\n   ```\n2. Next\n",
    "- a\n\n- b\n",
    "1. Install:\n\n   ```bash\n   pip install x\n   ```\n\n   Then run it.\n2. Done\n\nBye.\n",
    "- a\n  ```\n  x\n  ```\n- b\n",
    "- a\n\n   - deep\n\n  back\n\nAfter.\n",
    "- a\n\n* b\n",
    "1. a\n```\ncode\n```\n",
]


def drawn_whole(reply: str) -> list[str]:
    """What Rich draws for the whole reply at once (less the blank line before a list)."""
    con, out = console()
    con.print(Markdown(reply, hyperlinks=False))
    return lines_of(out.getvalue().lstrip("\n"))


@pytest.mark.parametrize("reply", LIST_REPLIES)
@pytest.mark.parametrize("chunk", [1, 5])
def test_a_streamed_list_is_drawn_as_the_whole_reply_would_be(reply, chunk):
    con, out = console()
    stream_markdown(con, reply, chunk=chunk)
    assert lines_of(out.getvalue()) == drawn_whole(reply)


@pytest.mark.parametrize("reply", LIST_REPLIES[:2])
def test_a_streamed_list_on_a_terminal_leaves_the_whole_reply_in_scrollback(reply):
    con, out = console(terminal=True, height=8)
    stream_markdown(con, reply, chunk=2)
    assert replay(out.getvalue(), height=8)[:-1] == drawn_whole(reply)


# --- the repaint interval -----------------------------------------------------------------


def wait_for(text: str, out: StringIO, seconds: float = 3) -> bool:
    deadline = time.monotonic() + seconds
    while text not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    return text in out.getvalue()


def test_text_held_back_by_the_repaint_interval_shows_without_waiting_for_more():
    con, out = console(terminal=True)
    renderer = ReplyRenderer(con, markdown=True, refresh_interval_s=0.5)
    renderer.handle(TextDelta("Hello"))  # painted: nothing was before
    renderer.handle(TextDelta(", world"))  # too soon after: held back
    assert "world" not in out.getvalue()
    assert wait_for("Hello, world", out)  # then painted, though no token came
    drawn = out.getvalue()
    time.sleep(0.7)
    assert out.getvalue() == drawn  # nothing changed, nothing repainted
    renderer.finish("stop")
    assert replay(out.getvalue(), height=25) == ["Hello, world", ""]


def test_a_finished_reply_is_not_repainted_by_a_late_timer(monkeypatch):
    fired = []
    trailing = ReplyRenderer._paint_trailing
    monkeypatch.setattr(
        ReplyRenderer, "_paint_trailing", lambda self: (fired.append(1), trailing(self))
    )
    con, out = console(terminal=True)
    renderer = ReplyRenderer(con, markdown=True, refresh_interval_s=0.1)
    renderer.handle(TextDelta("Hello"))
    renderer.handle(TextDelta(", world"))  # held back: a repaint is due in 0.1 s
    renderer.finish("stop")  # which finishing cancels
    drawn = out.getvalue()
    time.sleep(0.3)
    assert fired == [] and out.getvalue() == drawn
    assert replay(drawn, height=25) == ["Hello, world", ""]


# --- tables on a narrow terminal ----------------------------------------------------------

STATS_HEADERS = ("turn", "ttft", "prefill tok/s", "decode tok/s", "in", "out", "finish")
STATS_ROWS = [
    ("1", "0.12s", "2455", "120", "35", "20", "stop"),
    ("2", "0.09s", "3120", "118", "61", "48", "length"),
]


def test_a_narrow_terminal_folds_a_tables_text_but_never_a_number():
    con, out = console(terminal=True)
    con.width = 40
    render_table(con, STATS_HEADERS, STATS_ROWS)
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 40
    words = {word for line in lines for word in line.split()}
    assert {cell for row in STATS_ROWS for cell in row[:-1]} <= words
    assert {"turn", "ttft", "in", "out", "prefill", "tok/s", "stop"} <= words


def test_a_table_that_fits_keeps_its_natural_layout():
    con, out = console(terminal=True)
    render_table(con, STATS_HEADERS, STATS_ROWS)
    assert lines_of(out.getvalue())[0].split() == [
        "turn",
        "ttft",
        "prefill",
        "tok/s",
        "decode",
        "tok/s",
        "in",
        "out",
        "finish",
    ]


def test_a_status_line_leaves_out_what_was_not_measured():
    # Stopped during the prefill: no speeds of 0 that read as measurements.
    con, out = console()
    stats = {"ttft_s": 0.0, "prefill_tps": 0.0, "decode_tps": 0.0, "tokens_in": 12}
    render_status(con, {**stats, "tokens_out": 0, "finish_reason": "interrupted"})
    assert out.getvalue().strip() == "12 in / 0 out · interrupted"


# --- Ctrl-C while a finished block is drawn ----------------------------------------------


def _interrupting_print(con: Console, how: str) -> None:
    """Makes the console's first print of a finished block meet a Ctrl-C: raised in the
    middle of it ("raise"), or sent as a real SIGINT while it draws ("signal")."""
    original, met = con.print, []

    def print_(*args, **kwargs):
        finished_block = args and type(args[0]).__name__ == "_BlockView"
        if finished_block and not met:
            met.append(1)
            if how == "raise":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler would run here, mid-print, were it not held
        return original(*args, **kwargs)

    con.print = print_


@pytest.mark.parametrize("how", ["raise", "signal"])
def test_a_ctrl_c_while_a_finished_block_is_drawn_loses_none_of_it(how):
    con, out = console(terminal=True)
    renderer = ReplyRenderer(con, markdown=True, refresh_interval_s=0)
    renderer.handle(TextDelta("Intro line.\n\n"))
    _interrupting_print(con, how)
    code = "".join(f"line_{n} = {n}\n" for n in range(40))
    with pytest.raises(KeyboardInterrupt):
        renderer.handle(TextDelta(f"```python\n{code}```\n\nAfter"))
    renderer.finish("interrupted")
    rows = [row.strip() for row in replay(out.getvalue(), height=25) if row.strip()]
    assert rows.count("line_39 = 39") == rows.count("line_0 = 0") == 1
    assert rows[0] == "Intro line." and rows[-2:] == ["After", "[interrupted]"]


@pytest.mark.parametrize(
    ("reply", "shown"),
    [
        ("Solve 3*x + 2*y = 7.", "Solve 3*x + 2*y = 7."),
        ("Then a*b*c is 24.", "Then a*b*c is 24."),
        ("Define __init__ and __repr__ first.", "Define __init__ and __repr__ first."),
        ("Keep **bold** and *italic* as they are.", "Keep bold and italic as they are."),
    ],
)
def test_algebra_and_dunder_names_keep_their_marks_while_emphasis_still_works(reply, shown):
    assert shown in markdown_render([TextDelta(reply)])


def test_a_table_too_narrow_for_its_numbers_folds_every_column_alike():
    con, out = console(terminal=True)
    con.width = 24
    render_table(con, STATS_HEADERS, STATS_ROWS)
    assert max(map(len, out.getvalue().splitlines())) <= 24


def test_a_ctrl_c_while_finishing_still_takes_the_live_view_down():
    # `once`: a Ctrl-C while the last blocks are drawn must not leave the cursor hidden.
    con, out = console(terminal=True)
    renderer = ReplyRenderer(con, markdown=True, refresh_interval_s=0)
    renderer.handle(TextDelta("para one\n\npara two"))
    _interrupting_print(con, "signal")
    with pytest.raises(KeyboardInterrupt):
        renderer.finish("stop")
    drawn = out.getvalue()
    assert drawn.rfind("\x1b[?25h") > drawn.rfind("\x1b[?25l")  # the cursor shown again
    assert "para two" in " ".join(replay(drawn, height=25))


@pytest.mark.parametrize(
    ("width", "kept"),
    [
        (50, ["20261126-091901-8cd2", "2026-11-26 09:19"]),  # both whole
        (45, ["20261126-091901-8cd2", "2026-11-26", "09:19"]),  # the date wraps at its space
    ],
)
def test_a_narrow_history_table_keeps_ids_and_dates_whole(width, kept):
    # An id cut in two no longer pastes into /load; a date cut in two no longer reads.
    con, out = console(terminal=True)
    con.width = width
    rows = [("* 20261126-091901-8cd2", "2026-11-26 09:19", "6", "hi there, what is 2+2")]
    render_table(con, ("id", "modified", "messages", "preview"), rows)
    text = out.getvalue()
    assert all(piece in text for piece in kept)
    assert max(map(len, text.splitlines())) <= width
