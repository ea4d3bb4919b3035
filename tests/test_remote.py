"""RemoteSession against real servers on loopback: chatcli's own and a generic OpenAI one."""

from __future__ import annotations

import json
import socket
from io import StringIO

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="needs the serve extra: pip install -e '.[serve]'")

import httpx
from fakes import DONE, merged, tool_call, uniform_bytes
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from rich.console import Console
from serving import END, scripted_worker, serve_workers, text_tokens, wait_until
from typer.testing import CliRunner

from chatcli.chat.stream import TextDelta, ToolCallDelta, ToolCallStart, ToolResult
from chatcli.chat.turns import SamplingOptions
from chatcli.cli.app import app as cli_app
from chatcli.errors import ChatcliError
from chatcli.model.special_tokens import OUTPUT_START, PYTHON_START
from chatcli.serve import client as remote_module
from chatcli.serve.client import RemoteSession
from chatcli.serve.runner import BackgroundServer
from chatcli.terminal.render import render_status

CALC_THEN_TEXT = tool_call("6*7", [*text_tokens(" so 42."), END])


@pytest.fixture
def calc_server():
    worker = scripted_worker(CALC_THEN_TEXT)
    server = serve_workers([worker])
    yield server, worker
    server.stop()


def test_send_streams_text_and_calculator_events(calc_server):
    server, _ = calc_server
    session = RemoteSession(server.url, options=SamplingOptions(seed=7))
    events = merged(list(session.send("what is 6*7?")))
    assert events == [
        ToolCallStart(),
        ToolCallDelta("6*7"),
        ToolResult("6*7", "42"),
        TextDelta(" so 42."),
    ]
    reply_ = session.last_reply
    assert reply_.parts == [
        {"type": "python", "text": "6*7"},
        {"type": "python_output", "text": "42"},
        {"type": "text", "text": " so 42."},
    ]
    assert reply_.text == " so 42."
    stats = reply_.stats
    assert stats.finish_reason == "stop"
    assert stats.seed == 7
    # <|bos|> <|user_start|> 12 bytes <|user_end|> <|assistant_start|>
    assert stats.tokens_in == 16
    # the call (2 specials + 3 bytes), the forced output (2 specials + 2 bytes), 7 bytes and
    # <|assistant_end|>
    assert stats.tokens_out == 17
    assert stats.context_len == 256
    assert stats.context_used == 33
    assert stats.ttft_s > 0
    assert session.messages == [
        {"role": "user", "content": "what is 6*7?"},
        {"role": "assistant", "content": reply_.parts},
    ]
    assert session.history_stats == [stats]
    assert session.take_notices() == []


def test_the_next_turn_replays_the_calculator_call_to_the_model(calc_server):
    server, worker = calc_server
    session = RemoteSession(server.url)
    list(session.send("what is 6*7?"))
    list(session.send("and again?"))
    model = worker.engine.model
    prompt = model.histories[0][: model.prompt_len]
    tok = worker.tokenizer
    assert prompt == tok.render_for_completion(session.messages[:-1])
    assert tok.encode_special(PYTHON_START) in prompt
    assert tok.encode_special(OUTPUT_START) in prompt


def test_the_server_describes_its_model_and_context(calc_server):
    server, _ = calc_server
    session = RemoteSession(server.url + "/v1/")
    assert session.context_len == 256
    info = session.describe()
    assert session.model == "scripted"
    assert info == {"path": f"{server.url} · scripted", "device": "remote", "context_len": 256}


def test_system_prompt_undo_regenerate_and_clear(calc_server):
    server, worker = calc_server
    session = RemoteSession(server.url, system="Be brief.")
    list(session.send("one"))
    assert session.messages[0] == {"role": "system", "content": "Be brief."}
    assert session.pop_last_reply()["role"] == "assistant"
    events = merged(list(session.regenerate()))
    assert events[-1] == TextDelta(" so 42.")
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    model = worker.engine.model
    system_first = worker.tokenizer.encode("Be brief.\n\none")
    assert model.histories[0][2 : 2 + len(system_first)] == system_first
    assert session.undo() is True
    assert [m["role"] for m in session.messages] == ["system"]
    assert session.undo() is False
    session.set_system(None)
    session.load_messages(
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
    )
    assert session.system == "s" and len(session.messages) == 3
    session.clear()
    assert session.messages == [{"role": "system", "content": "s"}]
    with pytest.raises(ChatcliError, match="no user message"):
        session.regenerate()


def test_closing_the_iterator_closes_the_stream_and_keeps_the_partial_reply():
    worker = scripted_worker(uniform_bytes, delay=0.02, sequence_len=8192)
    server = serve_workers([worker])
    try:
        session = RemoteSession(server.url, options=SamplingOptions(max_tokens=4096))
        events = session.send("go on forever")
        first = next(e for e in events if isinstance(e, TextDelta))
        events.close()
        assert wait_until(lambda: not worker.busy, timeout=5)
        assert len(worker.engine.model.calls) < 200
    finally:
        server.stop()
    reply_ = session.last_reply
    assert reply_.stats.finish_reason == "interrupted"
    assert reply_.text.startswith(first.text)
    assert session.messages[-1] == {"role": "assistant", "content": reply_.parts}


def test_an_unreachable_server_is_a_fix_it_error_and_the_question_is_taken_back():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    session = RemoteSession(f"http://127.0.0.1:{port}", model="m")
    with pytest.raises(
        ChatcliError, match=rf"Cannot reach http://127.0.0.1:{port}: is `chatcli serve` running\?"
    ):
        list(session.send("hello?"))
    assert session.messages == []
    assert session.context_len == 0  # unknown, not an error


def test_a_refused_request_says_why_and_the_question_is_taken_back(calc_server):
    server, _ = calc_server
    session = RemoteSession(server.url, options=SamplingOptions(temperature=5.0))
    with pytest.raises(ChatcliError, match=r"refused the request \(400\): Invalid 'temperature'"):
        list(session.send("hot?"))
    assert session.messages == []


def test_notices_say_tools_are_server_side_and_warn_of_a_full_context(calc_server):
    server, _ = calc_server
    session = RemoteSession(server.url, options=SamplingOptions(tools=False))
    list(session.send("one"))
    (notice,) = session.take_notices()
    assert "runs the calculator itself" in notice.text
    session.clear()
    list(session.send("x" * 200))  # with the prompt's and the reply's tokens: 221 of 256
    # Said after the reply, as a local session says it, not at the next message.
    (notice,) = session.take_notices()
    assert notice.text.startswith("Context 221/256 tokens: the next turns leave the oldest")
    session.clear()  # a new conversation: the old one's use says nothing of it
    list(session.send("three"))
    assert session.take_notices() == []


def test_a_call_cut_by_max_tokens_is_cut_not_failed():
    # 4 tokens: <|python_start|> 1 2 3. A local session calls this "cut" (/continue finishes
    # it); the server's marker "[calc 123]" alone would read as a refused call.
    server = serve_workers([scripted_worker(tool_call("1234*56", DONE))])
    try:
        session = RemoteSession(server.url, options=SamplingOptions(max_tokens=4))
        events = list(session.send("What is 1234*56?"))
    finally:
        server.stop()
    (call,) = [e for e in events if isinstance(e, ToolResult)]
    assert call == ToolResult("123", None, cut=True)
    assert call.status == "cut"
    assert session.last_reply.stats.finish_reason == "length"
    assert session.last_reply.parts == [{"type": "python", "text": "123"}]


def test_once_json_over_a_server_reports_each_calls_status(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path))
    for name in ("CHATCLI_MODEL", "CHATCLI_CONFIG", "CHATCLI_URL", "CHATCLI_TEMPERATURE"):
        monkeypatch.delenv(name, raising=False)
    runner = CliRunner()
    server = serve_workers([scripted_worker(tool_call("1234*56", DONE))])
    try:
        base = ["once", "What is 1234*56?", "--url", server.url, "--json"]
        cut = runner.invoke(cli_app, [*base, "--max-tokens", "4"])
        whole = runner.invoke(cli_app, base)
    finally:
        server.stop()
    assert cut.exit_code == 0, cut.output
    assert json.loads(cut.output)["tools"] == [
        {"expression": "123", "output": None, "status": "cut"}
    ]
    assert whole.exit_code == 0, whole.output
    assert json.loads(whole.output)["tools"] == [
        {"expression": "1234*56", "output": "69104", "status": "ok"}
    ]


def test_several_samples_are_not_supported(calc_server):
    server, _ = calc_server
    session = RemoteSession(server.url)
    with pytest.raises(ChatcliError, match="not supported against a server"):
        session.sample_replies("x", 3)
    with pytest.raises(ChatcliError, match="not supported against a server"):
        session.continue_reply()


# ---- a generic OpenAI-compatible server: no chatcli_tool field, usage in its own chunk ----------


def generic_app(
    pieces: list[str | dict], finish: str = "stop", error: str | None = None
) -> FastAPI:
    """Streams `pieces` as content deltas the way vLLM does (usage after, with no choices); a
    dict piece is sent as the whole delta."""
    app = FastAPI()
    app.state.requests = []

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "generic-7b", "max_model_len": 4096}]}

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> StreamingResponse:
        app.state.requests.append(await request.json())

        def chunk(delta: dict, finish_reason: str | None = None) -> str:
            body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
            return f"data: {json.dumps(body)}\n\n"

        async def body():
            yield ": keep-alive comment\n\n"
            yield chunk({"role": "assistant"})
            for piece in pieces:
                yield chunk(piece if isinstance(piece, dict) else {"content": piece})
            if error:
                yield f"data: {json.dumps({'error': {'message': error}})}\n\n"
                return
            yield chunk({}, finish)
            usage = {"prompt_tokens": 11, "completion_tokens": 9, "total_tokens": 20}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def test_markers_from_a_generic_server_become_tool_events():
    app = generic_app(["It is [ca", "lc 6*7 = ", "42] so", " 42. [calc 2**10]"], finish="length")
    with BackgroundServer(app) as server:
        session = RemoteSession(server.url, api_key="sk-test", options=SamplingOptions(top_k=0))
        events = list(session.send("6*7?"))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == "It is  so 42. "
    assert [e for e in events if isinstance(e, ToolResult)] == [
        ToolResult("6*7", "42"),
        ToolResult("2**10", None),
    ]
    reply_ = session.last_reply
    assert reply_.parts == [
        {"type": "text", "text": "It is "},
        {"type": "python", "text": "6*7"},
        {"type": "python_output", "text": "42"},
        {"type": "text", "text": " so 42. "},
        {"type": "python", "text": "2**10"},
    ]
    assert (reply_.stats.tokens_in, reply_.stats.tokens_out) == (11, 9)
    assert reply_.stats.finish_reason == "length"
    assert reply_.stats.context_len == 4096
    (request,) = app.state.requests
    assert request["model"] == "generic-7b"  # discovered from /v1/models
    assert request["stream"] is True
    assert request["stream_options"] == {"include_usage": True}
    assert request["top_k"] == 0  # off, said explicitly
    assert request["messages"] == [{"role": "user", "content": "6*7?"}]


def test_a_mid_stream_error_raises_and_keeps_the_partial_reply():
    app = generic_app(["partial "], error="out of memory")
    with BackgroundServer(app) as server:
        session = RemoteSession(server.url, model="generic-7b")
        seen = []
        with pytest.raises(ChatcliError, match="failed mid-reply: out of memory"):
            for event in session.send("hi"):
                seen.append(event)
    assert seen == [TextDelta("partial ")]
    assert session.last_reply.stats.finish_reason == "error"
    assert session.last_reply.text == "partial "


def test_a_stream_that_ends_without_a_finish_reason_is_an_error():
    app = generic_app(["cut"], error=None, finish="")
    with BackgroundServer(app) as server:
        session = RemoteSession(server.url, model="generic-7b")
        with pytest.raises(ChatcliError, match="ended the stream before the reply was finished"):
            list(session.send("hi"))
    assert session.last_reply.stats.finish_reason == "error"


def test_a_chatcli_tool_without_status_reads_as_before():
    # A chatcli server from before the status field: output null is a failure, as it was.
    pieces = [
        {"content": "[calc 6*7 = 42]", "chatcli_tool": {"expression": "6*7", "output": "42"}},
        {"content": "[calc 1/0]", "chatcli_tool": {"expression": "1/0", "output": None}},
        {
            "content": "[calc 9*9]",
            "chatcli_tool": {"expression": "9*9", "output": None, "status": "cut"},
        },
    ]
    with BackgroundServer(generic_app(pieces, finish="length")) as server:
        session = RemoteSession(server.url, model="generic-7b")
        calls = [e for e in session.send("go") if isinstance(e, ToolResult)]
    assert calls == [
        ToolResult("6*7", "42"),
        ToolResult("1/0", None),
        ToolResult("9*9", None, cut=True),
    ]
    assert [c.status for c in calls] == ["ok", "failed", "cut"]


def test_a_reply_that_opens_with_a_calculator_call_is_timed_from_its_first_token():
    # 50 ms a forward: the call's chunk reaches the client only once the call is over
    # (~10 tokens in), so timing the first chunk would read ~0.5 s to the first token and
    # a decode twice as fast as the server's.
    worker = scripted_worker(tool_call("6*7", [*text_tokens(" so 42."), END]), delay=0.05)
    server = serve_workers([worker])
    try:
        session = RemoteSession(server.url, options=SamplingOptions(temperature=0.0))
        events = list(session.send("6*7?"))
    finally:
        server.stop()
    assert any(isinstance(e, ToolResult) for e in events)
    stats = session.last_reply.stats
    assert stats.tokens_out > 10
    assert stats.ttft_s < 0.3  # the prefill's forward, not the call's ten
    assert 10 < stats.decode_tps < 25  # one token a 50 ms forward


def test_a_server_that_says_no_context_and_answers_errors_as_plain_strings():
    # ollama's and llama.cpp's error bodies are {"error": "..."}; this one names no context.
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "plain"}]}

    @app.post("/v1/chat/completions")
    async def completions() -> JSONResponse:
        return JSONResponse({"error": "model 'plain' not found, try pulling it first"}, 404)

    with BackgroundServer(app) as server:
        session = RemoteSession(server.url)
        assert session.context_len == 0
        with pytest.raises(ChatcliError, match="model 'plain' not found, try pulling it first"):
            list(session.send("hi"))
    console = Console(file=StringIO(), width=200, color_system=None)
    render_status(console, {"tokens_in": 5, "tokens_out": 2, "context_used": 7, "context_len": 0})
    assert console.file.getvalue() == "5 in / 2 out\n"  # no "ctx 7/0"


def test_a_server_that_is_no_api_is_named_by_its_status_not_its_html_page():
    # `python3 -m http.server`: an HTML page for a 404 (GET) and a 501 (POST).
    page = "<!DOCTYPE HTML>\n<html>\n<head><title>Error response</title></head>\n</html>\n"

    def http_server(request: httpx.Request) -> httpx.Response:
        status = 404 if request.method == "GET" else 501
        return httpx.Response(status, text=page, headers={"Content-Type": "text/html"})

    transport = httpx.MockTransport(http_server)
    session = RemoteSession("http://127.0.0.1:9", transport=transport)
    with pytest.raises(ChatcliError) as info:
        session.describe()
    assert str(info.value) == (
        "http://127.0.0.1:9 has no OpenAI-compatible API at /v1/models (404 Not Found). "
        "Point --url at the server's root."
    )
    session = RemoteSession("http://127.0.0.1:9", model="m", known_context=0, transport=transport)
    with pytest.raises(ChatcliError) as info:
        list(session.send("hi"))
    assert str(info.value) == "The server refused the request: 501 Not Implemented."


def test_a_chat_whose_every_message_is_refused_leaves_no_conversation_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path))
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "strict", "context_length": 64}]}

    @app.post("/v1/chat/completions")
    async def completions() -> JSONResponse:
        return JSONResponse({"error": {"message": "no", "type": "invalid_request_error"}}, 400)

    with BackgroundServer(app) as server:
        result = CliRunner().invoke(cli_app, ["chat", "--url", server.url], input="hi\nhello\n")
    # Piped: each refusal is one line on stderr, and a script is told by the exit code.
    assert result.exit_code == 1, result.output
    assert result.stderr.count("Error: The server refused the request (400): no\n") == 2
    folder = tmp_path / "conversations"
    assert not folder.exists() or not list(folder.iterdir())


def flaky_app(refuse: set[int]) -> FastAPI:
    """A generic server that answers "ok" (finish stop), refusing the requests whose number
    (from 0) is in `refuse` with a 503."""
    app = FastAPI()
    app.state.count = 0

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "flaky", "context_length": 256}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def completions() -> StreamingResponse | JSONResponse:
        n, app.state.count = app.state.count, app.state.count + 1
        if n in refuse:
            return JSONResponse({"error": {"message": "busy"}}, 503)

        async def body():
            delta = {"choices": [{"index": 0, "delta": {"content": f"ok{n}"}}]}
            yield f"data: {json.dumps(delta)}\n\n"
            end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            yield f"data: {json.dumps(end)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def test_a_retry_the_server_refuses_keeps_the_reply_it_would_have_replaced():
    with BackgroundServer(flaky_app(refuse={1})) as server:
        session = RemoteSession(server.url)
        list(session.send("hi"))
        before = session.messages
        session.pop_last_reply()
        with pytest.raises(ChatcliError, match="busy"):
            list(session.regenerate())
        assert session.messages == before
        assert session.transcript == (before, [None, "stop"])
        session.pop_last_reply()
        list(session.regenerate())  # the next one is answered, and replaces it
        assert session.messages[-1]["content"] == [{"type": "text", "text": "ok2"}]


def test_ctrl_c_before_the_server_answers_keeps_the_question_as_a_local_model_does():
    def interrupted(request: httpx.Request) -> httpx.Response:
        raise KeyboardInterrupt  # Ctrl-C while the request waits for the server

    transport = httpx.MockTransport(interrupted)
    session = RemoteSession("http://127.0.0.1:9", model="m", known_context=256, transport=transport)
    with pytest.raises(KeyboardInterrupt):
        list(session.send("hi"))
    assert session.messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": []},
    ]
    assert session.transcript[1] == [None, "interrupted"]


def test_a_conversation_past_the_servers_context_drops_its_oldest_exchanges():
    # The server keeps nothing between turns: each request carries the whole conversation,
    # and one past its 64-token context is a 400 (context_length_exceeded). The session
    # drops the oldest exchange and asks again, as a local session makes room.
    sentence = [*text_tokens(" ok."), END]
    server = serve_workers([scripted_worker(lambda h: sentence[min(len(h), 4)], sequence_len=64)])
    try:
        session = RemoteSession(server.url, system="Be brief.")
        for question in ("question one", "question two", "question 333"):
            events = merged(list(session.send(question)))
            assert events == [TextDelta(" ok.")]
        notices = [n.text for n in session.take_notices()]
        assert "Context full: dropped the 1 oldest exchange (the system prompt is kept)." in notices
        sent = [m["content"] for m in session.messages if m["role"] == "user"]
        assert sent == ["question two", "question 333"]
        assert session.messages[0] == {"role": "system", "content": "Be brief."}
        # Still the conversation's: /save and /export write every exchange.
        messages, finishes = session.transcript
        assert [m["content"] for m in messages if m["role"] == "user"] == [
            "question one",
            "question two",
            "question 333",
        ]
        assert len(finishes) == len(messages) and finishes[-1] == "stop"
        # A message that cannot fit even alone is still the server's to refuse, and the
        # exchanges dropped while trying come back: the conversation is as it was.
        before = session.messages, session.transcript
        with pytest.raises(ChatcliError, match="context"):
            list(session.send("x" * 80))
        assert (session.messages, session.transcript) == before
        assert not any("dropped" in n.text for n in session.take_notices())
    finally:
        server.stop()


@pytest.mark.parametrize(
    "error",
    [
        {"message": "too long", "code": "context_length_exceeded"},  # chatcli's, OpenAI's
        {"message": "too long", "type": "exceed_context_size_error", "code": 400},  # llama.cpp
        {  # vLLM: an int code, the reason in the message
            "message": "This model's maximum context length is 4096 tokens. However, you "
            "requested 5000 tokens.",
            "code": 400,
        },
    ],
)
def test_each_servers_way_of_saying_the_context_is_full_is_read(error):
    response = httpx.Response(400, json={"error": error})
    assert remote_module.is_context_full(response)
    assert not remote_module.is_context_full(
        httpx.Response(400, json={"error": {"message": "bad"}})
    )
