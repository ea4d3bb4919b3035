"""/v1/completions through a real server on 127.0.0.1: raw text in (no chat template),
the model's continuation out, whole and streamed, with the legacy logprobs; through httpx
and the openai client's `completions.create`, from a worker of one row and from a batch."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from serving import REFERENCE_E, serve_workers

from chatcli.engine.engine import Engine
from chatcli.serve.app import Limits, Worker
from chatcli.serve.completions import prompt_tokens

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")

PROMPT = "Once upon a time, in a land far away, there lived"
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def reference():
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
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def _greedy(reference, text: str, max_tokens: int) -> tuple[list[int], str]:
    """The engine's own greedy continuation of <|bos|> + text: its tokens and text."""
    model, tokenizer = reference
    ids = prompt_tokens(tokenizer, text)
    tokens = [
        c[0]
        for c, _ in Engine(model, tokenizer).generate(ids, max_tokens=max_tokens, temperature=0)
    ]
    ends = (tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id())
    body = tokens[:-1] if tokens and tokens[-1] in ends else tokens
    return body, tokenizer.decode(body)


def test_the_prompt_is_bos_and_plain_text_with_no_chat_template(reference):
    _, tokenizer = reference
    ids = prompt_tokens(tokenizer, "<|user_start|>hi")
    assert ids[0] == tokenizer.get_bos_token_id()
    assert tokenizer.encode_special("<|user_start|>") not in ids
    assert tokenizer.decode(ids[1:]) == "<|user_start|>hi"


def test_a_whole_completion_is_the_engines_greedy_continuation_with_legacy_logprobs(
    server, reference
):
    tokens, text = _greedy(reference, PROMPT, 20)
    response = _post(server, {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "logprobs": 3})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == text
    assert choice["finish_reason"] in ("length", "stop")
    assert body["usage"]["prompt_tokens"] == len(prompt_tokens(reference[1], PROMPT))
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(tokens)
    # Each token's logprob is the full forward's log_softmax at its position.
    model, tokenizer = reference
    ids = prompt_tokens(tokenizer, PROMPT)
    with torch.inference_mode():
        want = model(torch.tensor([ids + tokens]))[0].float().log_softmax(-1)
    for i, token in enumerate(tokens):
        assert lp["token_logprobs"][i] == pytest.approx(
            want[len(ids) - 1 + i, token].item(), abs=TOLERANCE
        )
        assert len(lp["top_logprobs"][i]) <= 3  # tokens of one text share an entry
        # Greedy: the chosen token is the likeliest, so its text heads the alternatives.
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(lp["token_logprobs"][i])
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)


def test_a_stream_gives_the_same_text_and_logprobs_and_ends_with_usage(server, reference):
    _, text = _greedy(reference, PROMPT, 16)
    body = {"prompt": [PROMPT], "max_tokens": 16, "temperature": 0, "logprobs": 1}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        raw = response.read().decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
    streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    whole = _post(server, body).json()["choices"][0]["logprobs"]
    assert streamed == pytest.approx(whole["token_logprobs"], abs=TOLERANCE)
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["text_offset"]  # they run on across the chunks


def test_a_stop_string_cuts_the_text_before_it(server, reference):
    _, text = _greedy(reference, PROMPT, 24)
    stop = text[5:8]
    assert stop and stop in text
    choice = _post(server, {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": stop})
    choice = choice.json()["choices"][0]
    assert choice["text"] == text[: text.index(stop)]
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None  # not asked


def test_a_seeded_sample_repeats_and_another_seed_differs(server):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "top_p": 0.95}
    a = _post(server, {**body, "seed": 1}).json()["choices"][0]["text"]
    assert _post(server, {**body, "seed": 1}).json()["choices"][0]["text"] == a
    assert _post(server, {**body, "seed": 2}).json()["choices"][0]["text"] != a


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": [1, 2, 3]}, "prompt", "token-id prompts are not taken"),
        ({"prompt": ["a", "b"]}, "prompt", "2 prompts"),
        ({}, "prompt", "must be the prompt's text"),
        ({"prompt": "x", "echo": True}, "echo", "echo is not supported"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "between 0 and 20"),
        ({"prompt": "x", "logprobs": True}, "logprobs", "must be a number"),
        ({"prompt": "x", "n": 2}, "n", "n=1"),
        ({"prompt": "x", "temperature": 5}, "temperature", "between 0 and 2"),
        ({"prompt": "x" * 40000}, "prompt", "the limit is 32000"),
    ],
)
def test_bad_completion_requests_are_400s_naming_the_field(server, body, param, message):
    response = _post(server, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_openai_client_completes_whole_and_streamed(server, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    _, text = _greedy(reference, PROMPT, 12)
    whole = client.completions.create(
        model="reference", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2
    )
    assert whole.choices[0].text == text
    assert len(whole.choices[0].logprobs.tokens) == len(whole.choices[0].logprobs.token_logprobs)
    assert whole.usage.completion_tokens >= len(whole.choices[0].logprobs.tokens)
    stream = client.completions.create(
        model="reference", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == text
    with pytest.raises(openai.BadRequestError, match="echo is not supported"):
        client.completions.create(model="reference", prompt=PROMPT, echo=True)


def test_completions_are_counted_in_metrics_as_chat_requests_are(server):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    def generated() -> float:
        body = httpx.get(f"{server.url}/metrics", timeout=30).text
        for family in text_string_to_metric_families(body):
            if family.name == "chatcli:generation_tokens":
                return sum(s.value for s in family.samples if s.name.endswith("_total"))
        return 0.0

    before = generated()
    usage = _post(server, {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}).json()["usage"]
    assert generated() == before + usage["completion_tokens"]
