"""`chatcli bench` runs end to end; what it asserts is equivalence, never a timing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from builders import random_gpt
from reference import REFERENCE, needs_reference

from chatcli.bench import bench, models, roofline
from chatcli.bench.bench import run_bench
from chatcli.bench.models import synthetic_model
from chatcli.bench.roofline import matrix_params, weight_bytes_per_token
from chatcli.engine.cpu_plan import available_cores
from chatcli.engine.warm_cache import WarmCache
from chatcli.kernels.rows_step import rows_step
from chatcli.model.checkpoint import load_model

FIXTURE = REFERENCE / "E"


@needs_reference
def test_bench_reports_every_measure_and_identical_greedy_output():
    model, tokenizer, _ = load_model(FIXTURE, device="cpu")
    result = run_bench(model, tokenizer, "fixture E")
    assert result["greedy_identical_fp32"] is True
    assert result["weights"] == "float32" and result["greedy_agreement"] == 1.0
    for key in ("decode_tps", "decode8_tps"):
        assert result[key]["baseline"] > 0 and result[key]["ours"] > 0
    assert result["single_sampled_tps"] > 0 and result["samples8_vs_single"] > 0
    assert set(result["ttft_s"]["ours"]) == {1, 5, 10}
    assert result["bandwidth_gbs"] > 0 and result["roofline_tps"] > 0
    # fp32 weights: the bf16 roofline (half the bytes) is twice as far
    assert result["bf16_roofline_tps"] == pytest.approx(2 * result["roofline_tps"], rel=0.01)
    assert result["bf16_roofline_fraction"] == pytest.approx(
        result["roofline_fraction"] / 2, abs=0.002
    )
    # Against the bandwidth probed beside a decode run: a fraction of the same rooflines
    assert result["roofline_fraction_paired"] > 0
    assert result["bf16_roofline_fraction_paired"] == pytest.approx(
        result["roofline_fraction_paired"] / 2, abs=0.002
    )
    # A small fp32 model's step runs through our kernel wherever it compiles, and the bench
    # says so, with the threads its step settled on for one row and for 8 sample rows.
    assert result["step_kernel"] == ("rows_step" if rows_step() is not None else None)
    assert result["one_row_kernels"] == result["sample_rows_kernels"] == []  # no 16-bit copies
    if available_cores() > 1:
        assert set(result["decode_threads"]) == {1, 8}
        assert set(result["decode_threads"].values()) <= {1, available_cores()}


def test_roofline_fractions_take_the_decode_against_the_faster_probe_beside_it(monkeypatch):
    probes = iter([30.0, 40.0])  # GB/s before the run, after it
    order: list[str] = []
    threads: list[int] = []

    def bandwidth_of(buffer: torch.Tensor, repeats: int = 5) -> float:
        order.append("probe")
        threads.append(torch.get_num_threads())
        return next(probes)

    def decode() -> float:
        order.append("decode")
        return 10.0  # tok/s

    monkeypatch.setattr(roofline, "bandwidth_of", bandwidth_of)
    caller = torch.get_num_threads()
    got = roofline.roofline_fractions(decode, torch.ones(4), 1, int(2e9), int(1e9))
    assert order == ["probe", "decode", "probe"]
    assert threads == [1, 1] and torch.get_num_threads() == caller
    # 10 tok/s of 2 GB is 20 GB/s: half the 40 GB/s roofline (not two thirds of 30)
    assert got == pytest.approx({"roofline_paired": 0.5, "bf16_roofline_paired": 0.25})


def test_bandwidth_of_a_buffer_is_its_bytes_over_the_fastest_sum(monkeypatch):
    times = iter([0.5, 0.25, 1.0])
    monkeypatch.setattr(roofline, "timed", lambda fn: next(times))
    assert roofline.bandwidth_of(torch.ones(1000), repeats=3) == pytest.approx(4000 / 0.25 / 1e9)


def test_synthetic_d4_has_nanochat_shapes_and_weight_bytes():
    model, tokenizer = synthetic_model("d4")
    c = model.config
    assert (c.n_layer, c.n_embd, c.n_head, c.vocab_size) == (4, 256, 2, 65536)
    # 4 layers of 12*C^2 matmul weights, the lm_head, and the small gates (2 value-embedding
    # gates of 2x12, the 1x24 smear gate), fp32; the embedding tables are not read whole
    assert weight_bytes_per_token(model) == 4 * (4 * 12 * 256 * 256 + 65536 * 256 + 2 * 24 + 24)
    assert matrix_params(model) * 4 == weight_bytes_per_token(model)
    model.add_decode_weights("int8")  # one byte a weight, plus the per-row scales
    assert matrix_params(model) < weight_bytes_per_token(model) < 1.1 * matrix_params(model)
    assert tokenizer.get_vocab_size() == 65536


def test_rounds_alternate_the_modes_and_keep_each_measures_best(monkeypatch):
    monkeypatch.setattr(bench, "REPEATS", 3)
    monkeypatch.setattr(bench, "MEASURE_SECONDS", 0.0)  # one run of each measure a round
    model = random_gpt("E")
    order: list[str] = []
    values = {"base": iter([5.0, 9.0, 7.0]), "ours": iter([20.0, 10.0, 30.0])}
    ttfts = iter([0.5, 0.2, 0.4])

    def measure(side: str):
        def run() -> float:
            order.append(side)
            return next(values[side])

        return run

    def ttft() -> dict[str, float]:
        order.append("ours ttft")
        return {"ttft1": next(ttfts)}

    base, ours = bench.run_rounds(
        [
            (bench.Mode(model, 1, copies=False), {"decode": measure("base")}),
            (bench.Mode(model, 1, copies=True), {"decode": measure("ours"), "ttft": ttft}),
        ]
    )
    assert order == ["base", "ours", "ours ttft"] * 3  # every round measures both, in turn
    assert base == {"decode": 9.0}  # the highest throughput
    assert ours == {"decode": 30.0, "ttft1": 0.2}  # and the shortest time to first token


def test_the_baseline_mode_sets_the_decode_copies_aside_and_puts_everything_back():
    model = random_gpt("E")
    model.add_decode_weights("int8")
    copies = model.decode_weights()
    assert copies
    threads = torch.get_num_threads()
    target = 2 if threads == 1 else 1
    with pytest.raises(RuntimeError), bench.Mode(model, target, copies=False).active():
        assert model.decode_weights() == [] and torch.get_num_threads() == target
        raise RuntimeError("a failing measure")
    # restored, even after the failure: the copies and the caller's threads
    assert model.decode_weights() == copies and torch.get_num_threads() == threads
    with bench.Mode(model, target, copies=True).active():
        assert model.decode_weights() == copies
    assert torch.get_num_threads() == threads


class _Clock:
    """A perf_counter that a measure moves forward by the time it says it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_a_quick_measure_repeats_within_its_round_and_a_slow_one_runs_once(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench, "time", clock)
    monkeypatch.setattr(bench, "REPEATS", 2)
    monkeypatch.setattr(bench, "MEASURE_SECONDS", 0.5)
    runs = {"quick": 0, "slow": 0}
    quick_values = iter([3.0, 8.0, 4.0, 1.0, 2.0, 6.0, 5.0, 7.0])

    def quick() -> float:
        runs["quick"] += 1
        clock.now += 0.125  # four runs fill a round's half second
        return next(quick_values)

    def slow() -> float:
        runs["slow"] += 1
        clock.now += 2.0
        return float(runs["slow"])

    model = random_gpt("E")
    (kept,) = bench.run_rounds([(bench.Mode(model, 1, copies=True), {"q": quick, "s": slow})])
    assert runs == {"quick": 8, "slow": 2}
    assert kept == {"q": 8.0, "s": 2.0}


@pytest.mark.parametrize("plain", [False, True])
def test_each_measured_turn_is_timed_again_from_the_state_before_it(monkeypatch, plain):
    monkeypatch.setattr(bench, "CHAT_SECONDS", 0.0)  # one chat
    model, tokenizer, _ = load_model(None, device="cpu")
    prefilled: list[tuple[int, int]] = []  # (tokens in the prompt, tokens prefilled)
    real_prefill = WarmCache.prefill

    def spy(self, prompt):
        logits, n = real_prefill(self, prompt)
        prefilled.append((len(prompt), n))
        return logits, n

    monkeypatch.setattr(WarmCache, "prefill", spy)
    sessions: list[bench.ChatSession] = []
    real_init = bench.ChatSession.__post_init__

    def remember(self):
        real_init(self)
        sessions.append(self)

    monkeypatch.setattr(bench.ChatSession, "__post_init__", remember)
    best = bench.chat_ttft(model, tokenizer, plain=plain)

    dropped = best.pop("chat_dropped")
    assert set(best) == {"ttft1", "ttft5", "ttft10"} and min(best.values()) > 0
    assert dropped == 0.0  # ten short turns fit the context: nothing was rebuilt
    samples = bench.TTFT_SAMPLES
    assert samples > 1 and len(prefilled) == 10 + (samples - 1) * len(bench.TURNS)
    # Walk the calls turn by turn: a measured turn's tries prefill exactly what its first
    # did (the whole conversation for the baseline, the new turn for ours), never the
    # one token a retry over the warm cache would.
    calls = iter(prefilled)
    for turn in range(1, 11):
        tries = [next(calls) for _ in range(samples if turn in bench.TURNS else 1)]
        assert len(set(tries)) == 1, (turn, tries)
        prompt_len, n = tries[0]
        if plain or turn == 1:
            assert n == prompt_len
        else:
            assert 8 <= n < prompt_len / 2
    # The tries leave the conversation as one send a turn does: ten exchanges.
    (session,) = sessions
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 10
    # The earlier tries of a measured turn stop at their first token, the last runs on.
    finishes = [(st.finish_reason, st.tokens_out) for st in session.history_stats]
    turns = iter(finishes)
    for turn in range(1, 11):
        tries = [next(turns) for _ in range(samples if turn in bench.TURNS else 1)]
        assert all(t == ("interrupted", 1) for t in tries[:-1]), (turn, tries)
        assert tries[-1][0] != "interrupted" and tries[-1][1] > 1, (turn, tries)


@needs_reference
def test_fp16_copies_read_by_our_step_kernel_are_reported_as_its_own(monkeypatch):
    # Where rows_step reads the fp16 copies' panels itself, the copies' own product kernels
    # (fbgemm, f16_rows) serve no decode step, and the bench does not name them.
    monkeypatch.setattr(bench, "REPEATS", 1)
    monkeypatch.setattr(bench, "MEASURE_SECONDS", 0.0)
    monkeypatch.setattr(bench, "DECODE_TOKENS", 8)
    model, tokenizer, _ = load_model(FIXTURE, device="cpu")
    result = run_bench(model, tokenizer, "fixture E", precision="float16")
    assert result["weights"] == "float16"
    kernel = rows_step()
    if kernel is not None and kernel.half_panel:
        assert result["step_kernel"] == "rows_step fp16"
        assert result["one_row_kernels"] == result["sample_rows_kernels"] == []
    else:
        assert result["step_kernel"] is None and result["one_row_kernels"] != []


def test_a_chat_that_outgrows_a_short_context_is_flagged_not_passed_off(monkeypatch):
    monkeypatch.setattr(bench, "CHAT_SECONDS", 0.0)  # one chat
    model, tokenizer, _ = load_model(None, device="cpu")
    monkeypatch.setattr(model, "config", replace(model.config, sequence_len=96))  # too short
    assert bench.chat_ttft(model, tokenizer, plain=False)["chat_dropped"] == 1.0


def test_the_bench_device_is_the_gpu_where_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert models.bench_device("auto") == torch.device("cuda")
    assert models.bench_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"has 2 CUDA devices \(cuda:0 to cuda:1\)"):
        models.bench_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models.bench_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="sees no CUDA device"):
        models.bench_device("cuda")


@pytest.mark.parametrize(
    ("precision", "capability", "want"),
    [
        ("auto", (9, 0), torch.bfloat16),  # as chatcli loads a bf16-capable GPU
        ("auto", (7, 5), torch.float32),  # a Turing card only emulates bf16
        ("float32", (9, 0), torch.float32),
        ("bfloat16", (7, 5), torch.bfloat16),
    ],
)
def test_ours_on_a_gpu_runs_the_weights_chatcli_would(monkeypatch, precision, capability, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert models.gpu_weights(precision, torch.device("cuda")) == want


@pytest.mark.parametrize("kind", ["float16", "int8", "int4"])
def test_a_cpu_decode_copy_on_a_gpu_is_refused(kind):
    with pytest.raises(ValueError, match=f"--quantize {kind} is a CPU decode copy"):
        models.gpu_weights(kind, torch.device("cuda"))


def test_a_cast_copy_is_the_model_in_that_dtype_and_leaves_it_alone():
    model = random_gpt("E")
    cast = bench.cast_copy(model, torch.bfloat16)
    assert next(model.parameters()).dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in cast.parameters())
    for (name, p), q in zip(model.named_parameters(), cast.parameters(), strict=True):
        assert torch.equal(p.to(torch.bfloat16), q), name
    ids = torch.randint(0, 190, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(cast(ids).float(), model(ids), atol=0.1, rtol=0)


def test_decode_is_timed_over_whole_budgets_though_the_model_would_end_early(monkeypatch):
    # An earlier embedded model answered the bench's raw-text prompt in 8 tokens; timed so,
    # its decode figure was the first steps of many short generations (2634 tok/s, not
    # ~5000). A greeting is a prompt the model surely ends early on: its reply is ~30 tokens.
    from chatcli.engine.engine import Engine

    model, tokenizer, _ = load_model(None, device="cpu")
    engine = Engine(model, tokenizer)
    ends = engine.assistant_end, engine.bos
    prompt = tokenizer.render_for_completion([{"role": "user", "content": "hi"}])
    natural = [
        c
        for c, _ in engine.generate(
            prompt, max_tokens=bench.DECODE_TOKENS, temperature=0.0, use_tools=False
        )
    ]
    assert len(natural) < bench.DECODE_TOKENS  # it does end early on its own
    budgets = []
    generate = engine.generate

    def spy(*args, **kwargs):
        budgets.append(kwargs["stats"])
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", spy)
    assert bench.ours_decode(engine, prompt, 1) > 0
    assert budgets and all(stats.steps == bench.DECODE_TOKENS for stats in budgets)
    assert (engine.assistant_end, engine.bos) == ends  # restored for the other measures
