"""The int8 and int4 decode copies stay within measured bounds of fp32's logits and greedy
replies (scripts/quantized_quality.py), on the embedded model and the era A and E reference
fixtures, through the engine's decode step (our kernel's, torch's ops, and fbgemm's where the
kernels are off) and a server's batch. The bounds hold torch's weight-only int8 too (where
fbgemm is missing: ARM), measured at 0.014, 1.6e-5 and 0.23 on the embedded model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from reference import REFERENCE, needs_reference

from chatcli.kernels.f16_matvec import f16_matvec
from chatcli.kernels.f16_rows import f16_rows
from chatcli.kernels.rows_step import rows_step
from chatcli.model.quantize import fbgemm_available

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "quantized_quality.py"
# The embedded model's int4 copy: only the MLPs' output projections take inputs (768) in
# whole groups of 128; the rest (192 inputs) keep fp32. 6 * 192 * 768 of its weights.
EMBEDDED_INT4_SHARE = 6 * 192 * 768 / 2_850_816


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("quantized_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def kernels_off(monkeypatch):
    """The copies and steps as a machine without our kernels builds them."""
    monkeypatch.setenv("CHATCLI_NATIVE_KERNELS", "0")
    for kernel in (f16_matvec, f16_rows, rows_step):
        kernel.cache_clear()
    yield
    monkeypatch.delenv("CHATCLI_NATIVE_KERNELS")
    for kernel in (f16_matvec, f16_rows, rows_step):
        kernel.cache_clear()


def by_kind(rows, kind):
    return [r for r in rows if r.kind == kind]


def test_agreement_counts_tokens_up_to_the_first_difference(quality):
    ours = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    theirs = [[1, 2, 0, 4], [5, 6], [7, 8]]
    share, identical = quality.agreement(ours, theirs)
    assert share == pytest.approx((2 + 2 + 2) / (4 + 2 + 3))
    assert identical == 1


def test_logit_error_of_a_shifted_and_a_swapped_row(quality):
    reference = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 0.0]])
    same = quality.logit_error(reference, reference.clone())
    assert same == {"max_abs": 0.0, "mean_rel": 0.0, "kl": 0.0, "top1": 1.0}
    # A constant shift leaves the softmax as it is; the top token of row 2 moves.
    copy = torch.tensor([[0.5, 1.5, 2.5, 3.5], [0.0, 3.0, 0.0, 0.0]])
    error = quality.logit_error(reference, copy)
    assert error["max_abs"] == 3.0
    assert error["top1"] == 0.5
    assert error["mean_rel"] == pytest.approx((0.5 / reference[0].std() + 1.5 / 1.5) / 2)
    p = torch.softmax(reference[1], 0)
    q = torch.softmax(copy[1], 0)
    assert error["kl"] == pytest.approx((p * (p / q).log()).sum().item() / 2, rel=1e-5)


@needs_reference
def test_teacher_forced_logits_are_the_full_forwards_and_batched_replies_a_turns(quality):
    from chatcli.engine.engine import Engine

    model, tokenizer = quality.load_for_chat(str(REFERENCE / "E"), "none")
    engine = Engine(model, tokenizer)
    prompt = quality.chat_prompts(tokenizer, 1, 20, model.config.sequence_len)[0]
    reply = quality.greedy_replies(engine, [prompt], 20)[0]
    assert len(reply) >= 2
    forced = quality.forced_logits(engine, prompt, reply)
    with torch.inference_mode():
        full = model(torch.tensor([prompt + reply[:-1]]))[0, len(prompt) - 1 :]
    assert forced.shape == (len(reply), model.config.vocab_size)
    torch.testing.assert_close(forced, full, atol=1e-4, rtol=1e-4)
    # Greedy: each reply token is its position's top logit (a random model calls no tool).
    assert forced.argmax(-1).tolist() == reply
    # A server's batch (three clients at once, prompts in chunks beside decode rows) gives
    # fp32's replies as a chat turn does, so the copies' batched agreement is comparable.
    prompts = quality.chat_prompts(tokenizer, 3, 20, model.config.sequence_len)
    replies = quality.greedy_replies(engine, prompts, 20)
    assert quality.batched_replies(engine, prompts, 20) == replies
    assert sum(map(len, replies)) > 30


def check_embedded_int8(rows, bounds):
    mean_rel, kl, max_abs = bounds
    for r in by_kind(rows, "int8"):
        assert r.quantized > 0.9999
        assert r.positions > 100  # 6 prompts, most replies long
        assert r.top1 >= 0.99, r
        assert r.mean_rel < mean_rel, r
        assert r.kl < kl, r
        assert r.max_abs < max_abs, r
        assert r.greedy >= 0.95 and r.identical >= 5, r
        assert r.batched >= 0.95, r  # six clients at once in a server's batch


def test_the_embedded_models_copies_stay_close_to_fp32_as_chat_loads_them(quality):
    rows = quality.measure(quality.checkpoint_loader(None), "embedded", prompts=6, tokens=32)
    if rows_step() is not None:  # our kernel's step, then torch's ops over our int8 product
        assert [r.step for r in by_kind(rows, "int8")] == [
            "rows_step int8",
            "ops, rows_int8_product",
        ]
        # Weight-only, fp32 activations and sums: measured 0.0106, 3.4e-5 and 0.17.
        check_embedded_int8(rows, (0.016, 1.5e-4, 0.35))
    else:
        check_embedded_int8(rows, (0.035, 2e-3, 0.7))
    (int4,) = by_kind(rows, "int4")
    assert int4.quantized == pytest.approx(EMBEDDED_INT4_SHARE, abs=1e-4)
    # Only a third of its matrices are int4, so no whole step reads them: torch's ops over
    # each copy's own product (ours where the CPU has integer dot products).
    kernel = rows_step()
    native = kernel is not None and kernel.int4_panel
    assert int4.step == ("ops, rows_int4_product" if native else "ops, torch int4 weight-only")
    # Measured: top-1 0.99, mean |d|/sd 0.043, KL 9.7e-4, max |d| 0.73, greedy 1.0.
    assert int4.top1 >= 0.97, int4
    assert int4.mean_rel < 0.07, int4
    assert int4.kl < 3e-3, int4
    assert int4.max_abs < 1.5, int4
    assert int4.greedy >= 0.8 and int4.batched >= 0.8, int4


def test_the_embedded_models_copies_stay_close_to_fp32_without_our_kernels(quality, kernels_off):
    load = quality.checkpoint_loader(None)
    rows = quality.measure(load, "embedded", ("int8",), prompts=6, tokens=32)
    int8_product = "fbgemm int8" if fbgemm_available() else "torch int8 weight-only"
    assert [r.step for r in rows] == [f"ops, {int8_product}"]
    # fbgemm rounds each call's activations to 7 bits too: measured 0.021, 7.7e-4 and 0.36.
    check_embedded_int8(rows, (0.035, 2e-3, 0.7))


@needs_reference
@pytest.mark.parametrize("era", ["A", "E"])
def test_a_reference_fixtures_copies_stay_within_their_measured_error(quality, era):
    # Step-1 weights: flat logits whose top tokens lie close, so top-1 and greedy agreement
    # are low for any rounding; the logit error is what a quantizer's regression moves.
    rows = quality.measure(
        quality.checkpoint_loader(str(REFERENCE / era)), era, prompts=4, tokens=24, ops_too=False
    )
    (int8,) = by_kind(rows, "int8")
    (int4,) = by_kind(rows, "int4")
    assert int8.positions > 60 and int4.positions == int8.positions
    # Measured (kernel step, A and E): mean |d|/sd 0.010-0.013, KL 0.9-1.3e-4, top-1 0.96-0.97.
    assert int8.mean_rel < 0.03 and int8.kl < 6e-4 and int8.top1 >= 0.9, int8
    # int4 (its MLP output projections only): mean |d|/sd 0.08-0.10, KL 5-7.5e-3, top-1 0.78-0.96.
    assert int4.mean_rel < 0.15 and int4.kl < 0.02 and int4.top1 >= 0.65, int4
    assert int4.mean_rel > int8.mean_rel and int4.kl > int8.kl


@needs_reference
def test_the_script_prints_a_json_row_per_copy_and_refuses_a_missing_model(quality, capsys):
    quality.main(["-m", str(REFERENCE / "E"), "--prompts", "2", "--tokens", "8", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert [(r["kind"], r["era"], r["replies"]) for r in rows][-1] == ("int4", "E", 2)
    assert {r["kind"] for r in rows} == {"int8", "int4"}
    # Every copy reads fp32's two replies of up to 8 tokens (a stop token may end one).
    assert len({r["positions"] for r in rows}) == 1 and 2 <= rows[0]["positions"] <= 16
    assert all(r["model"] == "E" and 0 < r["kl"] < 0.05 for r in rows)
    with pytest.raises(SystemExit, match="Error: No model at /nonexistent"):
        quality.main(["-m", "/nonexistent"])
    with pytest.raises(SystemExit, match="--kinds takes int8, int4; not 'int2'"):
        quality.main(["--kinds", "int2"])


def test_the_teacher_is_fp32_throughout_where_chat_would_give_a_large_model_16_bit_copies(
    quality, monkeypatch
):
    from chatcli.model import model_build

    monkeypatch.setattr(model_build, "LARGE_MODEL_MATRIX_PARAMS", 0)  # the embedded is "large"
    assert model_build.pick_precision(torch.device("cpu")).decode is None  # the default's
    assert model_build.pick_precision(torch.device("cpu"), matrix_params=1).decode is not None
    fp32, _ = quality.checkpoint_loader(None)("none")
    assert fp32.decode_weights() == []
    int8, _ = quality.checkpoint_loader(None)("int8")
    assert {type(w).__name__ for w in int8.decode_weights()} == {"Int8Weight"}
