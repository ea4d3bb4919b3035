"""What the screen says: a calculator badge set apart (a space after it, a style with and
without colour), speeds on the status line only where they mean something, "the system prompt
is kept" only where there is one, and a resumed chat dropping what the live one dropped."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from fakes import SPECIAL_IDS, ByteTokenizer, ScriptedModel, reply
from rich.console import Console

from chatcli.chat.session import ChatSession
from chatcli.chat.stream import TextDelta, ToolCallDelta, ToolCallStart, ToolResult
from chatcli.chat.turns import SamplingOptions
from chatcli.model.special_tokens import ASSISTANT_END
from chatcli.terminal.render import (
    CHAT_THEME,
    MIN_RATE_S,
    MIN_RATE_TOKENS,
    ReplyRenderer,
    make_console,
    render_status,
    use_markdown,
)
from chatcli.terminal.render_panels import render_recap, reply_text

# ---- the calculator badge -----------------------------------------------------------------------


def plain_console() -> tuple[Console, StringIO]:
    out = StringIO()
    return Console(file=out, width=100, color_system=None, theme=CHAT_THEME), out


def shown(after: str, markdown: bool = False) -> str:
    """A reply of a calculator call, then `after`, as the renderer draws it."""
    con, out = plain_console()
    renderer = ReplyRenderer(con, markdown=markdown)
    for event in (ToolCallStart(), ToolCallDelta("6*7"), ToolResult("6*7", "42")):
        renderer.handle(event)
    for piece in (after[:2], after[2:]):  # split across deltas, as tokens come
        renderer.handle(TextDelta(piece))
    renderer.finish("stop")
    return out.getvalue().rstrip("\n").strip()


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        ("The answer is 42.", "[calc 6*7 = 42] The answer is 42."),
        ("42 it is.", "[calc 6*7 = 42] 42 it is."),
        ('"42"', '[calc 6*7 = 42] "42"'),
        ("(so 42)", "[calc 6*7 = 42] (so 42)"),
        (" already spaced", "[calc 6*7 = 42] already spaced"),
        (".", "[calc 6*7 = 42]."),
        (", so 42", "[calc 6*7 = 42], so 42"),
        ("! yes", "[calc 6*7 = 42]! yes"),
        (")", "[calc 6*7 = 42])"),
    ],
)
def test_text_after_a_badge_is_spaced_from_it_but_closing_punctuation_is_not(after, expected):
    assert shown(after) == expected
    assert shown(after, markdown=True) == expected


def test_the_space_comes_once_and_only_right_after_the_badge():
    con, out = plain_console()
    renderer = ReplyRenderer(con, markdown=False)
    renderer.handle(TextDelta("It is"))
    renderer.handle(ToolResult("6*7", "42"))
    renderer.handle(TextDelta(""))  # an empty delta decides nothing
    renderer.handle(TextDelta("so"))
    renderer.handle(TextDelta("on"))
    renderer.handle(ToolResult("1/0", None))
    renderer.handle(TextDelta("x"))
    renderer.finish("stop")
    assert out.getvalue() == "It is[calc 6*7 = 42] soon[calc 1/0 failed] x\n"


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        (
            [
                {"type": "python", "text": "6*7"},
                {"type": "python_output", "text": "42"},
                {"type": "text", "text": "So 42."},
            ],
            "[calc 6*7 = 42] So 42.",
        ),
        (
            [
                {"type": "python", "text": "6*7"},
                {"type": "python_output", "text": "42"},
                {"type": "text", "text": "."},
            ],
            "[calc 6*7 = 42].",
        ),
        (
            [{"type": "python", "text": "1/0"}, {"type": "text", "text": "no"}],
            "[calc 1/0 failed] no",
        ),
    ],
)
def test_finished_replies_space_their_badges_alike(parts, expected):
    assert reply_text(parts).plain == expected
    con, out = plain_console()
    render_recap(con, [{"role": "user", "content": "q"}, {"role": "assistant", "content": parts}])
    assert out.getvalue().splitlines()[-1] == expected


def terminal_console(monkeypatch, no_color: bool) -> tuple[Console, StringIO]:
    monkeypatch.setenv("FORCE_COLOR", "1")  # Rich: a terminal, whatever the file
    monkeypatch.setenv("TERM", "xterm-256color")
    if no_color:
        monkeypatch.setenv("NO_COLOR", "1")
    else:
        monkeypatch.delenv("NO_COLOR", raising=False)
    out = StringIO()
    return make_console(file=out), out


def test_with_colour_the_badge_is_dim_with_its_expression_and_result_coloured(monkeypatch):
    con, out = terminal_console(monkeypatch, no_color=False)
    renderer = ReplyRenderer(con, markdown=False)
    renderer.handle(ToolResult("6*7", "42"))
    renderer.handle(TextDelta("So 42."))
    renderer.finish("stop")
    text = out.getvalue()
    assert "\x1b[2m[calc \x1b[0m" in text  # dim
    assert re.search(r"\x1b\[2;3\dm6\*7", text)  # and a colour
    assert re.sub(r"\x1b\[[\d;]*m", "", text) == "[calc 6*7 = 42] So 42.\n"


def test_without_colour_the_badge_is_still_dim_and_nothing_is_coloured(monkeypatch):
    con, out = terminal_console(monkeypatch, no_color=True)
    renderer = ReplyRenderer(con, markdown=False)
    renderer.handle(ToolResult("6*7", "42"))
    renderer.handle(TextDelta("So 42."))
    renderer.finish("stop")
    text = out.getvalue()
    assert "\x1b[2m[calc \x1b[0m" in text
    assert not re.search(r"\x1b\[[\d;]*3\dm", text)  # no foreground colour at all
    assert re.sub(r"\x1b\[[\d;]*m", "", text) == "[calc 6*7 = 42] So 42.\n"
    # NO_COLOR is plain text still: no Markdown drawn unless asked for.
    assert use_markdown(con, "auto") is False


# ---- speeds on the status line ------------------------------------------------------------------


def status(**stats) -> str:
    con, out = plain_console()
    render_status(con, {"tokens_in": 40, "finish_reason": "stop", **stats})
    return out.getvalue().strip()


@pytest.mark.parametrize(
    ("tokens_out", "decode_tps", "shown_as"),
    [
        (3, 2146.0, None),  # 2 steps: any speed at all
        (16, 500.0, None),  # 15 steps: fewer than MIN_RATE_TOKENS
        (17, 1000.0, None),  # 16 steps in 16 ms: too short a time
        (200, 5000.0, None),  # 199 steps in 40 ms: still too short
        (17, 100.0, "decode 100 tok/s"),  # 16 steps in 160 ms
        (101, 1000.0, "decode 1000 tok/s"),  # 100 steps in 100 ms: just enough
        (400, 35.0, "decode 35 tok/s"),
    ],
)
def test_a_decode_speed_is_shown_only_over_enough_tokens_and_time(tokens_out, decode_tps, shown_as):
    line = status(tokens_out=tokens_out, decode_tps=decode_tps)
    assert f"40 in / {tokens_out} out" in line
    if shown_as is None:
        assert "decode" not in line
    else:
        assert shown_as in line


@pytest.mark.parametrize(
    ("prefill_tokens", "prefill_tps", "shown_as"),
    [
        (0, 3000.0, None),  # all from the warm cache: nothing was prefilled
        (5, 900.0, None),  # a few tokens: a latency, not a speed
        (400, 8000.0, None),  # 50 ms
        (400, 2000.0, "prefill 2000 tok/s"),  # 200 ms
        (16, 100.0, "prefill 100 tok/s"),
    ],
)
def test_a_prefill_speed_counts_only_tokens_actually_prefilled(
    prefill_tokens, prefill_tps, shown_as
):
    line = status(tokens_out=2, prefill_tokens=prefill_tokens, prefill_tps=prefill_tps)
    if shown_as is None:
        assert "prefill" not in line
    else:
        assert shown_as in line


def test_the_thresholds_are_the_documented_ones():
    assert (MIN_RATE_TOKENS, MIN_RATE_S) == (16, 0.1)


def test_a_server_session_counts_the_tokens_its_server_took_from_cache_as_not_prefilled():
    pytest.importorskip("fastapi")
    import json

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from chatcli.serve.client import RemoteSession
    from chatcli.serve.runner import BackgroundServer

    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "m", "context_length": 4096}]}

    @app.post("/v1/chat/completions")
    async def completions() -> StreamingResponse:
        async def body():
            delta = {"choices": [{"index": 0, "delta": {"content": "ok"}}]}
            yield f"data: {json.dumps(delta)}\n\n"
            usage = {
                "prompt_tokens": 300,
                "completion_tokens": 2,
                "total_tokens": 302,
                "prompt_tokens_details": {"cached_tokens": 280},
                "chatcli_decode_s": 1e-6,  # the wait is nearly all ttft
            }
            end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}
            yield f"data: {json.dumps(end)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    with BackgroundServer(app) as server:
        session = RemoteSession(server.url)
        list(session.send("hi"))
    stats = session.last_reply.stats
    assert (stats.tokens_in, stats.prefill_tokens) == (300, 20)
    assert stats.prefill_tps == pytest.approx(20 / stats.ttft_s)


# ---- dropping old exchanges -----------------------------------------------------------------------


FAKE_END = SPECIAL_IDS[ASSISTANT_END]


def byte_session(sequence_len: int, system: str | None, max_tokens: int = 8) -> ChatSession:
    model = ScriptedModel(reply([*b" fine.", FAKE_END]), sequence_len=sequence_len)
    options = SamplingOptions(temperature=0.0, top_k=None, max_tokens=max_tokens)
    return ChatSession(model, ByteTokenizer(), options, system=system)


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_the_system_prompt_is_said_to_be_kept_only_when_there_is_one(system):
    session = byte_session(128, system)
    notices = []
    for i in range(8):
        list(session.send(f"question number {i}"))
        notices += [n.text for n in session.take_notices()]
    dropped = [n for n in notices if n.startswith("Context full")]
    assert dropped
    for notice in dropped:
        assert ("system prompt" in notice) == (system is not None), notice


def test_a_server_session_names_the_system_prompt_only_when_there_is_one():
    pytest.importorskip("fastapi")
    from serving import END, scripted_worker, serve_workers, text_tokens

    from chatcli.serve.client import RemoteSession

    sentence = [*text_tokens(" ok."), END]
    server = serve_workers([scripted_worker(lambda h: sentence[min(len(h), 4)], sequence_len=64)])
    try:
        for system in (None, "Be brief."):
            session = RemoteSession(server.url, system=system)
            for question in ("question one", "question two", "question 333", "question 4444"):
                list(session.send(question))
            notices = [n.text for n in session.take_notices() if n.text.startswith("Context full")]
            assert notices
            assert all(("system prompt" in n) == (system is not None) for n in notices)
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("sequence_len", "system", "turns"),
    [(128, None, 9), (128, "Be brief.", 9), (160, "A longer system prompt.", 14), (256, None, 20)],
)
def test_a_resumed_chat_drops_the_exchanges_the_live_one_dropped(sequence_len, system, turns):
    live = byte_session(sequence_len, system)
    for i in range(turns):
        list(live.send(f"question {i} " + "q" * (i % 4)))
    assert live.earlier, "the chat should have outgrown its context"
    resumed = byte_session(sequence_len, system)
    messages, finishes = live.transcript
    resumed.load_messages(messages, finishes)
    assert resumed.messages == live.messages  # the same exchanges in the model's view
    assert resumed.prompt_tokens() == live.prompt_tokens()
    out = sum(1 for e in live.earlier if e.message["role"] == "user")
    kept = " (the system prompt is kept)" if system else ""
    plural = "s" if out > 1 else ""
    assert [n.text for n in resumed.take_notices()] == [
        f"Context full: dropped the {out} oldest exchange{plural}{kept}."
    ]
    # The next turn goes on alike, drops and all.
    list(live.send("and then?"))
    list(resumed.send("and then?"))
    assert resumed.prompt_tokens() == live.prompt_tokens()
    assert resumed.transcript[0] == live.transcript[0]


def test_a_resumed_chat_that_fits_drops_nothing_and_says_nothing():
    live = byte_session(512, "S")
    for i in range(3):
        list(live.send(f"question {i}"))
    resumed = byte_session(512, "S")
    resumed.load_messages(*live.transcript)
    assert resumed.messages == live.messages and not resumed.earlier
    assert resumed.take_notices() == []
