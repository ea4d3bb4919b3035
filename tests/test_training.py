"""The training pipeline end to end in its tiny configuration (the full run is a script)."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import torch

pytest.importorskip("rustbpe", reason="training needs the train extra: pip install -e '.[train]'")

from chatcli.engine.engine import Engine
from chatcli.model.checkpoint import load_model
from chatcli.model.gpt import ERAS, GPT, GPTConfig
from chatcli.model.special_tokens import SPECIAL_TOKENS
from chatcli.model.tokenizer import encoding_parts
from chatcli.training.train import PRESETS, WeightAverage, main, train


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


def test_vocabulary_tables_are_saved_padded_to_a_multiple_of_64_as_nanochat_reads_them(tiny_run):
    _, ckpt, _ = tiny_run
    vocab = json.loads(next(ckpt.glob("meta_*.json")).read_text())["model_config"]["vocab_size"]
    sd = torch.load(next(ckpt.glob("model_*.pt")), weights_only=True)
    tables = [k for k in sd if k in ("transformer.wte.weight", "lm_head.weight")]
    tables += [k for k in sd if k.startswith("value_embeds.")]
    assert vocab == 300 and len(tables) == 3  # the tiny preset's vocabulary: not a multiple
    for k in tables:
        assert sd[k].shape[0] == 320, k
        assert not sd[k][vocab:].any() and sd[k][:vocab].abs().sum(dim=1).all(), k


def test_tokenizer_is_a_tiktoken_encoding_with_specials_last(tiny_run):
    out, _, _ = tiny_run
    with open(out / "tokenizer" / "tokenizer.pkl", "rb") as f:
        enc = pickle.load(f)  # our own file: a plain load is what nanochat does
    n = enc.n_vocab
    assert [encoding_parts(enc).special_tokens[t] for t in SPECIAL_TOKENS] == list(range(n - 9, n))


def test_loss_falls_and_the_checkpoint_loads_and_generates(tiny_run):
    out, _, logs = tiny_run
    losses = [float(line.split("loss")[1].split()[0]) for line in logs if line.startswith("step")]
    assert losses[-1] < losses[0] - 1.0
    model, tokenizer, meta = load_model(out, device="cpu")
    assert model.arch.era == "E" and meta["train_steps"] == PRESETS["tiny"].steps
    assert meta["weights"].startswith("moving average") and (out / "last_step_weights.pt").exists()
    prompt = tokenizer.render_for_completion([{"role": "user", "content": "What is 2+2?"}])
    results, _ = Engine(model, tokenizer).generate_batch(prompt, max_tokens=8, temperature=0.0)
    assert len(results[0]) > len(prompt)


def test_weight_average_is_a_plain_mean_then_exponential():
    model = GPT(
        GPTConfig(sequence_len=16, vocab_size=32, n_layer=1, n_head=1, n_kv_head=1, n_embd=8),
        ERAS["E"],
    )
    weight = model.transformer.wte.weight
    values = [1.0, 2.0, 6.0, 10.0, 14.0]
    with torch.no_grad():
        weight.fill_(values[0])
    average = WeightAverage(model, decay=0.75)  # a horizon of four steps
    seen = []
    for v in values[1:]:
        with torch.no_grad():
            weight.fill_(v)
        average.update(model)
        seen.append(average.state["transformer.wte.weight"][0, 0].item())
    # the mean of the first 2, 3 and 4 values; then 4.75 + 0.25 * (14 - 4.75)
    assert seen == pytest.approx([1.5, 3.0, 4.75, 7.0625])
    average.load_into(model)
    assert torch.allclose(weight, torch.full_like(weight, 7.0625))


def test_a_run_that_ends_in_the_warmup_says_the_model_has_barely_learned(tmp_path):
    # A tiny run cut off after at most a few steps by a budget of a fraction of a second.
    preset = dataclasses.replace(PRESETS["tiny"], minutes=0.0001, conversations=200)
    logs: list[str] = []
    train(tmp_path, preset, seed=0, log=logs.append)
    assert any(line.startswith("warning: only") and "barely learned" in line for line in logs)
    # and that the cap, not the steps, ended it: not the preset's model
    assert any("--minutes stopped the run" in line for line in logs)
    meta = json.loads(next((tmp_path / "chatsft_checkpoints").glob("*/meta_*.json")).read_text())
    assert meta["stopped_by"] == "time cap"


def test_the_schedule_follows_the_steps_alone_so_a_run_is_repeatable(tmp_path, tiny_run):
    # Same preset and seed, another run, the host's speed whatever it is: the same weights.
    _, ckpt, _ = tiny_run
    again = train(tmp_path, PRESETS["tiny"], seed=0, log=lambda _: None)
    for name in ("model_000150.pt",):
        assert (ckpt / name).read_bytes() == (again / name).read_bytes()
    meta = json.loads((ckpt / "meta_000150.json").read_text())
    assert (meta["train_steps"], meta["stopped_by"]) == (150, "steps")


@pytest.mark.parametrize("minutes", ["0", "-1", "nan"])
def test_a_time_cap_must_be_above_zero(minutes, capsys):
    with pytest.raises(SystemExit):
        main(["--out", "/tmp/never", "--preset", "tiny", "--minutes", minutes])
    assert "must be more than 0" in capsys.readouterr().err


def test_a_whole_run_gives_no_such_warning(tiny_run):
    _, _, logs = tiny_run
    assert not any("barely learned" in line for line in logs)


def test_too_few_steps_asked_says_more_steps_not_more_minutes(tmp_path):
    preset = dataclasses.replace(PRESETS["tiny"], steps=6, conversations=200)
    logs: list[str] = []
    train(tmp_path, preset, seed=0, log=logs.append)
    [warning] = [line for line in logs if "barely learned" in line]
    assert warning.endswith("Give it more --steps.")


def test_bf16_products_train_a_model_of_their_own_and_repeatably(tmp_path):
    # The default preset's bf16 autocast: it must reach the products (other weights than the
    # same run in fp32), keep the weights finite, and stay repeatable run to run.
    fp32 = dataclasses.replace(PRESETS["tiny"], steps=20, conversations=200, average_from=None)
    bf16 = dataclasses.replace(fp32, bf16=True)
    assert PRESETS["default"].bf16 and not PRESETS["tiny"].bf16
    runs = {
        name: train(tmp_path / name, preset, seed=0, log=lambda _: None)
        for name, preset in (("fp32", fp32), ("bf16", bf16), ("bf16-again", bf16))
    }
    weights = {name: torch.load(ckpt / "model_000020.pt") for name, ckpt in runs.items()}
    assert all(torch.isfinite(w).all() for w in weights["bf16"].values())
    assert any(not torch.equal(weights["fp32"][k], weights["bf16"][k]) for k in weights["fp32"])
    for k, w in weights["bf16"].items():
        assert torch.equal(w, weights["bf16-again"][k]), k
