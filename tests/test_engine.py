"""Tests for chatcli.engine.engine: seeding, stop conditions, batching, the context limit and tool use.

The models are scripted fakes (tests/fakes.py): each row's next token is a plain function of
that row's tokens so far, so every expected sequence below is written out in full.
"""

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
    FakeConfig,
    ScriptedModel,
    noisy,
    peaked,
    reply,
    tool_call,
    uniform,
    uniform_bytes,
)

from chatcli.bench.baseline import baseline_generate
from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.fallback import compiled_or_eager
from chatcli.engine.static_step import CudaGraphStep, ModuleStep, StaticDecodeStep, StepWithFallback
from chatcli.engine.tool_use import RESULT_RESERVE
from chatcli.errors import ContextOverflowError
from chatcli.model.gpt import GPT
from chatcli.model.kv_cache import KVCache, SharedPrefixCache
from chatcli.model.special_tokens import (
    ASSISTANT_END,
    BOS,
    OUTPUT_END,
    OUTPUT_START,
    PYTHON_END,
    PYTHON_START,
)

TOK = ByteTokenizer()
END = SPECIAL_IDS[ASSISTANT_END]
PROMPT = CHAT_PROMPT


def run(model, tokens=PROMPT, **kwargs) -> list[tuple[list[int], list[int]]]:
    return list(Engine(model, TOK).generate(tokens, **kwargs))


def batch(model, tokens=PROMPT, **kwargs) -> tuple[list[list[int]], list[list[int]]]:
    return Engine(model, TOK).generate_batch(tokens, **kwargs)


def continuations(results: list[list[int]]) -> list[list[int]]:
    return [r[len(PROMPT) :] for r in results]


def ends_after_first_token(generated: list[int]) -> torch.Tensor | int:
    """A row whose length depends on its own first (sampled) byte: byte % 4 more 'x's, then
    <|assistant_end|>."""
    if not generated:
        return uniform_bytes(generated)
    return ord("x") if len(generated) <= generated[0] % 4 else END


# ---- seeds and temperature ------------------------------------------------------------------


def test_same_seed_gives_same_tokens_at_temperature_1():
    first, _ = batch(ScriptedModel(uniform_bytes), num_samples=3, max_tokens=12, seed=7)
    again, _ = batch(ScriptedModel(uniform_bytes), num_samples=3, max_tokens=12, seed=7)
    assert first == again
    assert all(len(r) == len(PROMPT) + 12 for r in first)


def test_different_seeds_give_different_tokens_at_temperature_1():
    a, _ = batch(ScriptedModel(uniform_bytes), max_tokens=12, seed=1)
    b, _ = batch(ScriptedModel(uniform_bytes), max_tokens=12, seed=2)
    assert continuations(a) != continuations(b)


def test_temperature_zero_takes_the_argmax_whatever_the_seed():
    expected = []
    for _ in range(10):
        expected.append(int(noisy(expected).argmax()))
    for seed in (0, 1, 12345):
        results, masks = batch(
            ScriptedModel(noisy), num_samples=2, max_tokens=10, temperature=0.0, seed=seed
        )
        assert continuations(results) == [expected, expected]
        assert masks == [[0] * len(PROMPT) + [1] * 10] * 2


# ---- steps, rows and stop conditions --------------------------------------------------------


def test_max_tokens_is_the_exact_number_of_steps():
    model = ScriptedModel(uniform_bytes)
    stats = GenerationStats()
    steps = run(model, max_tokens=7, stats=stats)
    assert len(steps) == 7
    assert stats.steps == 7
    assert stats.prompt_tokens == len(PROMPT)
    assert stats.finish_reasons == ["length"]
    # One prefill of the whole prompt, then one column per step except the last.
    assert model.calls == [(1, len(PROMPT))] + [(1, 1)] * 6


def test_max_tokens_zero_yields_nothing():
    assert run(ScriptedModel(uniform_bytes), max_tokens=0) == []


def test_num_samples_gives_one_entry_per_row_in_every_column_and_result():
    model = ScriptedModel(uniform_bytes)
    steps = run(model, num_samples=3, max_tokens=5)
    assert len(steps) == 5
    assert all(len(column) == 3 and len(masks) == 3 for column, masks in steps)
    # Prefill once at batch 1, then decode all rows together.
    assert model.calls == [(1, len(PROMPT))] + [(3, 1)] * 4

    results, masks = batch(ScriptedModel(uniform_bytes), num_samples=3, max_tokens=5)
    assert len(results) == len(masks) == 3
    assert [len(r) for r in results] == [len(PROMPT) + 5] * 3
    assert [len(m) for m in masks] == [len(PROMPT) + 5] * 3
    assert all(r[: len(PROMPT)] == PROMPT for r in results)


def test_each_row_samples_its_own_first_token():
    (column, masks), *_ = run(ScriptedModel(uniform), num_samples=8, max_tokens=1)
    assert len(column) == 8
    assert len(set(column)) > 1
    assert masks == [1] * 8


def test_a_row_ends_at_assistant_end_which_generate_batch_leaves_out():
    stats = GenerationStats()
    model = ScriptedModel(reply([*TOK.encode("84"), END, ord("z")]))
    steps = run(model, max_tokens=10, stats=stats)
    assert [column for column, _ in steps] == [[ord("8")], [ord("4")], [END]]
    assert stats.finish_reasons == ["stop"]

    results, masks = batch(ScriptedModel(reply([*TOK.encode("84"), END])), max_tokens=10)
    assert results == [[*PROMPT, *TOK.encode("84")]]
    assert masks == [[0] * len(PROMPT) + [1, 1]]


def test_a_row_ends_at_bos_too():
    bos = SPECIAL_IDS[BOS]
    stats = GenerationStats()
    steps = run(ScriptedModel(reply([*TOK.encode("hi"), bos])), max_tokens=10, stats=stats)
    assert [column for column, _ in steps] == [[ord("h")], [ord("i")], [bos]]
    assert stats.finish_reasons == ["stop"]
    results, _ = batch(ScriptedModel(reply([*TOK.encode("hi"), bos])), max_tokens=10)
    assert results == [[*PROMPT, *TOK.encode("hi")]]


def test_rows_finish_independently_and_results_exclude_their_terminal_tokens():
    stats = GenerationStats()
    model = ScriptedModel(ends_after_first_token)
    steps = run(model, num_samples=8, max_tokens=20, seed=3, stats=stats)
    firsts = steps[0][0]
    expected = [[first] + [ord("x")] * (first % 4) for first in firsts]
    assert len({len(e) for e in expected}) > 1, "pick a seed where row lengths differ"
    # Generation runs until the longest row has yielded its <|assistant_end|>.
    assert len(steps) == max(len(e) for e in expected) + 1
    for i, e in enumerate(expected):
        assert [column[i] for column, _ in steps[: len(e) + 1]] == [*e, END]
    assert stats.finish_reasons == ["stop"] * 8

    results, masks = batch(ScriptedModel(ends_after_first_token), num_samples=8, seed=3)
    assert continuations(results) == expected
    assert [m[len(PROMPT) :] for m in masks] == [[1] * len(e) for e in expected]


def test_finish_reasons_say_stop_for_ended_rows_and_length_for_cut_ones():
    stats = GenerationStats()
    steps = run(
        ScriptedModel(ends_after_first_token), num_samples=8, max_tokens=3, seed=3, stats=stats
    )
    # A row needs first % 4 + 2 steps to reach <|assistant_end|>.
    expected = ["stop" if first % 4 + 2 <= 3 else "length" for first in steps[0][0]]
    assert set(expected) == {"stop", "length"}, "pick a seed with both kinds of rows"
    assert len(steps) == 3
    assert stats.finish_reasons == expected


# ---- the context window ---------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [100, None])
def test_generation_never_runs_past_the_context(max_tokens):
    model = ScriptedModel(uniform_bytes, sequence_len=32)
    prompt = [SPECIAL_IDS[BOS], *TOK.encode("x" * 29)]
    stats = GenerationStats()
    steps = run(model, tokens=prompt, num_samples=2, max_tokens=max_tokens, stats=stats)
    assert len(steps) == 2  # positions 30 and 31
    assert stats.finish_reasons == ["context", "context"]
    # The model saw the prompt and the first column; the last column is never fed back.
    assert [len(h) for h in model.histories] == [31, 31]


def test_max_tokens_that_exactly_fills_the_context_is_reported_as_length():
    prompt = [SPECIAL_IDS[BOS], *TOK.encode("x" * 29)]
    stats = GenerationStats()
    steps = run(
        ScriptedModel(uniform_bytes, sequence_len=32), tokens=prompt, max_tokens=2, stats=stats
    )
    assert len(steps) == 2
    assert stats.finish_reasons == ["length"]


@pytest.mark.parametrize("prompt_len", [32, 33, 100])
def test_a_prompt_that_does_not_fit_raises_context_overflow(prompt_len):
    model = ScriptedModel(uniform_bytes, sequence_len=32)
    with pytest.raises(ContextOverflowError, match=f"{prompt_len} tokens.*context is 32"):
        run(model, tokens=[SPECIAL_IDS[BOS]] * prompt_len, max_tokens=1)
    assert model.calls == []


def test_a_row_that_stops_at_the_edge_of_the_context_says_stop():
    prompt = [SPECIAL_IDS[BOS], *TOK.encode("x" * 29)]
    stats = GenerationStats()
    steps = run(ScriptedModel(reply([ord("a"), END]), sequence_len=32), tokens=prompt, stats=stats)
    assert [column for column, _ in steps] == [[ord("a")], [END]]
    assert stats.finish_reasons == ["stop"]


# ---- the calculator tool --------------------------------------------------------------------


@pytest.mark.parametrize("num_samples", [1, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_calculator_output_is_forced_right_after_python_end_with_mask_zero(
    num_samples, temperature
):
    model = ScriptedModel(tool_call("12*7", DONE))
    results, masks = batch(model, num_samples=num_samples, temperature=temperature, max_tokens=30)
    call = [SPECIAL_IDS[PYTHON_START], *TOK.encode("12*7"), SPECIAL_IDS[PYTHON_END]]
    output = [SPECIAL_IDS[OUTPUT_START], *TOK.encode("84"), SPECIAL_IDS[OUTPUT_END]]
    after = TOK.encode(" done")
    assert continuations(results) == [call + output + after] * num_samples
    assert [m[len(PROMPT) :] for m in masks] == [
        [1] * len(call) + [0] * len(output) + [1] * len(after)
    ] * num_samples
    # The forced tokens went back into the model like any other.
    assert model.continuations() == [call + output + after] * num_samples


def test_forced_tokens_stream_with_mask_zero_and_the_models_choice_is_dropped():
    steps = run(ScriptedModel(tool_call("12*7", DONE)), temperature=0.0, max_tokens=30)
    tokens = [column[0] for column, _ in steps]
    flags = [masks[0] for _, masks in steps]
    end = tokens.index(SPECIAL_IDS[PYTHON_END])
    assert tokens[end + 1 : end + 5] == [
        SPECIAL_IDS[OUTPUT_START],
        ord("8"),
        ord("4"),
        SPECIAL_IDS[OUTPUT_END],
    ]
    assert flags[end + 1 : end + 5] == [0, 0, 0, 0]
    assert flags[: end + 1] == [1] * (end + 1)
    assert tokens[-1] == END and flags[-1] == 1


@pytest.mark.parametrize("expr", ["1/0", "__import__('os')", "2**10"])
def test_a_refused_expression_forces_nothing(expr):
    results, masks = batch(ScriptedModel(tool_call(expr, DONE)), temperature=0.0, max_tokens=40)
    call = [SPECIAL_IDS[PYTHON_START], *TOK.encode(expr), SPECIAL_IDS[PYTHON_END]]
    assert continuations(results) == [call + TOK.encode(" done")]
    assert masks == [[0] * len(PROMPT) + [1] * (len(call) + 5)]


def test_use_tools_false_forces_nothing():
    results, masks = batch(
        ScriptedModel(tool_call("12*7", DONE)), temperature=0.0, max_tokens=30, use_tools=False
    )
    call = [SPECIAL_IDS[PYTHON_START], *TOK.encode("12*7"), SPECIAL_IDS[PYTHON_END]]
    assert continuations(results) == [call + TOK.encode(" done")]
    assert SPECIAL_IDS[OUTPUT_START] not in results[0]
    assert masks == [[0] * len(PROMPT) + [1] * (len(call) + 5)]


def test_python_end_outside_a_python_block_forces_nothing():
    stray = [SPECIAL_IDS[PYTHON_END], *TOK.encode("ok"), END]
    results, masks = batch(ScriptedModel(reply(stray)), temperature=0.0, max_tokens=10)
    assert continuations(results) == [stray[:-1]]
    assert masks == [[0] * len(PROMPT) + [1, 1, 1]]


# A call and the result the calculator forces for it, as the engine streams them.
CALL = [SPECIAL_IDS[PYTHON_START], *TOK.encode("12*7"), SPECIAL_IDS[PYTHON_END]]
RESULT = [SPECIAL_IDS[OUTPUT_START], *TOK.encode("84"), SPECIAL_IDS[OUTPUT_END]]


@pytest.mark.parametrize("cut_after", [len(CALL), len(CALL) + 1, len(CALL) + 3])
def test_a_calculator_result_is_written_whole_even_past_max_tokens(cut_after):
    stats = GenerationStats()
    steps = run(
        ScriptedModel(tool_call("12*7", DONE)), temperature=0.0, max_tokens=cut_after, stats=stats
    )
    # The budget ends at or inside the result: the rest of it still comes, then nothing.
    assert [column[0] for column, _ in steps] == CALL + RESULT
    assert [masks[0] for _, masks in steps] == [1] * len(CALL) + [0] * len(RESULT)
    assert stats.finish_reasons == ["length"]
    assert stats.steps == len(CALL + RESULT)


def test_past_max_tokens_only_rows_with_a_result_queued_go_on():
    def calls_on_even_first_byte(generated: list[int]) -> torch.Tensor | int:
        if not generated:
            return uniform_bytes(generated)
        if generated[0] % 2:
            return ord("x")
        return tool_call("12*7", DONE)(generated[1:])

    steps = run(
        ScriptedModel(calls_on_even_first_byte), num_samples=8, max_tokens=len(CALL) + 2, seed=3
    )
    firsts = steps[0][0]
    assert {f % 2 for f in firsts} == {0, 1}, "pick a seed with both kinds of rows"
    assert len(steps) == 1 + len(CALL + RESULT)
    for i, first in enumerate(firsts):
        row = [column[i] for column, _ in steps]
        if first % 2:
            # Cut at max_tokens as ever; it waits out the other rows' results as <|assistant_end|>.
            budget = len(CALL) + 2
            assert row == [first] + [ord("x")] * (budget - 1) + [END] * (len(steps) - budget)
        else:
            assert row == [first, *CALL, *RESULT]
    results, _ = batch(
        ScriptedModel(calls_on_even_first_byte), num_samples=8, max_tokens=len(CALL) + 2, seed=3
    )
    assert [len(r) - len(PROMPT) for r in results] == [
        len(CALL) + 2 if f % 2 else 1 + len(CALL + RESULT) for f in firsts
    ]


def test_a_result_past_max_tokens_stops_at_the_end_of_the_context():
    prompt = [SPECIAL_IDS[BOS], ord("q")]
    model = ScriptedModel(tool_call("12*7", DONE), sequence_len=len(prompt) + len(CALL) + 2)
    steps = run(model, tokens=prompt, temperature=0.0, max_tokens=len(CALL))
    # Room for two of the result's tokens: the last position holds the last yielded one.
    assert [column[0] for column, _ in steps] == CALL + RESULT[:2]


def test_replay_tool_use_rebuilds_an_open_call_and_a_half_written_result():
    engine = Engine(ScriptedModel(uniform), TOK)
    state, masks = engine.replay_tool_use([*TOK.encode("So "), *CALL[:3]])
    assert state.in_python_block and state.python_expr_tokens == TOK.encode("12")
    assert not state.forced_tokens
    assert masks == [1] * 6

    state, masks = engine.replay_tool_use([*CALL, *RESULT[:2]])  # ... <|output_start|>8
    assert not state.in_python_block
    assert list(state.forced_tokens) == RESULT[2:]
    assert masks == [1] * len(CALL) + [0, 0]


def test_replay_tool_use_takes_tokens_unlike_the_result_as_the_models_own():
    engine = Engine(ScriptedModel(uniform), TOK)
    written = [*CALL, *TOK.encode("no tool here")]  # written with the tools off
    state, masks = engine.replay_tool_use(written)
    assert masks == [1] * len(written)
    assert not state.forced_tokens and not state.in_python_block


def test_generate_resumed_inside_a_call_runs_the_calculator_at_its_end():
    def finish_the_call(generated: list[int]) -> int:
        rest = [*TOK.encode("*7"), SPECIAL_IDS[PYTHON_END]]
        if SPECIAL_IDS[OUTPUT_END] in generated:
            return DONE[min(len(generated) - generated.index(SPECIAL_IDS[OUTPUT_END]) - 1, 5)]
        return rest[min(len(generated), len(rest) - 1)]

    engine = Engine(ScriptedModel(finish_the_call), TOK)
    unfinished = CALL[:3]  # <|python_start|>12
    resume, _ = engine.replay_tool_use(unfinished)
    steps = engine.generate(PROMPT + unfinished, temperature=0.0, max_tokens=20, resume=resume)
    tokens = [column[0] for column, _ in steps]
    assert tokens == [*CALL[3:], *RESULT, *DONE]
    # Without the state the engine cannot know a call is open: nothing is forced.
    fresh = Engine(ScriptedModel(finish_the_call), TOK)
    tokens = [column[0] for column, _ in fresh.generate(PROMPT + unfinished, temperature=0.0)]
    assert SPECIAL_IDS[OUTPUT_START] not in tokens


@pytest.mark.parametrize("num_samples", [1, 3])
def test_generate_resumed_inside_a_result_writes_the_rest_of_it_first(num_samples):
    engine = Engine(ScriptedModel(tool_call("12*7", DONE)), TOK)
    unfinished = [*CALL, *RESULT[:2]]  # ... <|output_start|>8
    resume, _ = engine.replay_tool_use(unfinished)
    steps = list(
        engine.generate(
            PROMPT + unfinished, num_samples, max_tokens=1, temperature=0.0, resume=resume
        )
    )
    # max_tokens=1: the result's rest is one unit with the first step.
    assert [column for column, _ in steps] == [[t] * num_samples for t in RESULT[2:]]
    assert [masks for _, masks in steps] == [[0] * num_samples] * len(RESULT[2:])


# ---- the model protocol ---------------------------------------------------------------------


class CountUp:
    """Not a GPT, not even an nn.Module: predicts the byte after the last one until 'e'."""

    def __init__(self) -> None:
        self.config = FakeConfig()

    def get_device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, idx: torch.Tensor, kv_cache=None) -> torch.Tensor:
        B, T = idx.shape
        logits = torch.zeros(B, T, self.config.vocab_size)
        for b, last in enumerate(idx[:, -1].tolist()):
            logits[b, -1] = peaked(last + 1 if last < ord("e") else END)
        if kv_cache is not None:
            kv_cache.advance(T)
        return logits


def test_generate_works_with_any_model_that_follows_the_protocol():
    prompt = [SPECIAL_IDS[BOS], ord("a")]
    engine = Engine(CountUp(), TOK)
    results, masks = engine.generate_batch(prompt, num_samples=2, max_tokens=10)
    assert results == [[*prompt, *TOK.encode("bcde")]] * 2
    assert masks == [[0, 0, 1, 1, 1, 1]] * 2


class ParameterlessModel(ScriptedModel):
    """An nn.Module with no parameters at all (a wrapper, a lookup-table model)."""

    def __init__(self) -> None:
        super().__init__(reply([ord("k"), END]))
        del self.anchor

    def get_device(self) -> torch.device:
        return torch.device("cpu")


def test_an_nn_module_without_parameters_gets_a_float32_cache():
    results, _ = batch(ParameterlessModel(), max_tokens=5)
    assert continuations(results) == [[ord("k")]]


def test_negative_max_tokens_raises_a_value_error_that_names_it():
    with pytest.raises(ValueError, match="max_tokens"):
        run(ScriptedModel(uniform_bytes), max_tokens=-1)


def test_caches_are_zeroed_only_for_steps_that_read_past_the_written_positions(monkeypatch):
    import chatcli.model.kv_cache as kv_cache
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model()
    engine = Engine(model, tokenizer)
    calls = []
    for name in ("zeros", "empty"):
        real = getattr(torch, name)

        def record(*args, _name=name, _real=real, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(kv_cache.torch, name, record)
    engine.new_cache(1, 64)  # the fused step reads only what was written
    assert calls[:2] == ["empty", "empty"]
    calls.clear()
    engine.decode_step = StaticDecodeStep(model)  # reads every position under a mask
    engine.new_cache(1, 64)
    assert calls[:2] == ["zeros", "zeros"]


class ThreadsSeen(ScriptedModel):
    """Records torch's thread count during every forward, by chunk length."""

    def __init__(self) -> None:
        super().__init__(uniform_bytes, sequence_len=1024)
        self.threads: list[tuple[int, int]] = []  # (T, threads)

    def forward(self, idx: torch.Tensor, kv_cache=None) -> torch.Tensor:
        self.threads.append((idx.size(1), torch.get_num_threads()))
        return super().forward(idx, kv_cache)


def test_a_long_prefill_runs_on_every_core_and_decode_stays_on_the_callers_threads(
    monkeypatch,
):
    from chatcli.engine.cpu_plan import WIDE_PREFILL_TOKENS

    monkeypatch.setattr("chatcli.engine.cpu_plan.available_cores", lambda: 3)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = ThreadsSeen()
        long_prompt = [SPECIAL_IDS[BOS]] + [ord("a")] * WIDE_PREFILL_TOKENS
        list(Engine(model, TOK).generate(long_prompt, max_tokens=3))
        list(Engine(model, TOK).generate(PROMPT, max_tokens=3))
        assert torch.get_num_threads() == 1  # restored after every prefill
    finally:
        torch.set_num_threads(before)
    long_len = len(long_prompt)
    assert model.threads == [(long_len, 3), (1, 1), (1, 1), (len(PROMPT), 1), (1, 1), (1, 1)]


def test_decode_time_leaves_out_the_callers_time_between_tokens():
    # A slow consumer (a terminal drawing each token) does not make the decode look slow.
    model = ScriptedModel(reply(list(b"abcdefgh")))
    engine = Engine(model, ByteTokenizer())
    stats = GenerationStats()
    for _ in engine.generate([1, 2, 3], max_tokens=6, temperature=0.0, stats=stats):
        time.sleep(0.02)
    assert stats.steps == 6
    assert stats.decode_s < 0.02  # 5 sleeps of 20 ms fell between the steps, outside them


def _static_step_engine() -> tuple[GPT, Engine]:
    """An engine over a random era-E model whose decode step is a CUDA graph's static step
    (run eagerly here on the CPU), behind the fallback the GPU path wraps it in."""
    model = random_gpt("E")
    engine = Engine(model, ByteTokenizer())
    engine.decode_step = StepWithFallback(StaticDecodeStep(model), ModuleStep(model), "test")
    return model, engine


def _caches_made(engine: Engine, monkeypatch) -> list[tuple[int, int]]:
    """The (batch, length) of every cache the engine makes from now on."""
    made = []
    real_new_cache = engine.new_cache
    monkeypatch.setattr(engine, "new_cache", lambda *a: made.append(a) or real_new_cache(*a))
    return made


def _static_greedy(engine: Engine, prompt: list[int], steps=None) -> list[int]:
    steps = steps or engine.generate(prompt, max_tokens=20, temperature=0.0, use_tools=False)
    return [column[0] for column, _ in steps]


def _baseline_greedy(model: GPT, prompt: list[int]) -> list[int]:
    return [c[0] for c in baseline_generate(model, prompt, 1, 20, 0.0)]


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 190, (n,), generator=g).tolist() for n in lengths]


def test_a_static_step_s_one_row_generations_share_one_kept_whole_context_cache(monkeypatch):
    # A CUDA graph's step (here its static step on the CPU): each request would otherwise
    # make a whole-context cache and capture the graph afresh.
    model, engine = _static_step_engine()
    made = _caches_made(engine, monkeypatch)
    # One after another, the second shorter than the first: stale K/V lie past its prompt.
    for prompt in _prompts(40, 12, 25):
        assert _static_greedy(engine, prompt) == _baseline_greedy(model, prompt)
    assert made == [(1, model.config.sequence_len)]  # made once, at the first request


def test_a_static_step_s_generation_begun_while_another_is_open_gets_its_own_cache(monkeypatch):
    model, engine = _static_step_engine()
    first_prompt, second_prompt = _prompts(40, 12)
    first = engine.generate(first_prompt, max_tokens=20, temperature=0.0, use_tools=False)
    head = [next(first)[0][0] for _ in range(5)]
    made = _caches_made(engine, monkeypatch)
    assert _static_greedy(engine, second_prompt) == _baseline_greedy(model, second_prompt)
    assert made == [(1, model.config.sequence_len)]  # its own, the first's kept one lent out
    assert head + _static_greedy(engine, first_prompt, first) == _baseline_greedy(
        model, first_prompt
    )


def test_a_static_step_s_closed_generation_hands_the_kept_cache_back(monkeypatch):
    model, engine = _static_step_engine()
    prompt, other = _prompts(40, 12)
    steps = engine.generate(prompt, max_tokens=20, temperature=0.0)
    next(steps)
    steps.close()  # closed mid-reply
    made = _caches_made(engine, monkeypatch)
    assert _static_greedy(engine, other) == _baseline_greedy(model, other)
    assert made == []  # the kept cache served it


def test_a_static_step_s_failed_generation_hands_the_kept_cache_back(monkeypatch):
    model, engine = _static_step_engine()
    prompt, other = _prompts(40, 12)
    _static_greedy(engine, prompt)  # the kept cache made
    real_forward = engine.forward_last

    def out_of_memory(ids, cache):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(engine, "forward_last", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        _static_greedy(engine, other)
    monkeypatch.setattr(engine, "forward_last", real_forward)
    made = _caches_made(engine, monkeypatch)
    assert _static_greedy(engine, other) == _baseline_greedy(model, other)
    assert made == []


def test_a_static_step_s_kept_cache_that_could_not_be_made_is_made_at_the_next_request(
    monkeypatch,
):
    model, engine = _static_step_engine()
    prompt = _prompts(20)[0]
    real_new_cache = engine.new_cache

    def out_of_memory(*args):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(engine, "new_cache", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        next(engine.generate(prompt, max_tokens=5, temperature=0.0))
    monkeypatch.setattr(engine, "new_cache", real_new_cache)
    made = _caches_made(engine, monkeypatch)
    for _ in range(2):
        assert _static_greedy(engine, prompt) == _baseline_greedy(model, prompt)
    assert made == [(1, model.config.sequence_len)]  # once: not lent out by the failed one


def _prompt_prefilled(engine: Engine, prompt: list[int]) -> KVCache:
    prefix = engine.new_cache(1, len(prompt))
    with torch.inference_mode():
        engine.forward_last(torch.tensor([prompt]), prefix)
    return prefix


def test_a_static_step_s_sample_rows_get_the_prompt_copied_into_rows_sized_to_the_budget():
    # On a GPU the rows then decode in one graph replay a step.
    model, static = _static_step_engine()
    prompt = _prompts(30)[0]
    rows = static.fork(_prompt_prefilled(static, prompt), 4, 20)
    assert type(rows) is KVCache and rows.batch_size == 4
    assert rows.get_pos() == 30 and rows.max_seq_len == 30 + 20 + RESULT_RESERVE
    shared = Engine(model, ByteTokenizer())
    assert isinstance(shared.fork(_prompt_prefilled(shared, prompt), 4, 20), SharedPrefixCache)


@pytest.mark.parametrize("how", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3}])
def test_a_static_step_s_sample_rows_answer_as_shared_prefix_rows(how):
    model, static = _static_step_engine()
    shared = Engine(model, ByteTokenizer())
    prompt = _prompts(30)[0]
    got = static.generate_batch(prompt, 4, max_tokens=16, use_tools=False, **how)
    assert got == shared.generate_batch(prompt, 4, max_tokens=16, use_tools=False, **how)
    if how["temperature"] == 0.0:
        assert len({tuple(r) for r in got[0]}) == 1  # greedy rows are one reply


def test_compile_on_a_gpu_keeps_the_eager_graph_step(monkeypatch):
    # Compiled, the captured step replayed slower on an H200 (step_choice.pick_decode_step).
    model = random_gpt("E")
    monkeypatch.setattr(model, "get_device", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled on a GPU"))
    engine = Engine(model, ByteTokenizer(), compile=True)
    step = engine.decode_step
    assert isinstance(step, StepWithFallback) and isinstance(step.fast, CudaGraphStep)
    assert not engine.compiled  # what the bench reports


def test_a_compile_that_fails_runs_eagerly_from_then_on(monkeypatch):
    calls = []

    def broken_compile(fn, **options):
        def run(*args):
            calls.append("compiled")
            raise RuntimeError("inductor: no working C compiler")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    step = compiled_or_eager(lambda x: x + 1)
    with pytest.warns(UserWarning, match="torch.compile failed, running eagerly: inductor"):
        assert step(1) == 2
    assert step(5) == 6 and calls == ["compiled"]  # not tried again


class BrokenGraph:
    """A CUDA graph's step whose capture fails, as the static step asks for its caches."""

    wants_full_cache = True
    reads_whole_cache = True

    def __call__(self, ids, cache):
        raise RuntimeError("operation not permitted when stream is capturing")


def _failing_graph_engine() -> tuple[GPT, Engine, StepWithFallback]:
    model = random_gpt("E")
    engine = Engine(model, ByteTokenizer())
    step = StepWithFallback(BrokenGraph(), ModuleStep(model), "graph")
    engine.decode_step = step
    return model, engine, step


def test_a_failed_graph_step_warns_once_and_answers_through_the_plain_step():
    model, engine, step = _failing_graph_engine()
    prompt = _prompts(20)[0]
    assert step.wants_full_cache and step.reads_whole_cache
    with pytest.warns(UserWarning, match="graph failed, running eagerly"):
        assert _static_greedy(engine, prompt) == _baseline_greedy(model, prompt)
    assert not step.wants_full_cache and not step.reads_whole_cache


def test_after_a_failed_graph_step_caches_are_the_plain_kind_again(monkeypatch):
    _, engine, _ = _failing_graph_engine()
    prompt = _prompts(20)[0]
    with pytest.warns(UserWarning):
        engine.generate_batch(prompt, max_tokens=3, temperature=0.0)
    made = _caches_made(engine, monkeypatch)
    engine.generate_batch(prompt, max_tokens=3, temperature=0.0)
    assert made == [(1, 20 + 3 + RESULT_RESERVE)]  # room for its budget, not the whole context
    prefix = engine.new_cache(1, len(prompt))
    with torch.inference_mode():
        engine.forward_last(torch.tensor([prompt]), prefix)
    assert isinstance(engine.fork(prefix, 4, 10), SharedPrefixCache)
