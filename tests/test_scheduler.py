"""The one generation loop: a chat turn (Engine.generate) and a server's batch (Scheduler.join)
take their tokens, masks, finish reasons, argument checks and timings from the same code."""

from __future__ import annotations

import time

import pytest
import torch
from builders import random_gpt
from fakes import (
    CHAT_PROMPT,
    DONE,
    SPECIAL_IDS,
    ByteTokenizer,
    ScriptedModel,
    SlotScriptedModel,
    tool_call,
    uniform_bytes,
)

from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.scheduler import RowRequest, Scheduler
from chatcli.errors import ContextOverflowError
from chatcli.model.special_tokens import ASSISTANT_END, BOS

TOK = ByteTokenizer()
END = SPECIAL_IDS[ASSISTANT_END]
PROMPT = CHAT_PROMPT


def _batched(engine: Engine, request: RowRequest, wait_s: float = 0.0):
    """`request` as a server's row: its tokens, masks and the generation (its stats)."""
    scheduler = Scheduler(engine, rows=2)
    gen = scheduler.join(request)
    tokens, masks = [], []
    while not gen.done:
        for _, token, mask in scheduler.step().tokens:
            tokens.append(token)
            masks.append(mask)
        time.sleep(wait_s)  # the worker's own time between steps (writing chunks)
    return tokens, masks, gen


def test_decode_seconds_are_the_loops_own_time_on_both_paths():
    # A consumer that takes 20 ms a token: none of it is decode time, under Engine.generate
    # (a chat turn, --batch 1) and in a batch (--batch N) alike.
    model = random_gpt("E")
    engine = Engine(model, TOK)
    prompt = list(range(3, 40))
    stats = GenerationStats()
    t0 = time.perf_counter()
    for _ in engine.generate(prompt, max_tokens=12, temperature=0.0, stats=stats):
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    _, _, gen = _batched(Engine(model, TOK), RowRequest(prompt, 12, 0.0), wait_s=0.02)
    for s in (stats, gen.stats):
        assert s.steps == 12
        assert 0 < s.first_token_s < s.prefill_s + 0.02
        assert 0 < s.decode_s < 11 * 0.02  # the eleven sleeps after the first token left out
        assert s.decode_tps == (s.steps - 1) / s.decode_s
    assert stats.decode_s < wall - 11 * 0.02


def test_a_negative_temperature_is_refused_before_anything_runs_on_both_paths():
    model = ScriptedModel(tool_call("1+1", DONE))
    engine = Engine(model, TOK)
    with pytest.raises(ValueError, match="temperature must be non-negative"):
        engine.generate(PROMPT, temperature=-0.5)  # at the call, not at the first step
    with pytest.raises(ValueError, match="temperature must be non-negative"):
        Scheduler(engine).join(RowRequest(PROMPT, temperature=-0.5))
    assert model.histories == []  # no prefill ran
    with pytest.raises(ContextOverflowError):
        Scheduler(engine).join(RowRequest(list(range(300))))


def test_a_sample_row_that_ended_yields_filler_of_mask_0_while_the_others_go_on():
    # Row lengths differ by their first sampled byte; once a row took <|assistant_end|>, its
    # entry is <|assistant_end|> with mask 0, never another sampled token of mask 1.
    def ends_by_first_byte(generated: list[int]) -> torch.Tensor | int:
        if not generated:
            return uniform_bytes(generated)
        return END if len(generated) > generated[0] % 5 else ord("x")

    engine = Engine(ScriptedModel(ends_by_first_byte), TOK)
    steps = list(engine.generate(PROMPT, num_samples=6, max_tokens=20, temperature=1.0, seed=3))
    ended = [False] * 6
    for column, masks in steps:
        for i, (token, mask) in enumerate(zip(column, masks, strict=True)):
            if ended[i]:
                assert (token, mask) == (END, 0)
            ended[i] = ended[i] or token in (END, SPECIAL_IDS[BOS])
    assert all(ended)
    lengths = {next(n for n, (c, _) in enumerate(steps) if c[i] == END) for i in range(6)}
    assert len(lengths) > 1  # the rows did end at different steps


def test_a_batch_row_resumes_inside_a_calculator_result_as_generate_does():
    # RowRequest.resume: a continued reply that stopped inside a result writes the rest of
    # it first (mask 0), in a batch as in Engine.generate.
    engine = Engine(SlotScriptedModel(tool_call("12*7", DONE)), TOK)
    call = [SPECIAL_IDS["<|python_start|>"], *TOK.encode("12*7"), SPECIAL_IDS["<|python_end|>"]]
    result = [SPECIAL_IDS["<|output_start|>"], *TOK.encode("84"), SPECIAL_IDS["<|output_end|>"]]
    unfinished = [*call, *result[:2]]
    resume, _ = engine.replay_tool_use(unfinished)
    request = RowRequest(PROMPT + unfinished, max_tokens=1, temperature=0.0, resume=resume)
    tokens, masks, gen = _batched(engine, request)
    alone = list(
        Engine(ScriptedModel(tool_call("12*7", DONE)), TOK).generate(
            request.tokens, max_tokens=1, temperature=0.0, resume=resume
        )
    )
    assert tokens == [c[0] for c, _ in alone] == result[2:]
    assert masks == [m[0] for _, m in alone] == [0] * len(result[2:])
    assert gen.finish_reason == "length"


def test_every_generation_is_a_scheduler_client():
    # Engine.generate runs its rows in a Scheduler: the one loop (no decode loop of its own).
    import chatcli.engine.engine as engine_module

    assert not hasattr(Engine, "_decode") and not hasattr(Engine, "take_token")
    assert engine_module.Scheduler is Scheduler
