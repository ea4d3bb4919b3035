"""`chatcli once --raw` continues the text exactly as given, as /v1/completions does: a
trailing space changes what a model writes next, so it is kept; from stdin only the line
break `echo` adds is dropped; an empty text is <|bos|> alone (a base model's unprompted
sample). The chat's `once` still trims its message."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.engine.engine import Engine
from chatcli.model.checkpoint import load_model
from chatcli.model.checkpoint_paths import EMBEDDED_DIR

runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in ("CHATCLI_TEMPERATURE", "CHATCLI_MODEL", "CHATCLI_CONFIG", "CHATCLI_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def embedded():
    model, tokenizer, _ = load_model(EMBEDDED_DIR / "chatsft_checkpoints" / "d6", device="cpu")
    return model, tokenizer


def _once(*args: str, stdin: str | None = None) -> dict:
    result = runner.invoke(app, ["once", "--raw", "--json", "-t", "0", *args], input=stdin)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _greedy(embedded, text: str, n: int) -> tuple[list[int], str]:
    model, tokenizer = embedded
    prompt = tokenizer.encode(text, prepend=tokenizer.get_bos_token_id())
    engine = Engine(model, tokenizer)
    tokens = [c[0] for c, _ in engine.generate(prompt, max_tokens=n, temperature=0)]
    body = tokens[:-1] if tokens[-1] in (engine.assistant_end, engine.bos) else tokens
    return prompt, tokenizer.decode(body)


def test_a_trailing_space_is_part_of_the_raw_prompt(embedded):
    # The embedded model goes on differently after "is" and after "is ".
    spaced, bare = "The capital of France is ", "The capital of France is"
    prompt, want = _greedy(embedded, spaced, 6)
    assert want != _greedy(embedded, bare, 6)[1]
    out = _once(spaced, "-n", "6")
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["text"] == want


def test_from_stdin_only_the_closing_line_break_is_dropped(embedded):
    prompt, want = _greedy(embedded, "The capital of France is ", 6)
    out = _once("-n", "6", stdin="The capital of France is \n")
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["text"] == want


def test_an_empty_raw_prompt_is_bos_alone(embedded):
    _, want = _greedy(embedded, "", 5)
    out = _once("", "-n", "5")
    assert out["usage"]["prompt_tokens"] == 1
    assert out["text"] == want


def test_the_chats_once_still_trims_and_refuses_an_empty_message():
    result = runner.invoke(app, ["once", "   "])
    assert result.exit_code != 0
    assert 'The prompt is empty: write the message, e.g. chatcli once "What is 12*7?"' in (
        result.output
    )
