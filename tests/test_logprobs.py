"""Log-probabilities from the one generation loop, checked against the model itself.

Each produced token's logprob must equal log_softmax of the full forward's logits (the whole
sequence through model(ids), softcap included) at its position, for every era, on every
decode step path, for a row alone, /samples rows and a batch's slots joining at different
steps; calculator-forced tokens are marked forced; rows that did not ask get nothing.
"""

from __future__ import annotations

import pytest
import torch
from builders import random_gpt
from fakes import CHAT_PROMPT, DONE, ByteTokenizer, ScriptedModel, tool_call
from reference import REFERENCE, needs_reference
from step_paths import STEP_PATHS, NoStopsTokenizer, engine_on_path, random_prompt

from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.logprobs import LogprobRecord, TokenLogprob
from chatcli.engine.scheduler import RowRequest, Scheduler
from chatcli.model.gpt import ERAS

# fp32 logits through different kernels agree to ~1e-5; log_softmax adds no more than that.
TOLERANCE = 2e-4


@torch.inference_mode()
def _full_forward(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of model(prompt + tokens) at the positions that chose `tokens`: (T, V)."""
    logits = model(torch.tensor([prompt + tokens]))[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def _check(model, prompt: list[int], entries: list[TokenLogprob], top: int) -> None:
    tokens = [e.token for e in entries]
    want = _full_forward(model, prompt, tokens)
    for i, e in enumerate(entries):
        if e.forced:  # the calculator's: no probability to check
            continue
        assert e.logprob == pytest.approx(want[i, e.token].item(), abs=TOLERANCE), i
        values, ids = torch.topk(want[i], top)
        assert [t for t, _ in e.top] == ids.tolist() or _ties(values), i
        assert [v for _, v in e.top] == pytest.approx(values.tolist(), abs=TOLERANCE), i


def _ties(values: torch.Tensor) -> bool:
    """Whether neighbours of a top-k are within rounding (their order may differ then)."""
    return bool((values[:-1] - values[1:]).abs().min() < TOLERANCE) if values.numel() > 1 else False


@pytest.mark.parametrize("path", STEP_PATHS)
@pytest.mark.parametrize("era", list(ERAS))
def test_each_tokens_logprob_is_the_full_forwards_log_softmax_alone(era, path):
    model = random_gpt(era)
    engine = engine_on_path(model, path)
    prompt = random_prompt(37, seed=3)
    record = LogprobRecord(top=5)
    tokens = []
    # The chat's defaults (temperature 0.6, top-k 50) reshape the draw, not the reported
    # distribution: that stays the model's own at temperature 1.
    for column, masks in engine.generate(
        prompt, max_tokens=20, temperature=0.6, top_k=50, seed=11, logprobs=record
    ):
        tokens.append(column[0])
        assert masks == [1]
    entries = [c[0] for c in record.columns]
    assert [e.token for e in entries] == tokens and len(tokens) == 20
    assert all(len(e.top) == 5 and not e.forced for e in entries)
    _check(model, prompt, entries, 5)


@pytest.mark.parametrize("path", ["kernel", "torch", "static"])
@pytest.mark.parametrize("era", ["A", "E"])
def test_sample_rows_each_get_their_own_tokens_logprobs(era, path):
    model = random_gpt(era)
    engine = engine_on_path(model, path)
    prompt = random_prompt(21, seed=4)
    record = LogprobRecord(top=3)
    columns = list(engine.generate(prompt, 3, max_tokens=12, temperature=1.0, logprobs=record))
    assert len(record.columns) == len(columns) == 12
    for row in range(3):
        entries = [c[row] for c in record.columns]
        assert [e.token for e in entries] == [c[0][row] for c in columns]
        _check(model, prompt, entries, 3)


@pytest.mark.parametrize("path", STEP_PATHS)
@pytest.mark.parametrize("era", list(ERAS))
def test_a_batchs_rows_joining_at_different_steps_get_the_full_forwards_logprobs(era, path):
    model = random_gpt(era)
    batch = Scheduler(engine_on_path(model, path), rows=3, prefill_chunk=16)
    # A prompt longer than the chunk prefills over several steps beside the others' decode.
    requests = [
        RowRequest(random_prompt(9, 5), max_tokens=15, temperature=0.0, logprobs=2),
        RowRequest(random_prompt(40, 6), max_tokens=15, temperature=0.9, seed=3, logprobs=20),
        RowRequest(random_prompt(14, 7), max_tokens=15, temperature=0.7, top_p=0.8, seed=4),
    ]
    join_at = [0, 1, 3]
    entries: dict[int, list[TokenLogprob]] = {0: [], 1: []}
    tokens: dict[int, list[int]] = {2: []}
    rows: list = [None] * 3
    step = 0
    while step <= max(join_at) or batch.running:
        for i, at in enumerate(join_at):
            if at == step:
                rows[i] = batch.join(requests[i])
        for row, token, _mask in batch.step().tokens:
            i = rows.index(row)
            if i == 2:
                assert row.logprobs is None  # it did not ask: nothing computed
                tokens[2].append(token)
            else:
                assert row.logprobs is not None and row.logprobs[0].token == token
                entries[i].append(row.logprobs[0])
        step += 1
    assert len(entries[0]) == len(entries[1]) == len(tokens[2]) == 15
    _check(model, requests[0].tokens, entries[0], 2)
    _check(model, requests[1].tokens, entries[1], 20)


def test_calculator_forced_tokens_are_marked_forced_with_no_probability():
    tok = ByteTokenizer()
    model = ScriptedModel(tool_call("12*7", DONE))
    record = LogprobRecord(top=2)
    columns = list(Engine(model, tok).generate(CHAT_PROMPT, temperature=0.0, logprobs=record))
    entries = [c[0] for c in record.columns]
    forced = [e for e, (_, m) in zip(entries, columns, strict=True) if m == [0]]
    # <|output_start|> 8 4 <|output_end|>: the calculator's, none of the model's choosing.
    assert tok.decode([e.token for e in forced]) == "<|output_start|>84<|output_end|>"
    assert all(e.forced and e.logprob is None and e.top == () for e in forced)
    chosen = [e for e in entries if not e.forced]
    # The scripted model puts nearly all the mass on its one token: logprob ~0.
    assert chosen and all(-1e-6 < e.logprob <= 0 for e in chosen)
    assert all(e.top[0] == (e.token, e.logprob) for e in chosen)


def test_a_generation_that_does_not_ask_records_nothing_and_out_of_range_is_refused():
    model = random_gpt("E")
    engine = Engine(model, NoStopsTokenizer())
    stats = GenerationStats()
    assert len(list(engine.generate(random_prompt(5, 1), max_tokens=3, stats=stats))) == 3
    with pytest.raises(ValueError, match="between 0 and 20"):
        engine.generate(random_prompt(5, 1), max_tokens=3, logprobs=LogprobRecord(top=21))
    with pytest.raises(ValueError, match="between 0 and 20"):
        Scheduler(engine).join(RowRequest(random_prompt(5, 1), max_tokens=3, logprobs=-1))


@needs_reference
@pytest.mark.parametrize("era", ["A", "E"])
def test_nanochats_own_checkpoints_logprobs_equal_their_full_forward(era):
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(REFERENCE / era, device="cpu")
    prompt = tokenizer.render_for_completion(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    record = LogprobRecord(top=4)
    list(Engine(model, tokenizer).generate(prompt, max_tokens=16, temperature=1.0, logprobs=record))
    entries = [c[0] for c in record.columns]
    assert len(entries) == 16 or entries[-1].token == tokenizer.encode_special("<|assistant_end|>")
    _check(model, prompt, entries, 4)
