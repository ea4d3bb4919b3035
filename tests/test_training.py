"""The training pipeline end to end in its tiny configuration (the full run is a script)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

pytest.importorskip("rustbpe", reason="training needs the train extra: pip install -e '.[train]'")

from chatcli.checkpoint import load_model
from chatcli.engine import Engine
from chatcli.special_tokens import SPECIAL_TOKENS
from chatcli.training.train import PRESETS, train


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    logs: list[str] = []
    ckpt = train(out, PRESETS["tiny"], seed=0, log=logs.append)
    return out, ckpt, logs


def test_writes_a_nanochat_layout_checkpoint(tiny_run):
    out, ckpt, _ = tiny_run
    assert ckpt == out / "chatsft_checkpoints" / "d2"
    meta_files = list(ckpt.glob("meta_*.json"))
    assert len(meta_files) == 1 and len(list(ckpt.glob("model_*.pt"))) == 1
    meta = json.loads(meta_files[0].read_text())
    assert set(meta["model_config"]) >= {
        "sequence_len",
        "vocab_size",
        "n_layer",
        "n_head",
        "n_kv_head",
        "n_embd",
        "window_pattern",
    }
    # nanochat's own loader reads a plain state_dict with weights_only=True
    sd = torch.load(next(ckpt.glob("model_*.pt")), weights_only=True)
    assert "smear_gate.weight" in sd and "transformer.wte.weight" in sd


def test_tokenizer_is_a_tiktoken_encoding_with_specials_last(tiny_run):
    out, _, _ = tiny_run
    with open(out / "tokenizer" / "tokenizer.pkl", "rb") as f:
        enc = pickle.load(f)  # our own file: a plain load is what nanochat does
    n = enc.n_vocab
    assert [enc._special_tokens[t] for t in SPECIAL_TOKENS] == list(range(n - 9, n))


def test_loss_falls_and_the_checkpoint_loads_and_generates(tiny_run):
    out, _, logs = tiny_run
    losses = [float(line.split("loss")[1].split()[0]) for line in logs if line.startswith("step")]
    assert losses[-1] < losses[0] - 1.0
    model, tokenizer, meta = load_model(out, device="cpu")
    assert model.arch.era == "E" and meta["train_steps"] == PRESETS["tiny"].steps
    prompt = tokenizer.render_for_completion([{"role": "user", "content": "What is 2+2?"}])
    results, _ = Engine(model, tokenizer).generate_batch(prompt, max_tokens=8, temperature=0.0)
    assert len(results[0]) > len(prompt)
