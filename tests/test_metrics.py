"""GET /metrics: Prometheus' text, read back with prometheus_client's own parser.

A real server on 127.0.0.1 (uvicorn, the embedded model, the default batched worker, an API
key, as `chatcli serve --api-key KEY` runs): the counters move by exactly the tokens the
clients were sent and received (several clients at once, prompts past a prefill chunk,
streamed and whole), the histograms by one observation a request (inter-token latency: one a
gap between tokens), and a stream cut off mid-reply counts as an abort, on one row and in a
batch alike. Without prometheus_client the route is a 501 naming the pip command.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter

import pytest

pytest.importorskip("prometheus_client", reason="needs the serve extra: pip install -e '.[serve]'")

import httpx
from fakes import SlotScriptedModel, uniform_bytes
from prometheus_client.parser import text_string_to_metric_families
from serving import SlowModel, byte_tokenizer, wait_until

from chatcli.engine.scheduler import PREFILL_CHUNK, default_rows
from chatcli.serve.app import Worker, create_app
from chatcli.serve.guards import hosts_to_check
from chatcli.serve.runner import BackgroundServer

KEY = "metrics-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "chatcli-embedded"


def scrape(server: BackgroundServer) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    r = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture(scope="module")
def server():
    """`chatcli serve --api-key KEY`: the embedded model, one worker of the default rows."""
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(None, device="cpu")
    app = create_app(
        [Worker(model, tokenizer, batch=default_rows("cpu"))],
        model_name=MODEL,
        allowed_hosts=hosts_to_check("127.0.0.1"),
        api_keys=[KEY],
    )
    with BackgroundServer(app) as running:
        yield running


def _long_question(i: int) -> str:
    numbers = " ".join(str(n) for n in range(i, i + 40))
    return f"Client {i} here. Please add up these numbers for me: {numbers}. What is the sum?"


def _ask(server: BackgroundServer, i: int, results: list) -> None:
    body = {
        "messages": [{"role": "user", "content": _long_question(i)}],
        "max_tokens": 4 + 6 * i,
        "temperature": 1.0,
        "seed": i,
    }
    url = f"{server.url}/v1/chat/completions"
    if i % 2:  # streamed: the usage comes with the finish reason's chunk
        with httpx.stream(
            "POST", url, json={**body, "stream": True}, headers=AUTH, timeout=300
        ) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        last = chunks[-1]
        results.append((last["usage"], last["choices"][0]["finish_reason"]))
    else:
        r = httpx.post(url, json=body, headers=AUTH, timeout=300)
        assert r.status_code == 200, r.text
        results.append((r.json()["usage"], r.json()["choices"][0]["finish_reason"]))


def test_counters_move_by_exactly_the_tokens_of_concurrent_long_requests(server):
    before = scrape(server)
    results: list = []
    clients = [threading.Thread(target=_ask, args=(server, i, results)) for i in range(6)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    assert len(results) == 6
    usages = [u for u, _ in results]
    assert all(u["prompt_tokens"] > PREFILL_CHUNK for u in usages)  # prefilled in chunks
    after = scrape(server)

    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert moved(before, after, "chatcli:prompt_tokens_total") == prompt
    assert moved(before, after, "chatcli:generation_tokens_total") == generated
    assert moved(before, after, "chatcli:prefix_cache_queries_total") == prompt
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert moved(before, after, "chatcli:prefix_cache_hits_total") == cached
    for reason, count in Counter(r for _, r in results).items():
        assert (
            moved(before, after, "chatcli:request_success_total", finished_reason=reason) == count
        )

    # One observation a request; inter-token latency one a gap, summing to the decode time.
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert moved(before, after, f"chatcli:{histogram}_count") == 6
    gaps = sum(u["completion_tokens"] - 1 for u in usages)
    assert moved(before, after, "chatcli:inter_token_latency_seconds_count") == gaps
    decode = sum(u["chatcli_decode_s"] for u in usages)
    assert moved(before, after, "chatcli:inter_token_latency_seconds_sum") == pytest.approx(
        decode, abs=1e-5 * 6
    )
    ttft_sum = moved(before, after, "chatcli:time_to_first_token_seconds_sum")
    e2e_sum = moved(before, after, "chatcli:e2e_request_latency_seconds_sum")
    assert 0 < ttft_sum < e2e_sum

    # All done: nothing running or waiting, no slot in use.
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert value(after, f"chatcli:{gauge}") == 0


def test_metrics_need_the_key_like_every_route(server):
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert httpx.get(f"{server.url}/metrics", headers=wrong, timeout=10).status_code == 401


@pytest.mark.parametrize("batch", [1, 4])
def test_a_stream_cut_off_mid_reply_counts_as_an_abort_and_its_row_comes_free(batch):
    # A model that never stops, 20 ms a token: the reply is mid-way when the client leaves.
    if batch == 1:
        model = SlowModel(uniform_bytes, 0.02, sequence_len=4096)
    else:
        model = SlotScriptedModel(uniform_bytes, sequence_len=4096, delay=0.02)
    worker = Worker(model, byte_tokenizer(), batch=batch)
    with BackgroundServer(create_app([worker], model_name=MODEL, api_keys=[KEY])) as server:
        body = {"messages": [{"role": "user", "content": "go"}], "stream": True}
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60
        ) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 8:  # a few tokens in
                    during = scrape(server)
                    break
        assert value(during, "chatcli:num_requests_running") == 1
        assert value(during, "chatcli:kv_cache_usage_perc") == 1 / batch

        def aborted() -> bool:
            return value(scrape(server), "chatcli:request_success_total", finished_reason="abort")

        assert wait_until(aborted, timeout=30)
        after = scrape(server)
        assert value(after, "chatcli:request_success_total", finished_reason="abort") == 1
        assert value(after, "chatcli:e2e_request_latency_seconds_count") == 1
        # Its tokens are not counted, as /stats' tokens_served leaves them out.
        assert value(after, "chatcli:generation_tokens_total") == 0
        assert wait_until(lambda: value(scrape(server), "chatcli:num_requests_running") == 0)


def test_two_servers_in_one_process_count_apart():
    a = create_app([Worker(SlowModel(uniform_bytes, 0.0), byte_tokenizer())], model_name=MODEL)
    b = create_app([Worker(SlowModel(uniform_bytes, 0.0), byte_tokenizer())], model_name=MODEL)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    with BackgroundServer(a) as first, BackgroundServer(b) as second:
        r = httpx.post(f"{first.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert value(scrape(first), "chatcli:generation_tokens_total") == 5
        assert value(scrape(second), "chatcli:generation_tokens_total") == 0
        assert value(scrape(first), "chatcli:request_success_total", finished_reason="length") == 1


def test_without_prometheus_client_metrics_is_a_501_naming_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    app = create_app([Worker(SlowModel(uniform_bytes, 0.0), byte_tokenizer())], model_name=MODEL)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with BackgroundServer(app) as server:
        r = httpx.get(f"{server.url}/metrics", timeout=10)
        assert r.status_code == 501
        error = r.json()["error"]
        assert "prometheus_client" in error["message"]
        assert "pip install 'chatcli[serve]'" in error["message"]
        # Everything else serves as before.
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_conversations_second_turn_counts_its_warm_prompt_as_prefix_hits(server):
    url = f"{server.url}/v1/chat/completions"
    first = [{"role": "user", "content": _long_question(100)}]
    body = {"messages": first, "max_tokens": 12, "temperature": 0}
    r = httpx.post(url, json=body, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    before = scrape(server)
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    r = httpx.post(url, json={**body, "messages": second}, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > PREFILL_CHUNK  # the first turn's prompt at least
    after = scrape(server)
    assert moved(before, after, "chatcli:prefix_cache_hits_total") == cached
    assert moved(before, after, "chatcli:prefix_cache_queries_total") == usage["prompt_tokens"]
    assert moved(before, after, "chatcli:prompt_tokens_total") == usage["prompt_tokens"]


def test_time_to_first_token_counts_the_time_a_request_queued_for_a_row():
    # One worker of one row, 20 ms a token: of two requests sent together one waits for the
    # other's whole reply (30 tokens, 0.6 s) before its first token, and a client's time to
    # first token, like vLLM's, includes that wait.
    model = SlowModel(uniform_bytes, 0.02, sequence_len=4096)
    worker = Worker(model, byte_tokenizer(), batch=1)
    with BackgroundServer(create_app([worker], model_name=MODEL, api_keys=[KEY])) as server:
        url = f"{server.url}/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 30}
        usages: list = []

        def ask() -> None:
            r = httpx.post(url, json=body, headers=AUTH, timeout=60)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])

        clients = [threading.Thread(target=ask) for _ in range(2)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        assert len(usages) == 2
        after = scrape(server)
        assert value(after, "chatcli:time_to_first_token_seconds_count") == 2
        # The queued one waited at least the other's decode time (29 gaps of 20 ms).
        waited = min(u["chatcli_decode_s"] for u in usages)
        assert waited > 0.4
        assert value(after, "chatcli:time_to_first_token_seconds_sum") >= waited
