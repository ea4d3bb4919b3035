"""Fuzzing the HTTP API from its own OpenAPI document: Schemathesis against the real server on
127.0.0.1 (uvicorn, the embedded model, batched workers, API keys and the loopback Host guard,
as `chatcli serve --api-key KEY` runs), every route with the key and without it, then
sequences of streams cut off mid-reply, whole replies and /stats.

Checks: no 5xx; every error in OpenAI's error shape; every body as the document says; without
the key, a 401 everywhere but /health and the page; afterwards, no row or queue place left
taken, and a greedy question gets the answer it got before the run.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("schemathesis", reason="needs the dev extra: pip install -e '.[dev]'")
pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")

import httpx
import schemathesis
from fakes import reply
from fuzzing import budget, fuzz
from hypothesis import given
from hypothesis import strategies as st
from serving import END, scripted_worker

from chatcli.serve.app import Limits, Worker, create_app
from chatcli.serve.guards import hosts_to_check
from chatcli.serve.openapi import ERROR_BODY
from chatcli.serve.runner import BackgroundServer

pytestmark = [fuzz, pytest.mark.slow]
KEY = "fuzz-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTION = {"messages": [{"role": "user", "content": "What is 2+3?"}], "temperature": 0}
LIMITS = Limits()

# The document is the app's own; a scripted worker stands in while it is built at import.
DOCUMENT = create_app([scripted_worker(reply([END]))], LIMITS, api_keys=[KEY]).openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)
schema.config.update(request_timeout=60)


@pytest.fixture(scope="module")
def server():
    """`chatcli serve --api-key KEY` on 127.0.0.1: the embedded model, 4 rows batched."""
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(None, device="cpu")
    app = create_app(
        [Worker(model, tokenizer, batch=4)],
        LIMITS,
        "chatcli-embedded",
        allowed_hosts=hosts_to_check("127.0.0.1"),
        api_keys=[KEY],
    )
    with BackgroundServer(app) as running:
        before = greedy_answer(running)
        yield running
        # After every fuzz test of the module: nothing left taken, and the same right answer.
        idle(running)
        assert greedy_answer(running) == before


def greedy_answer(server: BackgroundServer) -> str:
    r = httpx.post(f"{server.url}/v1/chat/completions", json=QUESTION, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert "5" in answer, answer
    return answer


def idle(server: BackgroundServer, timeout: float = 30.0) -> dict:
    """/stats once every generation has ended: no row in use, no request queued."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{server.url}/stats", headers=AUTH, timeout=10).json()
        if stats["rows_in_use"] == 0 and stats["busy"] == 0 and stats["queue_length"] == 0:
            return stats
        assert time.monotonic() < deadline, f"rows or places left taken: {stats}"
        time.sleep(0.05)


def is_error_body(body: object) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(error, dict)
        and set(error) == set(ERROR_BODY["properties"]["error"]["required"])
        and isinstance(error["message"], str)
        and bool(error["message"].strip())
    )


@schema.parametrize()
@budget(40)
def test_every_route_answers_as_its_schema_says(case, server):
    # The one check left out: a body the schema takes may still be refused, for what JSON
    # Schema cannot say (user and assistant turns that alternate, the total length).
    response = case.call_and_validate(
        base_url=server.url,
        headers=AUTH,
        excluded_checks=[schemathesis.checks.positive_data_acceptance],
    )
    assert response.status_code < 500, response.text
    if response.status_code >= 400 and case.method != "HEAD":
        assert is_error_body(response.json()), response.text


@schema.parametrize()
@budget(10)
def test_without_the_key_only_health_and_the_page_answer(case, server):
    response = case.call(base_url=server.url, headers={"Authorization": "Bearer not-the-key"})
    if case.path in ("/", "/health"):  # open: answered, or 405 for a method they do not take
        assert response.status_code in (200, 405), (case.method, case.path, response.status_code)
    else:
        assert response.status_code == 401, (case.path, response.status_code)
        if case.method != "HEAD":
            assert is_error_body(response.json()), response.text


STEPS = st.sampled_from(["cut-stream", "stream", "whole", "stats", "bad"])


@given(st.lists(st.tuples(STEPS, st.integers(0, 6), st.integers(1, 40)), min_size=1, max_size=6))
@budget(15)
def test_streams_cut_off_and_whole_replies_leave_no_row_taken(server, steps):
    url = f"{server.url}/v1/chat/completions"
    for step, cut_after, max_tokens in steps:
        body = {**QUESTION, "temperature": 1.0, "max_tokens": max_tokens}
        if step == "cut-stream":  # read a few events, then hang up mid-reply
            with httpx.stream(
                "POST", url, json={**body, "stream": True}, headers=AUTH, timeout=60
            ) as r:
                assert r.status_code == 200
                for n, _ in enumerate(r.iter_lines()):
                    if n >= cut_after:
                        break
        elif step == "stream":
            with httpx.stream(
                "POST", url, json={**body, "stream": True}, headers=AUTH, timeout=60
            ) as r:
                assert r.status_code == 200
                text = r.read().decode()
            assert text.endswith("data: [DONE]\n\n"), text[-200:]
        elif step == "whole":
            r = httpx.post(url, json=body, headers=AUTH, timeout=60)
            assert r.status_code == 200, r.text
            # A calculator result is written whole, even past max_tokens (ARCHITECTURE.md).
            choice, usage = r.json()["choices"][0], r.json()["usage"]
            if choice["finish_reason"] == "length":
                assert usage["completion_tokens"] >= max_tokens, r.text
        elif step == "bad":
            r = httpx.post(url, json={**body, "messages": []}, headers=AUTH, timeout=60)
            assert r.status_code == 400 and is_error_body(r.json()), r.text
        else:
            r = httpx.get(f"{server.url}/stats", headers=AUTH, timeout=10)
            assert r.status_code == 200
    idle(server)
