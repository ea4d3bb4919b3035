"""The embedded default model ships in the package, loads offline, and does its job."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from chatcli.model import checkpoint
from chatcli.model.checkpoint import EMBEDDED_DIR, load_model
from chatcli.model.quantize import Int8Weight
from chatcli.training import evaluate as evaluate_module
from chatcli.training.eval_sets import BASE_EVAL_KINDS
from chatcli.training.evaluate import evaluate

pytestmark = pytest.mark.skipif(
    not (EMBEDDED_DIR / "chatsft_checkpoints").is_dir(), reason="embedded model not built"
)


def test_ships_small_and_loads_fast():
    size = sum(f.stat().st_size for f in EMBEDDED_DIR.rglob("*") if f.is_file())
    assert size < 8 * 2**20
    t0 = time.perf_counter()
    model, tokenizer, meta = load_model(device="cpu")
    assert time.perf_counter() - t0 < 1.0
    assert model.info.embedded and model.arch.era == "E"
    assert tokenizer.get_vocab_size() == meta["model_config"]["vocab_size"]


def test_held_out_smoke_evaluation():
    model, tokenizer, _ = load_model(device="cpu")
    summary = evaluate(model, tokenizer, n_per_kind=8, seed=99, kinds=BASE_EVAL_KINDS)
    assert summary["items"] == 40
    # Floors just under what the shipped model scores on these 40 prompts (greedy, so a
    # drop means the model or the engine changed): 1.0 on every measure, exact calls
    # included. The full held-out numbers are in docs/models.md.
    assert summary["arithmetic_accuracy"] >= 0.95
    assert summary["counting_accuracy"] >= 0.95
    assert summary["followup_accuracy"] >= 0.95
    for kind in ("arithmetic", "counting", "followup"):
        assert summary[f"{kind}_exact_call"] >= 0.95, kind
    assert summary["ended_rate"] == 1.0
    assert summary["tool_call_rate"] == 1.0
    assert summary["identity_accuracy"] == 1.0
    assert summary["out_of_scope_accuracy"] == 1.0


def test_once_answers_through_the_calculator_offline():
    out = subprocess.run(
        [sys.executable, "-m", "chatcli", "once", "What is 1234*56?", "--json", "-t", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout)
    assert "69104" in result["text"]
    assert {"type": "python", "text": "1234*56"} in result["parts"]
    assert {"type": "python_output", "text": "69104"} in result["parts"]
    assert result["finish_reason"] == "stop"


def test_the_evaluation_command_can_run_through_int8_copies(capsys, monkeypatch):
    loaded = []

    def load_and_keep(*args, **kwargs):
        result = load_model(*args, **kwargs)
        loaded.append(result[0])
        return result

    monkeypatch.setattr(checkpoint, "load_model", load_and_keep)
    evaluate_module.main(
        ["--n", "2", "--quantize", "int8", "--json", "--temperature", "0", "--kinds", "base"]
    )
    [result] = json.loads(capsys.readouterr().out)["results"]
    [summary] = result["runs"]
    assert summary["items"] == 10 and summary["ended_rate"] > 0
    assert any(isinstance(c, Int8Weight) for c in loaded[0].decode_weights())
