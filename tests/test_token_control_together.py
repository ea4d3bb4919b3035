"""Logprobs and a grammar on the same row: the logprobs stay the model's own distribution
(read before the grammar's mask), and once's --raw refuses a schema it could not follow."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip(
    "llguidance", reason="needs the structured extra: pip install -e '.[structured]'"
)

from chatcli.cli.app import app
from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.grammar import json_grammar
from chatcli.engine.logprobs import LogprobRecord
from chatcli.model.checkpoint import load_model

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"}},
    "required": ["color", "n"],
    "additionalProperties": False,
}


@torch.inference_mode()
def test_a_constrained_rows_logprobs_are_the_models_own_not_the_masked_ones():
    model, tokenizer, _ = load_model(None, device="cpu")
    prompt = tokenizer.render_for_completion([{"role": "user", "content": "Pick a color."}])
    record = LogprobRecord(3)
    stats = GenerationStats()
    tokens = []
    for column, _ in Engine(model, tokenizer).generate(
        prompt,
        max_tokens=40,
        temperature=1.0,
        seed=3,
        stats=stats,
        logprobs=record,
        grammar=json_grammar(SCHEMA),
    ):
        tokens.append(column[0])
    assert stats.finish_reasons == ["stop"]
    value = json.loads(tokenizer.decode(tokens[:-1]))
    assert value["color"] in ("red", "green", "blue")
    entries = [column[0] for column in record.columns]
    assert [e.token for e in entries] == tokens and len(entries) >= 5
    logits = model(torch.tensor([prompt + tokens]))[0].float().log_softmax(-1)
    for i, entry in enumerate(entries):
        want = logits[len(prompt) - 1 + i]
        assert entry.logprob == pytest.approx(want[entry.token].item(), abs=2e-4)
        # The alternatives are the model's likeliest, not only what the grammar allowed:
        # the first one is the unmasked argmax.
        assert entry.top[0][0] == int(want.argmax())
    # Somewhere the grammar forced a token the model did not rank first.
    assert any(e.top[0][0] != e.token for e in entries)


def test_once_raw_with_a_schema_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(app, ["once", "--raw", "--format", "json", "The sky is"])
    assert result.exit_code == 2
    assert "--raw continues the text freely" in result.output
