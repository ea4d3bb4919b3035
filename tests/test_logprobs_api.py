"""`logprobs` on /v1/chat/completions through a real server on 127.0.0.1: OpenAI's shape,
whole and streamed, from a worker of one row and from a batch, through httpx and the openai
client; each token's logprob is nanochat's checkpoint's own full forward's log_softmax."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from fakes import DONE, tool_call
from serving import REFERENCE_E, scripted_worker, serve_workers

from chatcli.model.special_tokens import SPECIAL_TOKENS
from chatcli.serve.app import Limits, Worker

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")

QUESTION = [{"role": "user", "content": "Why is the sky blue? Answer in one sentence."}]
TOLERANCE = 2e-4


def _token_id(tokenizer, raw: list[int]) -> int:
    """A listed token's id, read back from its bytes (a special token's are its name)."""
    text = bytes(raw).decode("utf-8", errors="replace")
    if text in SPECIAL_TOKENS:
        return tokenizer.encode_special(text)
    return tokenizer.enc.encode_single_token(bytes(raw))


@pytest.fixture(scope="module")
def reference():
    """The era E checkpoint nanochat made: its model and tokenizer."""
    if not REFERENCE_E.is_dir():
        pytest.skip(f"reference fixture not found at {REFERENCE_E}")
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(REFERENCE_E, device="cpu")
    return model, tokenizer


@pytest.fixture(scope="module", params=[1, 3], ids=["batch1", "batch3"])
def server(request, reference):
    model, tokenizer = reference
    srv = serve_workers([Worker(model, tokenizer, batch=request.param)], Limits(), "reference")
    yield srv
    srv.stop()


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def _chunks(server, body: dict) -> list[dict]:
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        text = response.read().decode()
    lines = [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


def _text(content: list[dict]) -> str:
    """The reply's text from its tokens' bytes (a token's own text may be half a character)."""
    return b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", errors="replace")


def _check_against_model(reference, messages: list[dict], content: list[dict], top: int):
    """Each entry's token, bytes, logprob and alternatives against the model's full forward
    over the prompt and the reply's tokens (their ids read back from their bytes)."""
    model, tokenizer = reference
    prompt = tokenizer.render_for_completion(messages)
    ids = [_token_id(tokenizer, e["bytes"]) for e in content]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ids]))[0].float()
    want = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    for i, (entry, token) in enumerate(zip(content, ids, strict=True)):
        raw = tokenizer.decode_bytes([token])
        assert entry["bytes"] == list(raw)
        assert entry["token"] == raw.decode("utf-8", errors="replace")
        assert entry["logprob"] == pytest.approx(want[i, token].item(), abs=TOLERANCE)
        values, alternatives = torch.topk(want[i], top)
        assert len(entry["top_logprobs"]) == top
        assert [a["logprob"] for a in entry["top_logprobs"]] == pytest.approx(
            values.tolist(), abs=TOLERANCE
        )
        assert entry["top_logprobs"][0]["bytes"] == list(
            tokenizer.decode_bytes([alternatives[0].item()])
        )


def test_a_whole_reply_lists_each_token_with_the_models_own_logprob(server, reference):
    # Sampled at temperature 0.6 with top-k: the reported logprobs stay temperature 1's.
    body = {"messages": QUESTION, "max_tokens": 24, "logprobs": True, "top_logprobs": 3}
    response = _post(server, {**body, "temperature": 0.6, "top_k": 20, "seed": 5})
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert _text(content) == choice["message"]["content"]
    assert len(content) == response.json()["usage"]["completion_tokens"] - (
        choice["finish_reason"] == "stop"  # <|assistant_end|> is counted, not listed
    )
    _check_against_model(reference, QUESTION, content, 3)


def test_a_stream_carries_the_same_logprobs_as_the_whole_reply(server, reference):
    body = {"messages": QUESTION, "max_tokens": 20, "temperature": 0, "logprobs": True}
    whole = _post(server, {**body, "top_logprobs": 2}).json()["choices"][0]["logprobs"]["content"]
    chunks = _chunks(server, {**body, "top_logprobs": 2})
    streamed = [
        e for c in chunks for e in (c["choices"][0].get("logprobs") or {}).get("content", [])
    ]
    assert [e["bytes"] for e in streamed] == [e["bytes"] for e in whole]
    for a, b in zip(streamed, whole, strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=TOLERANCE)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == _text(streamed)
    # top_logprobs 0 (or none): the tokens' own logprobs, no alternatives.
    none = _post(server, body).json()["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in none] == [[]] * len(none)


def test_several_clients_at_once_each_get_their_own_replys_logprobs(server, reference):
    questions = [
        [{"role": "user", "content": q}]
        for q in ("What is 2+2?", "Name a colour.", "Say hello in French.")
    ]

    def ask(messages):
        body = {"messages": messages, "max_tokens": 12, "temperature": 0.9, "seed": 1}
        return _post(server, {**body, "logprobs": True, "top_logprobs": 1}).json()

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, questions))
    for messages, answer in zip(questions, answers, strict=True):
        _check_against_model(reference, messages, answer["choices"][0]["logprobs"]["content"], 1)


def test_without_logprobs_the_reply_has_no_logprobs_field(server):
    response = _post(server, {"messages": QUESTION, "max_tokens": 4})
    assert "logprobs" not in response.json()["choices"][0]
    chunks = _chunks(server, {"messages": QUESTION, "max_tokens": 4})
    assert all("logprobs" not in c["choices"][0] for c in chunks if c["choices"])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"top_logprobs": 2}, "needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "between 0 and 20"),
        ({"logprobs": True, "top_logprobs": -1}, "between 0 and 20"),
        ({"logprobs": 1}, "must be true or false"),
    ],
)
def test_bad_logprobs_fields_are_400s_in_openais_shape(server, body, message):
    response = _post(server, {"messages": QUESTION, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] in ("logprobs", "top_logprobs")


def test_calculator_forced_tokens_are_marked_forced_with_null_logprob():
    srv = serve_workers([scripted_worker(tool_call("12*7", DONE))])
    try:
        body = {"messages": [{"role": "user", "content": "what is 12*7?"}], "logprobs": True}
        content = _post(srv, {**body, "top_logprobs": 1}).json()["choices"][0]["logprobs"]
    finally:
        srv.stop()
    forced = [e for e in content["content"] if e.get("chatcli_forced")]
    assert "".join(e["token"] for e in forced) == "<|output_start|>84<|output_end|>"
    assert all(e["logprob"] is None and e["top_logprobs"] == [] for e in forced)
    chosen = [e for e in content["content"] if not e.get("chatcli_forced")]
    assert "".join(e["token"] for e in chosen) == "<|python_start|>12*7<|python_end|> done"
    assert all(e["logprob"] == pytest.approx(0, abs=1e-6) for e in chosen)


def test_the_openai_client_reads_logprobs_whole_and_streamed(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    whole = client.chat.completions.create(
        model="reference", messages=QUESTION, max_tokens=10, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = whole.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == (
        whole.choices[0].message.content
    )
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob for t in content)  # greedy: the top one
    stream = client.chat.completions.create(
        model="reference", messages=QUESTION, max_tokens=10, temperature=0,
        logprobs=True, top_logprobs=3, stream=True,
    )  # fmt: skip
    streamed = [
        t
        for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in content]
