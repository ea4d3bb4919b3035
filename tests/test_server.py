"""The HTTP server, end to end: a real uvicorn on a loopback port, scripted or tiny real models."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="needs the serve extra: pip install -e '.[serve]'")

import httpx
from fakes import DONE, reply, tool_call, uniform_bytes
from serving import (
    END,
    REFERENCE_E,
    reference_worker,
    scripted_worker,
    serve_workers,
    text_tokens,
    wait_until,
)

from chatcli.cli.app import app as cli_app
from chatcli.errors import ChatcliError, ConfigError
from chatcli.model.special_tokens import OUTPUT_END, OUTPUT_START, PYTHON_END, PYTHON_START
from chatcli.serve.app import Limits, create_app
from chatcli.serve.guards import LOOPBACK_HOSTNAMES
from chatcli.serve.runner import BackgroundServer, listen, worker_devices

HI = {"messages": [{"role": "user", "content": "hi"}]}
JSON = {"Content-Type": "application/json"}
# <|bos|> <|user_start|> h i <|user_end|> <|assistant_start|>
HI_PROMPT_TOKENS = 6


def post(server: BackgroundServer, body: object, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30, **kwargs)


def stream_body(server: BackgroundServer, body: dict) -> str:
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return response.read().decode("utf-8")


def chunks_of(body: str) -> list[dict]:
    """Check the SSE framing exactly and return the JSON chunks (without [DONE])."""
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")
    assert events[-1] == ""
    events = events[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def content_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def counts(usage: dict) -> dict:
    """usage without how many prompt tokens the worker had cached (the module's worker is
    shared by its tests, so that depends on the request before) and the decode's time,
    each checked for its range."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 <= cached < usage["prompt_tokens"]
    assert 0 <= usage["chatcli_decode_s"] < 60
    return {
        k: v for k, v in usage.items() if k not in ("prompt_tokens_details", "chatcli_decode_s")
    }


@pytest.fixture(scope="module")
def hello():
    """One worker that answers "Hello!" to anything."""
    worker = scripted_worker(reply([*text_tokens("Hello!"), END]))
    server = serve_workers([worker])
    yield server, worker
    server.stop()


# ---- replies ------------------------------------------------------------------------------------


def test_non_streaming_reply_is_a_chat_completion(hello):
    server, _ = hello
    response = post(server, {**HI, "model": "anything", "seed": 1})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == "scripted"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}
    ]
    # 6 letters and the closing <|assistant_end|>
    assert counts(body["usage"]) == {
        "prompt_tokens": HI_PROMPT_TOKENS,
        "completion_tokens": 7,
        "total_tokens": HI_PROMPT_TOKENS + 7,
    }


def test_streaming_reply_is_sse_chunks_then_usage_then_done(hello):
    server, _ = hello
    chunks = chunks_of(stream_body(server, HI))
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert content_of(chunks) == "Hello!"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert counts(last["usage"]) == {
        "prompt_tokens": HI_PROMPT_TOKENS,
        "completion_tokens": 7,
        "total_tokens": HI_PROMPT_TOKENS + 7,
    }
    assert all("usage" not in c for c in chunks[:-1])


def test_max_tokens_cuts_the_reply_with_finish_reason_length(hello):
    server, _ = hello
    body = post(server, {**HI, "max_tokens": 3}).json()
    assert body["choices"][0]["message"]["content"] == "Hel"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def test_stream_never_splits_a_utf8_character():
    text = "é✓😀 ok"  # 2-, 3- and 4-byte characters, one byte per token
    server = serve_workers([scripted_worker(reply([*text_tokens(text), END]))])
    try:
        chunks = chunks_of(stream_body(server, HI))
    finally:
        server.stop()
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_calculator_call_streams_as_marker_and_chatcli_tool_field():
    worker = scripted_worker(tool_call("6*7", [*text_tokens(" so 42."), END]))
    server = serve_workers([worker])
    try:
        chunks = chunks_of(stream_body(server, HI))
        whole = post(server, HI).json()
    finally:
        server.stop()
    tool_deltas = [
        c["choices"][0]["delta"] for c in chunks if "chatcli_tool" in c["choices"][0]["delta"]
    ]
    answered = {"expression": "6*7", "output": "42", "status": "ok"}
    assert tool_deltas == [{"content": "[calc 6*7 = 42]", "chatcli_tool": answered}]
    assert content_of(chunks) == "[calc 6*7 = 42] so 42."
    message = whole["choices"][0]["message"]
    assert message["content"] == "[calc 6*7 = 42] so 42."
    assert message["chatcli_tools"] == [answered]


def test_a_call_the_calculator_refuses_has_null_output():
    server = serve_workers([scripted_worker(tool_call("2**10", DONE))])
    try:
        chunks = chunks_of(stream_body(server, HI))
    finally:
        server.stop()
    tools = [c["choices"][0]["delta"].get("chatcli_tool") for c in chunks]
    assert [t for t in tools if t] == [{"expression": "2**10", "output": None, "status": "failed"}]
    assert content_of(chunks) == "[calc 2**10] done"


def test_a_call_cut_by_max_tokens_says_cut_not_failed():
    # 4 tokens: <|python_start|> 1 2 3, so the stream ends inside the expression. The marker
    # cannot tell this from a refused call; the status can.
    server = serve_workers([scripted_worker(tool_call("1234*56", DONE))])
    try:
        chunks = chunks_of(stream_body(server, {**HI, "max_tokens": 4}))
        whole = post(server, {**HI, "max_tokens": 4}).json()
    finally:
        server.stop()
    cut = {"expression": "123", "output": None, "status": "cut"}
    tools = [c["choices"][0]["delta"].get("chatcli_tool") for c in chunks]
    assert [t for t in tools if t] == [cut]
    assert content_of(chunks) == "[calc 123]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["message"]["chatcli_tools"] == [cut]
    assert whole["choices"][0]["finish_reason"] == "length"


def test_assistant_markers_from_the_client_replay_as_calculator_calls(hello):
    server, worker = hello
    tok = worker.tokenizer
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "6 times 7?"},
        {"role": "assistant", "content": "[calc 6*7 = 42] It is 42."},
        {"role": "user", "content": "thanks"},
    ]
    assert post(server, {"messages": conversation}).status_code == 200
    model = worker.engine.model
    prompt = model.histories[0][: model.prompt_len]
    expected = tok.render_for_completion(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "6 times 7?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "python", "text": "6*7"},
                    {"type": "python_output", "text": "42"},
                    {"type": "text", "text": " It is 42."},
                ],
            },
            {"role": "user", "content": "thanks"},
        ]
    )
    assert prompt == expected
    specials = [tok.encode_special(n) for n in (PYTHON_START, PYTHON_END, OUTPUT_START, OUTPUT_END)]
    assert all(s in prompt for s in specials)


def test_content_may_be_a_list_of_text_parts(hello):
    server, _ = hello
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    response = post(server, body)
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == HI_PROMPT_TOKENS


def test_a_failing_worker_reports_in_band_and_is_freed():
    def broken(generated: list[int]) -> int:
        if len(generated) >= 2:
            raise RuntimeError("kaboom")
        return text_tokens("ab")[len(generated)]

    worker = scripted_worker(broken)
    server = serve_workers([worker])
    try:
        body = stream_body(server, HI)
        assert wait_until(lambda: not worker.busy)
        second = post(server, HI)
    finally:
        server.stop()
    chunks = chunks_of(body)
    assert chunks[-1]["error"]["type"] == "server_error"
    assert "kaboom" in chunks[-1]["error"]["message"]
    assert second.status_code == 500
    assert second.json()["error"]["type"] == "server_error"


# ---- validation ---------------------------------------------------------------------------------


def turns(n: int, chars: int = 1) -> list[dict]:
    """n messages alternating user/assistant, starting with user."""
    return [{"role": ("user", "assistant")[i % 2], "content": "x" * chars} for i in range(n)]


BAD_REQUESTS = [
    ("no messages field", {}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("messages not a list", {"messages": "hi"}, "messages"),
    ("too many messages", {"messages": turns(501)}, "messages"),
    (
        "message too long",
        {"messages": [{"role": "user", "content": "x" * 8001}]},
        "messages[0].content",
    ),
    ("conversation too long", {"messages": turns(5, 7000)}, "messages"),
    ("unknown role", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ("ends with assistant", {"messages": turns(2)}, "messages"),
    ("assistant first", {"messages": [*turns(2)[::-1]]}, "messages"),
    ("system not first", {"messages": [*turns(1), {"role": "system", "content": "s"}]}, "messages"),
    (
        "image content",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
    ),
    (
        "a text part without its text",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
    ),
    ("function tools", {**HI, "tools": [{"type": "function"}]}, "tools"),
    ("tool_choice required", {**HI, "tool_choice": "required"}, "tool_choice"),
    ("top_logprobs without logprobs", {**HI, "top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs past 20", {**HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("an unknown reply format", {**HI, "response_format": {"type": "xml"}}, "response_format"),
    ("a frequency penalty", {**HI, "frequency_penalty": 0.5}, "frequency_penalty"),
    ("a presence penalty", {**HI, "presence_penalty": -1}, "presence_penalty"),
    ("an empty stop sequence", {**HI, "stop": ""}, "stop"),
    ("five stop sequences", {**HI, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("a long stop sequence", {**HI, "stop": "x" * 201}, "stop"),
    ("a stop sequence not a string", {**HI, "stop": [1]}, "stop[0]"),
    ("temperature below 0", {**HI, "temperature": -0.1}, "temperature"),
    ("temperature above 2", {**HI, "temperature": 2.1}, "temperature"),
    ("temperature not a number", {**HI, "temperature": "hot"}, "temperature"),
    ("top_k below 0", {**HI, "top_k": -1}, "top_k"),
    ("top_k above 200", {**HI, "top_k": 201}, "top_k"),
    ("top_k fractional", {**HI, "top_k": 1.5}, "top_k"),
    ("top_p zero", {**HI, "top_p": 0}, "top_p"),
    ("top_p above 1", {**HI, "top_p": 1.01}, "top_p"),
    ("max_tokens zero", {**HI, "max_tokens": 0}, "max_tokens"),
    ("max_tokens above 4096", {**HI, "max_tokens": 4097}, "max_tokens"),
    (
        "max_completion_tokens above 4096",
        {**HI, "max_completion_tokens": 5000},
        "max_completion_tokens",
    ),
    ("n of 2", {**HI, "n": 2}, "n"),
    ("negative seed", {**HI, "seed": -1}, "seed"),
    ("seed too big", {**HI, "seed": 2**64}, "seed"),
    # A message without text is a client bug (an empty string is not: see below).
    ("content missing", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("content null", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    (
        "assistant content null",
        {"messages": [*turns(1), {"role": "assistant", "content": None}, *turns(1)]},
        "messages[1].content",
    ),
    # Numbers are numbers: pydantic's lax mode would read "0.5" as 0.5 and true as 1.
    ("temperature a numeric string", {**HI, "temperature": "0.5"}, "temperature"),
    ("temperature true", {**HI, "temperature": True}, "temperature"),
    ("top_k a numeric string", {**HI, "top_k": "5"}, "top_k"),
    ("top_p true", {**HI, "top_p": True}, "top_p"),
    ("max_tokens a numeric string", {**HI, "max_tokens": "8"}, "max_tokens"),
    ("max_completion_tokens true", {**HI, "max_completion_tokens": True}, "max_completion_tokens"),
    ("seed a numeric string", {**HI, "seed": "1"}, "seed"),
    ("n true", {**HI, "n": True}, "n"),
    # Found by the schema fuzzer: the fields served only as "none" took false and "0" as 0.
    ("presence_penalty false", {**HI, "presence_penalty": False}, "presence_penalty"),
    ("frequency_penalty a numeric string", {**HI, "frequency_penalty": "0"}, "frequency_penalty"),
    ("top_logprobs false", {**HI, "top_logprobs": False}, "top_logprobs"),
    ("logprobs 0", {**HI, "logprobs": 0}, "logprobs"),
]


@pytest.mark.parametrize(
    ("body", "param"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_requests_get_400_naming_the_field_and_never_reach_a_worker(hello, body, param):
    server, worker = hello
    calls = len(worker.engine.model.calls)
    served = worker.requests_served
    for stream in (False, True):
        response = post(server, {**body, "stream": stream})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
        assert error["code"] is None
        assert param in error["message"]
    assert len(worker.engine.model.calls) == calls
    assert worker.requests_served == served


@pytest.mark.parametrize("stream", ["yes", "true", "false", 1, 0, [], {}])
def test_stream_must_be_true_or_false(hello, stream):
    server, worker = hello
    calls = len(worker.engine.model.calls)
    response = post(server, {**HI, "stream": stream})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "stream"
    assert error["message"].startswith("Invalid 'stream': must be true or false")
    assert len(worker.engine.model.calls) == calls


def test_a_null_stream_means_the_default_whole_reply(hello):
    server, _ = hello
    response = post(server, {**HI, "stream": None})
    assert response.status_code == 200
    assert response.json()["object"] == "chat.completion"


def test_an_empty_message_is_accepted_as_openai_does(hello):
    # The server's own reply can be empty (the model may end at once), and a client sends it
    # back; an empty question is odd but harmless.
    server, _ = hello
    conversation = [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": []},
    ]
    response = post(server, {"messages": conversation})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hello!"


def test_limits_at_their_bounds_are_accepted(hello):
    server, _ = hello
    body = {
        "messages": [*turns(498, 60), {"role": "user", "content": "x" * 1}],
        "temperature": 2.0,
        "top_k": 200,
        "top_p": 1.0,
        "max_tokens": 4096,
        "n": 1,
        "seed": 2**63 - 1,
    }
    assert len(body["messages"]) == 499
    # Far too many tokens for the 256-token scripted model: accepted by the limits, refused
    # for the context, which proves the limits let it through.
    response = post(server, body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    edge = {**HI, "temperature": 0, "top_k": 0, "top_p": 1e-6, "max_tokens": 1, "seed": 0}
    assert post(server, edge).status_code == 200
    # OpenAI's defaults, sent by some clients on every request, ask for nothing to refuse.
    defaults = {**HI, "frequency_penalty": 0, "presence_penalty": 0.0, "tool_choice": "none"}
    assert post(server, defaults).status_code == 200


def test_a_prompt_longer_than_the_context_is_refused(hello):
    server, worker = hello
    calls = len(worker.engine.model.calls)
    response = post(server, {"messages": [{"role": "user", "content": "x" * 300}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    assert "256" in error["message"]
    assert len(worker.engine.model.calls) == calls


def test_limits_are_configurable():
    limits = Limits(max_messages=1, max_message_chars=5, max_temperature=1.0, max_top_k=10)
    server = serve_workers([scripted_worker(reply([END]))], limits)
    try:
        cases = [
            ({"messages": turns(3)}, "messages"),
            ({"messages": [{"role": "user", "content": "123456"}]}, "messages[0].content"),
            ({**HI, "temperature": 1.5}, "temperature"),
            ({**HI, "top_k": 11}, "top_k"),
        ]
        for body, param in cases:
            response = post(server, body)
            assert (response.status_code, response.json()["error"]["param"]) == (400, param)
        assert post(server, {**HI, "temperature": 1.0, "top_k": 10}).status_code == 200
    finally:
        server.stop()


def test_a_body_that_is_not_json_is_a_400(hello):
    server, _ = hello
    response = httpx.post(
        f"{server.url}/v1/chat/completions", content=b"{nope", headers=JSON, timeout=10
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


# ---- the pool -----------------------------------------------------------------------------------


def test_a_client_that_disconnects_mid_stream_frees_its_worker():
    worker = scripted_worker(uniform_bytes, delay=0.02, sequence_len=8192)
    server = serve_workers([worker])
    try:
        body = {**HI, "stream": True, "max_tokens": 4096}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if '"content": "' in line and '"role"' not in line:
                    break  # the first generated text: now walk away
        assert wait_until(lambda: not worker.busy, timeout=5)
        steps_at_stop = len(worker.engine.model.calls)
        assert steps_at_stop < 200  # stopped long before max_tokens (4096 steps at 20 ms)
        stats = httpx.get(f"{server.url}/stats").json()
        assert stats["busy"] == 0
        assert stats["workers"][0]["busy"] is False
        # Stopped early, so not served: /stats counts it apart, its tokens nowhere.
        served = {k: stats[k] for k in ("requests_served", "tokens_served", "requests_interrupted")}
        assert served == {"requests_served": 0, "tokens_served": 0, "requests_interrupted": 1}
        assert stats["workers"][0]["requests_interrupted"] == 1
        # The next request gets the freed worker.
        response = post(server, {**HI, "max_tokens": 2})
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 2
        assert len(worker.engine.model.calls) <= steps_at_stop + 3
        stats = httpx.get(f"{server.url}/stats").json()
        assert (stats["requests_served"], stats["tokens_served"]) == (1, 2)
    finally:
        server.stop()


def test_a_client_that_leaves_while_queued_never_takes_a_worker():
    worker = scripted_worker(uniform_bytes, delay=0.02, sequence_len=8192)
    server = serve_workers([worker])
    url = f"{server.url}/v1/chat/completions"
    body = {**HI, "stream": True, "max_tokens": 4096}
    try:
        with httpx.stream("POST", url, json=body) as first:
            lines = first.iter_lines()
            next(line for line in lines if '"content": "' in line and '"role"' not in line)
            with httpx.stream("POST", url, json=body):  # queued behind the first
                assert wait_until(
                    lambda: httpx.get(f"{server.url}/stats").json()["queue_length"] == 1
                )
            assert wait_until(lambda: httpx.get(f"{server.url}/stats").json()["queue_length"] == 0)
            assert worker.busy  # still the first request's
        assert wait_until(lambda: not worker.busy, timeout=5)
        assert post(server, {**HI, "max_tokens": 2}).status_code == 200
        # The first request ran until its client left, the last to the end; the one that
        # left the queue never ran.
        assert (worker.requests_interrupted, worker.requests_served) == (1, 1)
    finally:
        server.stop()


def test_a_client_that_leaves_a_non_streaming_request_frees_its_worker():
    worker = scripted_worker(uniform_bytes, delay=0.02, sequence_len=8192)
    server = serve_workers([worker])
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{server.url}/v1/chat/completions", json={**HI, "max_tokens": 4096}, timeout=0.5
            )
        assert wait_until(lambda: not worker.busy, timeout=5)
        assert len(worker.engine.model.calls) < 200
    finally:
        server.stop()


def test_more_concurrent_requests_than_workers_are_queued_and_all_answered():
    answer = "queued fine"
    workers = [
        scripted_worker(reply([*text_tokens(answer), END]), name=str(i), delay=0.01)
        for i in range(2)
    ]
    server = serve_workers(workers)
    results: list[str] = []
    queue_lengths: list[int] = []
    done = threading.Event()

    def client() -> None:
        results.append(content_of(chunks_of(stream_body(server, HI))))

    def watch() -> None:
        while not done.is_set():
            queue_lengths.append(httpx.get(f"{server.url}/stats").json()["queue_length"])

    try:
        watcher = threading.Thread(target=watch)
        watcher.start()
        clients = [threading.Thread(target=client) for _ in range(6)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(timeout=60)
        done.set()
        watcher.join()
        stats = httpx.get(f"{server.url}/stats").json()
    finally:
        server.stop()
    assert results == [answer] * 6
    assert max(queue_lengths) >= 1  # some requests did wait for a worker
    assert stats["requests_served"] == 6
    assert stats["tokens_served"] == 6 * (len(answer) + 1)
    assert all(w["requests_served"] >= 1 for w in stats["workers"])
    assert stats["queue_length"] == 0


# ---- the other endpoints ------------------------------------------------------------------------


def test_health_stats_and_models(hello):
    server, _ = hello
    health = httpx.get(f"{server.url}/health").json()
    assert health == {"status": "ok", "model": "scripted", "workers": 1, "idle": 1}
    stats = httpx.get(f"{server.url}/stats").json()
    assert stats["model"] == "scripted"
    assert stats["busy"] == 0 and stats["idle"] == 1 and stats["queue_length"] == 0
    (w,) = stats["workers"]
    assert (w["name"], w["device"], w["busy"]) == ("0", "cpu", False)
    assert stats["requests_served"] == w["requests_served"]
    assert stats["tokens_served"] == w["tokens_served"]
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list"
    (entry,) = models["data"]
    assert (entry["id"], entry["object"], entry["context_length"]) == ("scripted", "model", 256)


def test_the_chat_page_is_served_and_self_contained(hello):
    server, _ = hello
    response = httpx.get(f"{server.url}/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "<title>chatcli</title>" in page
    assert "/v1/chat/completions" in page and "chatcli_tool" in page
    # Nothing is fetched from elsewhere: no absolute URLs in src/href/fetch, no imports.
    for needle in ('src="http', 'href="http', 'fetch("http', "@import", "//cdn"):
        assert needle not in page


def test_a_real_checkpoint_answers_and_counts_its_prompt():
    worker = reference_worker()
    server = BackgroundServer(create_app([worker], Limits(), "E")).start()
    try:
        body = {**HI, "temperature": 0, "max_tokens": 12, "seed": 3}
        whole = post(server, body).json()
        chunks = chunks_of(stream_body(server, body))
    finally:
        server.stop()
    prompt = worker.tokenizer.render_for_completion(HI["messages"])
    assert whole["usage"]["prompt_tokens"] == len(prompt)
    assert 1 <= whole["usage"]["completion_tokens"] <= 12
    # Greedy decoding: the streamed reply is the same text as the whole one. (The fixture's
    # weights are random, so that text is byte soup: U+FFFD where bytes form no character.)
    assert content_of(chunks) == whole["choices"][0]["message"]["content"]
    assert counts(chunks[-1]["usage"]) == counts(whole["usage"])
    # The same prompt again: all of it but the last token came from the worker's cache.
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt) - 1}


def test_a_conversation_sent_again_with_one_more_turn_prefills_only_that_turn():
    # An OpenAI-style client resends the whole conversation every turn: the worker's warm
    # cache holds the last one, so only the new turn is prefilled, and the reply is the
    # one a worker with an empty cache gives (greedy, the same tokens).
    warm, cold = reference_worker(), reference_worker()
    server = BackgroundServer(create_app([warm], Limits(), "E")).start()
    try:
        first = {**HI, "temperature": 0, "max_tokens": 6, "seed": 3}
        one = post(server, first).json()
        said = one["choices"][0]["message"]["content"]
        second = {
            **first,
            "messages": [
                *HI["messages"],
                {"role": "assistant", "content": said},
                {"role": "user", "content": "and then?"},
            ],
        }
        two = post(server, second).json()
        again = post(server, second).json()
    finally:
        server.stop()
    assert one["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    prompt = warm.tokenizer.render_for_completion(second["messages"])
    assert two["usage"]["prompt_tokens"] == len(prompt)
    # Everything up to the first reply's text was cached (the client's reply text may
    # tokenize differently from what the model generated, so count from the tokens).
    first_prompt = warm.tokenizer.render_for_completion(HI["messages"])
    cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert len(first_prompt) <= cached < len(prompt) - 4  # "and then?" and its markers ran
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt) - 1}
    server = BackgroundServer(create_app([cold], Limits(), "E")).start()
    try:
        fresh = post(server, second).json()
    finally:
        server.stop()
    assert fresh["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    for answer in (two, again):
        assert answer["choices"] == fresh["choices"]


# ---- running it ---------------------------------------------------------------------------------


def test_serve_loads_the_checkpoint_and_says_where_it_listens():
    if not REFERENCE_E.is_dir():
        pytest.skip(f"reference fixture not found at {REFERENCE_E}")
    program = (
        "import json; from chatcli.serve.runner import serve; "
        f"serve({str(REFERENCE_E)!r}, port=0, workers=2, device='cpu', log_level='warning', "
        "cache_slots=3, batch=2, "
        "on_ready=lambda info: print(json.dumps(info), flush=True))"
    )
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert info["model"] == "d4"
        assert info["devices"] == ["cpu", "cpu"]
        assert info["cpu_threads"] == 1  # a small model decodes on one thread, as in a chat
        assert info["url"].startswith("http://127.0.0.1:")
        assert wait_until(lambda: _answers(info["url"] + "/health"), timeout=30)
        # On 127.0.0.1 it answers loopback names only (--host sets the guard).
        rebound = httpx.get(info["url"] + "/health", headers={"Host": "evil.example"})
        assert rebound.status_code == 400
        stats = httpx.get(info["url"] + "/stats").json()
        assert [w["name"] for w in stats["workers"]] == ["0", "1"]
        assert [w["cache_slots"] for w in stats["workers"]] == [3, 3]
        assert [w["rows"] for w in stats["workers"]] == [2, 2] and info["batch"] == 2
        response = httpx.post(
            info["url"] + "/v1/chat/completions", json={**HI, "max_tokens": 4}, timeout=30
        )
        assert response.json()["usage"]["completion_tokens"] <= 4
    finally:
        proc.terminate()
        # uvicorn shuts down cleanly, then re-raises the signal so the exit status tells it.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_workers_default_to_one_cpu_replica():
    assert worker_devices("cpu") == ["cpu"]
    assert worker_devices("cpu", 3) == ["cpu", "cpu", "cpu"]
    with pytest.raises(ConfigError, match="at least 1"):
        worker_devices("cpu", 0)


def test_a_taken_port_is_a_fix_it_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ChatcliError, match=f"Cannot listen on 127.0.0.1:{port}.*--port"):
            listen("127.0.0.1", port)


@pytest.mark.parametrize("port", [-1, 65536, 99999])
def test_a_port_out_of_range_is_a_fix_it_error(port):
    with pytest.raises(ChatcliError, match=rf"--port must be between 0 and 65535.*got {port}"):
        listen("127.0.0.1", port)


# 999.1.1.1 is no address at all; 192.0.2.1 (TEST-NET-1) is one, but never this machine's.
@pytest.mark.parametrize("host", ["999.1.1.1", "192.0.2.1"])
def test_a_host_that_is_not_here_says_check_host_not_port(host):
    with pytest.raises(ChatcliError, match=f"Cannot listen on {host}:0") as caught:
        listen(host, 0)
    assert "--host" in str(caught.value)
    assert "--port" not in str(caught.value)


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        # A value no port has is the command line's mistake (2); an address that is not
        # this machine's is found only by trying it (1).
        (["--port", "99999"], "--port must be between 0 and 65535", 2),
        (["--port", "-1"], "--port must be between 0 and 65535", 2),
        (["--host", "999.1.1.1", "--port", "0"], "Check --host", 1),
    ],
)
def test_serve_with_a_bad_address_fails_in_one_error_before_loading(
    tmp_path, monkeypatch, args, message, code
):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path))
    for name in ("CHATCLI_MODEL", "CHATCLI_CONFIG", "CHATCLI_URL"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(cli_app, ["serve", "--model", "/no/such/model", *args])
    # The address is checked before the model: no "No model at" error, no traceback.
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == code
    assert result.output.startswith("Error: ")
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


# ---- what OpenAI clients send -------------------------------------------------------------------


def test_a_stop_sequence_ends_the_reply_before_it_streamed_or_whole():
    worker = scripted_worker(reply([*text_tokens("Hi! there. Bye"), END]))
    server = serve_workers([worker])
    try:
        for stop, said in [("!", "Hi"), (["re. B", "zz"], "Hi! the"), ("q", "Hi! there. Bye")]:
            body = {**HI, "stop": stop, "max_tokens": 40}
            whole = post(server, body).json()["choices"][0]
            assert (whole["message"]["content"], whole["finish_reason"]) == (said, "stop")
            chunks = chunks_of(stream_body(server, body))
            assert content_of(chunks) == said
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        # Cut by max_tokens inside what might have been a stop sequence: the text held back
        # while it might be one comes out in the end.
        cut = post(server, {**HI, "stop": "there!", "max_tokens": 6}).json()["choices"][0]
        assert (cut["message"]["content"], cut["finish_reason"]) == ("Hi! th", "length")
    finally:
        server.stop()


def test_developer_is_system_and_neighbouring_messages_of_one_role_are_one(hello):
    server, worker = hello
    sent = [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "Sure."},
        {"role": "assistant", "content": "What next?"},
        {"role": "user", "content": "first"},
        {"role": "user", "content": "second"},
    ]
    assert post(server, {"messages": sent}).status_code == 200
    merged = [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sure.\n\nWhat next?"}]},
        {"role": "user", "content": "first\n\nsecond"},
    ]
    expected = worker.tokenizer.render_for_completion(merged)
    model = worker.engine.model
    assert model.histories[0][: model.prompt_len] == expected


def test_errors_outside_the_api_have_openais_shape_too(hello):
    server, _ = hello
    missing = httpx.get(f"{server.url}/v1/nope", timeout=30)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Not Found: GET /v1/nope"
    wrong_method = httpx.get(f"{server.url}/v1/chat/completions", timeout=30)
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    nested = httpx.post(
        f"{server.url}/v1/chat/completions",
        content="[" * 100000 + "]" * 100000,
        headers=JSON,
        timeout=30,
    )
    assert nested.status_code == 400
    assert "nested too deeply" in nested.json()["error"]["message"]


def test_a_model_is_retrieved_by_its_id(hello):
    server, _ = hello
    listed = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    one = httpx.get(f"{server.url}/v1/models/{listed['id']}", timeout=30)
    assert one.status_code == 200
    assert one.json() == listed
    other = httpx.get(f"{server.url}/v1/models/gpt-4o", timeout=30)
    assert other.status_code == 404
    assert other.json()["error"]["code"] == "model_not_found"


# ---- guards against web pages and floods --------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_a_body_not_sent_as_json_is_a_415_that_says_which_header(hello, content_type):
    # text/plain and forms are what any web page may post here without a preflight.
    server, worker = hello
    calls = len(worker.engine.model.calls)
    headers = {"Content-Type": content_type} if content_type else {}
    response = httpx.post(
        f"{server.url}/v1/chat/completions", content=json.dumps(HI), headers=headers, timeout=10
    )
    assert response.status_code == 415
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "-H 'Content-Type: application/json'" in error["message"]
    assert len(worker.engine.model.calls) == calls


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_json_with_parameters_or_capitals_is_taken(hello, content_type):
    server, _ = hello
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=json.dumps(HI),
        headers={"Content-Type": content_type},
        timeout=10,
    )
    assert response.status_code == 200


def test_a_loopback_server_refuses_other_host_names_against_dns_rebinding():
    worker = scripted_worker(reply([END]))
    app = create_app([worker], allowed_hosts=LOOPBACK_HOSTNAMES)
    with BackgroundServer(app) as server:
        for host in ("localhost:8000", "127.0.0.1:1", "[::1]:8000", "LOCALHOST"):
            assert httpx.get(f"{server.url}/health", headers={"Host": host}).status_code == 200
        for host in ("evil.example:8000", "127.0.0.1.evil.example", "[::2]:8000", "::1:80"):
            for method, path in (("GET", "/"), ("POST", "/v1/chat/completions")):
                response = httpx.request(
                    method, f"{server.url}{path}", json=HI, headers={"Host": host}, timeout=10
                )
                assert response.status_code == 400, (host, path)
                assert "DNS rebinding" in response.json()["error"]["message"]
    assert worker.engine.model.calls == []


def test_a_body_over_the_limit_is_a_413_by_its_length_or_as_it_streams():
    server = serve_workers([scripted_worker(reply([END]))], Limits(max_body_bytes=1000))
    url = f"{server.url}/v1/chat/completions"
    long = {"messages": [{"role": "user", "content": "x" * 2000}]}
    try:
        by_length = httpx.post(url, json=long, timeout=10)

        def chunked(body: bytes):  # no Content-Length: httpx sends it chunked
            for at in range(0, len(body), 300):
                yield body[at : at + 300]

        as_sent = httpx.post(url, content=chunked(json.dumps(long).encode()), headers=JSON)
        small = httpx.post(url, content=chunked(json.dumps(HI).encode()), headers=JSON)
    finally:
        server.stop()
    assert "content-length" not in as_sent.request.headers
    for response in (by_length, as_sent):
        assert response.status_code == 413
        assert "over 1000 bytes" in response.json()["error"]["message"]
    assert small.status_code == 200


def test_the_default_body_limit_is_one_mebibyte(hello):
    server, _ = hello
    assert Limits().max_body_bytes == 1024 * 1024
    body = {"messages": [{"role": "user", "content": "x" * (1024 * 1024)}]}
    assert post(server, body).status_code == 413


def test_prompts_are_prepared_off_the_event_loop(hello):
    # A long conversation takes a while to tokenize: on the loop, it stalls every stream.
    server, worker = hello
    threads = []
    render = worker.tokenizer.render_for_completion

    def recording(conversation):
        threads.append(threading.current_thread())
        return render(conversation)

    worker.tokenizer.render_for_completion = recording
    try:
        assert post(server, HI).status_code == 200
    finally:
        del worker.tokenizer.render_for_completion
    assert len(threads) == 1
    assert threads[0] is not server.thread  # the thread uvicorn's event loop runs on


def test_a_full_queue_is_a_429_and_a_queued_stream_says_it_is_waiting():
    worker = scripted_worker(uniform_bytes, delay=0.02, sequence_len=8192)
    app = create_app([worker], Limits(max_queue=1), waiting_every=0.05)
    body = {**HI, "stream": True, "max_tokens": 4096}
    with BackgroundServer(app) as server:
        url = f"{server.url}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=10) as running:
            # (Each iterator is kept: a dropped one closes its response.)
            running_lines = running.iter_lines()
            next(x for x in running_lines if '"content": "' in x and '"role"' not in x)
            with httpx.stream("POST", url, json=body, timeout=10) as queued:
                lines = queued.iter_lines()
                assert next(lines).startswith('data: {"id"')  # the role chunk, at once
                assert next(line for line in lines if line) == ": waiting for a worker"
                full = post(server, HI)
                assert full.status_code == 429
                assert full.headers["retry-after"] == "5"
                error = full.json()["error"]
                assert (error["type"], error["code"]) == ("server_error", "queue_full")
                assert "1 requests are already waiting" in error["message"]
        assert wait_until(lambda: not worker.busy, timeout=5)
        assert post(server, {**HI, "max_tokens": 2}).status_code == 200


def test_get_routes_answer_head_and_the_api_docs_are_not_served(hello):
    server, _ = hello
    for path in ("/", "/health", "/stats", "/v1/models", "/v1/models/scripted"):
        got = httpx.get(f"{server.url}{path}", timeout=10)
        head = httpx.head(f"{server.url}{path}", timeout=10)
        assert (head.status_code, head.content) == (200, b""), path
        assert head.headers["content-type"] == got.headers["content-type"]
    options = httpx.options(f"{server.url}/health", timeout=10)  # no CORS: not allowed
    assert options.status_code == 405
    assert set(options.headers["allow"].split(", ")) == {"GET", "HEAD"}
    for path in ("/docs", "/redoc", "/openapi.json"):
        response = httpx.get(f"{server.url}{path}", timeout=10)
        assert response.status_code == 404
        assert response.json()["error"]["message"] == f"Not Found: GET {path}"


# ---- shutting down ------------------------------------------------------------------------------

TESTS = Path(__file__).parent
# A server in its own process, as `chatcli serve` runs, on one slow worker whose replies never
# end: the port on the first line of stdout.
SLOW_SERVER = """
from fakes import uniform_bytes
from serving import scripted_worker
from chatcli.serve.app import create_app
from chatcli.serve.runner import listen, run_app
sock = listen("127.0.0.1", 0)
print(sock.getsockname()[1], flush=True)
try:
    run_app(create_app([scripted_worker(uniform_bytes, delay=0.02, sequence_len=8192)]), sock)
except KeyboardInterrupt:
    pass
"""


def test_ctrl_c_ends_open_streams_with_an_error_and_done_and_exits_at_once():
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_SERVER],
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{proc.stdout.readline().strip()}"
        assert wait_until(lambda: _answers(url + "/health"), timeout=30)
        queued: list[httpx.Response] = []
        body = {**HI, "max_tokens": 4096}
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
        ) as response:
            lines = response.iter_lines()
            seen = [next(line for line in lines if '"content": "' in line and '"role"' not in line)]
            waiter = threading.Thread(
                target=lambda: queued.append(
                    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
                )
            )
            waiter.start()
            assert wait_until(lambda: httpx.get(f"{url}/stats").json()["queue_length"] == 1)
            proc.send_signal(signal.SIGINT)
            signalled = time.monotonic()
            seen += list(lines)  # to the end of the body: it must close cleanly
            waiter.join(timeout=30)
        assert proc.wait(timeout=30) == 0
        took = time.monotonic() - signalled
        stderr = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    events = [line for line in seen if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error == {
        "message": "The server is shutting down.",
        "type": "server_error",
        "param": None,
        "code": "server_shutting_down",
    }
    (refused,) = queued
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert took < 4  # uvicorn's grace period is 5 s: nobody waited it out
    assert "Traceback" not in stderr and "CancelledError" not in stderr
