"""/v1/completions' legacy logprobs as OpenAI documents them, through a batched server on the
embedded model: `text_offset` indexes `choices[0].text` when the continuation has special
tokens in it (a stray <|python_end|>, a calculator call the text shows as one `[calc ...]`
marker), and each `top_logprobs` object holds the sampled token beside the alternatives."""

from __future__ import annotations

import json

import httpx
import pytest
from serving import serve_workers

from chatcli.model.checkpoint_paths import EMBEDDED_DIR
from chatcli.serve.app import Limits, Worker

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")

# Greedy, the embedded model continues <|bos|>"What is 12*7?" with <|python_end|> (out of
# place: no text), the call 12*7 = 84 (the marker), then "12*7 = 84." and its end.
PROMPT = "What is 12*7?"
TEXT = "[calc 12*7 = 84]12*7 = 84."
MARKER = len("[calc 12*7 = 84]")
BODY = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "logprobs": 2}


@pytest.fixture(scope="module")
def server():
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(EMBEDDED_DIR / "chatsft_checkpoints" / "d6", device="cpu")
    srv = serve_workers([Worker(model, tokenizer, batch=8)], Limits(), "embedded")
    yield srv
    srv.stop()


def _check(text: str, logprobs: dict) -> None:
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert text == TEXT
    assert tokens[0] == "<|python_end|>" and offsets[0] == 0
    # The call's tokens, from <|python_start|> to <|output_end|>, all start at the marker.
    call = tokens.index("<|output_end|>") + 1
    call_tokens = ["<|python_start|>", "1", "2", "*", "7", "<|python_end|>"]
    assert tokens[1:call] == [*call_tokens, "<|output_start|>", "8", "4", "<|output_end|>"]
    assert offsets[:call] == [0] * call
    assert offsets[call] == MARKER
    for token, at in zip(tokens[call:], offsets[call:], strict=True):
        assert text[at : at + len(token)] == token
    assert "".join(tokens[call:]) == text[MARKER:]


def test_whole_completion_offsets_index_its_text_past_special_tokens(server):
    response = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    _check(choice["text"], choice["logprobs"])


def test_streamed_completion_offsets_index_the_joined_text(server):
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**BODY, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        body = response.read().decode()
    lines = [e.removeprefix("data: ") for e in body.split("\n\n") if e.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    text, merged = "", {"tokens": [], "text_offset": []}
    for chunk in map(json.loads, lines[:-1]):
        choice = chunk["choices"][0]
        text += choice["text"]
        for key in merged:
            merged[key] += choice["logprobs"][key]
    _check(text, merged)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_top_logprobs_hold_the_sampled_token_too_even_with_none_asked(server, stream):
    # OpenAI: "the API will always return the logprob of the sampled token, so there may be
    # up to logprobs+1 elements". At temperature 1.5 some tokens drawn are not the likeliest.
    for asked in (0, 1):
        body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.5}
        body.update(seed=11, logprobs=asked, stream=stream)
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        if stream:
            lines = [e.removeprefix("data: ") for e in response.text.split("\n\n")]
            chunks = [json.loads(e) for e in lines if e.startswith("{")]
            lps = [c["choices"][0]["logprobs"] for c in chunks]
        else:
            lps = [response.json()["choices"][0]["logprobs"]]
        tokens = [t for lp in lps for t in lp["tokens"]]
        values = [v for lp in lps for v in lp["token_logprobs"]]
        tops = [t for lp in lps for t in lp["top_logprobs"]]
        assert len(tokens) == 24
        unlikeliest = 0
        for token, value, top in zip(tokens, values, tops, strict=True):
            assert top[token] == value
            assert 1 <= len(top) <= asked + 1
            unlikeliest += value < max(top.values())
        if asked == 1:
            assert unlikeliest > 0  # the case OpenAI's +1 is for: a token drawn off the top
