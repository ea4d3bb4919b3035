"""`chatcli once --logprobs K --json` and `chatcli once --raw` through the real CLI: each
token's logprob is the model's own (the full forward's log_softmax), calculator results are
marked forced, and a raw completion is the model's continuation of <|bos|> + the text."""

from __future__ import annotations

import json

import pytest
import torch
from reference import REFERENCE, needs_reference
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.engine.engine import Engine
from chatcli.model.special_tokens import SPECIAL_TOKENS

runner = CliRunner()
FIXTURE = REFERENCE / "E"
TOLERANCE = 2e-4


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in ("CHATCLI_TEMPERATURE", "CHATCLI_MODEL", "CHATCLI_CONFIG", "CHATCLI_URL"):
        monkeypatch.delenv(name, raising=False)


def _token_id(tokenizer, raw: list[int]) -> int:
    """A listed token's id, read back from its bytes (a special token's are its name)."""
    text = bytes(raw).decode("utf-8", errors="replace")
    if text in SPECIAL_TOKENS:
        return tokenizer.encode_special(text)
    return tokenizer.enc.encode_single_token(bytes(raw))


def _once(*args: str) -> dict:
    result = runner.invoke(app, ["once", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _full_forward(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens]))[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


@needs_reference
def test_once_json_logprobs_are_the_models_own_for_each_token():
    from chatcli.model.checkpoint import load_model

    question = "Tell me about the moon."
    args = ["--model", str(FIXTURE), "--json", "--logprobs", "4", "-n", "20", "--seed", "3"]
    out = _once(question, *args)
    content = out["logprobs"]["content"]
    model, tokenizer, _ = load_model(FIXTURE, device="cpu")
    ids = [_token_id(tokenizer, e["bytes"]) for e in content]
    assert len(ids) == out["usage"]["completion_tokens"] - (out["finish_reason"] == "stop")
    prompt = tokenizer.render_for_completion([{"role": "user", "content": question}])
    want = _full_forward(model, prompt, ids)
    for i, (entry, token) in enumerate(zip(content, ids, strict=True)):
        assert entry["logprob"] == pytest.approx(want[i, token].item(), abs=TOLERANCE)
        values = torch.topk(want[i], 4).values.tolist()
        assert [a["logprob"] for a in entry["top_logprobs"]] == pytest.approx(values, abs=TOLERANCE)


def test_once_json_logprobs_mark_the_calculators_result_forced():
    # The embedded model answers arithmetic with a calculator call at once.
    out = _once("What is 1234*56?", "--json", "--logprobs", "1", "-t", "0", "-n", "16")
    content = out["logprobs"]["content"]
    forced = [e["token"] for e in content if e.get("chatcli_forced")]
    assert "".join(forced) == "<|output_start|>69104<|output_end|>"
    assert all(e["logprob"] is None for e in content if e.get("chatcli_forced"))
    assert all(e["logprob"] <= 0 for e in content if not e.get("chatcli_forced"))
    # Without --logprobs the JSON has no logprobs.
    assert "logprobs" not in _once("What is 2+2?", "--json", "-t", "0", "-n", "4")


@needs_reference
def test_once_raw_is_the_greedy_continuation_of_bos_and_the_text():
    from chatcli.model.checkpoint import load_model

    text = "The quick brown fox jumps over"
    out = _once("--raw", text, "--model", str(FIXTURE), "--json", "-t", "0", "-n", "12")
    model, tokenizer, _ = load_model(FIXTURE, device="cpu")
    prompt = tokenizer.encode(text, prepend=tokenizer.get_bos_token_id())
    engine = Engine(model, tokenizer)
    tokens = [c[0] for c, _ in engine.generate(prompt, max_tokens=12, temperature=0)]
    ends = (engine.assistant_end, engine.bos)
    body = tokens[:-1] if tokens[-1] in ends else tokens
    assert out["text"] == tokenizer.decode(body)
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["finish_reason"] == ("stop" if tokens[-1] in ends else "length")


def test_once_raw_with_logprobs_lists_each_token():
    out = _once("--raw", "Once upon a time", "--json", "--logprobs", "2", "-t", "0", "-n", "6")
    content = out["logprobs"]["content"]
    text = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", errors="replace")
    assert text == out["text"] and len(content) == out["usage"]["completion_tokens"]
    # Greedy: each token is its position's likeliest.
    assert all(e["top_logprobs"][0]["logprob"] == e["logprob"] for e in content)
    # Streamed to the terminal (the default): the same text.
    streamed = runner.invoke(app, ["once", "--raw", "Once upon a time", "-t", "0", "-n", "6"])
    assert streamed.exit_code == 0 and streamed.output.strip() == out["text"].strip()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["hi", "--logprobs", "3"], "--logprobs is printed in the JSON: add --json."),
        (["hi", "--json", "--logprobs", "21"], "--logprobs 21 is out of range: give 0 to 20."),
        (["--raw", "hi", "--system", "be brief"], "drop --system"),
        (["--raw", "hi", "--url", "http://127.0.0.1:9"], "--raw runs on a local model"),
    ],
)
def test_once_flags_that_do_not_go_together_are_one_line_usage_errors(args, message):
    result = runner.invoke(app, ["once", *args])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_once_over_a_server_gives_the_servers_logprobs_as_a_local_run_gives_them():
    pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
    from serving import serve_workers

    from chatcli.model.checkpoint import load_model
    from chatcli.serve.app import Worker

    model, tokenizer, _ = load_model(None, device="cpu")
    args = ["What is the capital of France?", "--json", "--logprobs", "2", "-t", "0", "-n", "12"]
    local = _once(*args)
    server = serve_workers([Worker(model, tokenizer)], name="embedded")
    try:
        remote = _once(*args, "--url", server.url)
    finally:
        server.stop()
    want, got = local["logprobs"]["content"], remote["logprobs"]["content"]
    assert [e["token"] for e in got] == [e["token"] for e in want] and got
    assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in want], abs=1e-4)
    assert remote["text"] == local["text"]
