"""`chatcli bench`: our engine against the plain baseline, side by side, in one run.

Owns: the measurements and the result as a dict (the CLI prints a table or JSON); the
models it runs are models.py's (a checkpoint, or a synthetic nanochat of depth d4, d12 or
d20), the bandwidth and rooflines roofline.py's. Measured for both modes: prefill tok/s, batch-1 decode tok/s, aggregate decode
tok/s with 8 samples (and for ours, against one sample of the same prompt and sampling),
time to first token at turns 1, 5 and 10 of a scripted chat; plus peak
memory, the machine's memory bandwidth and the decode roofline it implies for the weights.
Greedy outputs of the two modes are compared token for token.

On a CUDA device both modes run there: the baseline eager fp32 (a host read of every row each
step), ours as chatcli runs a GPU (bf16 where the card computes in it, the decode step
replayed as a CUDA graph, sampling on the device). Every timing waits for the device first.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from chatcli.bench.baseline import baseline_generate
from chatcli.bench.models import cast_copy, gpu_weights
from chatcli.bench.roofline import (
    bandwidth_of,
    bandwidth_probe,
    matrix_params,
    roofline_fractions,
    timed,
    weight_bytes_per_token,
)
from chatcli.chat.session import ChatSession, SamplingOptions
from chatcli.engine.cpu_plan import CpuPlan, apply_cpu_plan, torch_threads
from chatcli.engine.decode_step import DecodeStep
from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.static_step import StepWithFallback
from chatcli.kernels.status import kernels_line, toolchain_line
from chatcli.model.gpt import GPT
from chatcli.model.model_build import LARGE_MODEL_MATRIX_PARAMS
from chatcli.model.quantize import QUANTIZE_KINDS, default_half_kind

DECODE_TOKENS = 48
SAMPLES = 8
TURNS = (1, 5, 10)
# Every measure is the best of this many rounds, in both modes (as timeit takes the best):
# other work on a shared host only ever adds time. Each round measures the baseline and ours
# back to back, so that a slow spell of the host, which can outlast all of one mode's runs,
# falls on both modes rather than on one (docs/performance-notes.md, "Figures behind the
# code").
REPEATS = 3
# Within a round, each measure repeats until this much time has passed (at least once), the
# best kept, as timeit's autorange does: a small model's single runs are too short to
# outlast the host's noise. A big model's measure takes longer and runs once.
MEASURE_SECONDS = 0.5
CHAT_SECONDS = 1.0  # each round's scripted chats, per mode (see chat_ttft)
TTFT_SAMPLES = 3  # each measured turn of a chat, sent again from the same state


def _prompt(tokenizer, n: int) -> list[int]:
    text = ("The quick brown fox jumps over the lazy dog. " * (n // 10 + 1))[: max(n - 1, 1)]
    return tokenizer.encode(text, prepend=tokenizer.get_bos_token_id())[:n]


def _prefill_tps(model, tokens: list[int]) -> float:
    """The baseline's prefill: the module forward, logits at every position."""
    ids = torch.tensor([tokens], device=model.get_device())
    with torch.inference_mode():
        return len(tokens) / timed(lambda: model(ids))


def _ours_prefill_tps(engine: Engine, tokens: list[int]) -> float:
    """Ours' prefill as a generation or a chat's first turn runs it: Engine.forward_last
    into a fresh cache (its threads, the vocabulary projected at the last position only)."""
    ids = torch.tensor([tokens], device=engine.model.get_device())
    with torch.inference_mode():
        cache = engine.new_cache(1, len(tokens))
        return len(tokens) / timed(lambda: engine.forward_last(ids, cache))


@contextmanager
def endless_rows(engine: Engine) -> Iterator[Engine]:
    """`engine` with no row ending at <|assistant_end|> or <|bos|>, for timing decode on whole
    budgets: a model that answers the bench's prompt in 8 tokens would otherwise be timed on
    the first, slower steps of many short generations. The end tokens come back on leaving."""
    ends = engine.assistant_end, engine.bos
    engine.assistant_end = engine.bos = -1
    try:
        yield engine
    finally:
        engine.assistant_end, engine.bos = ends


def ours_decode(
    engine: Engine, prompt: list[int], n: int, temperature: float | None = None
) -> float:
    """Aggregate decode tok/s of n samples (greedy for one, temperature 1 for more unless
    said), over at least DECODE_TOKENS decode steps, as the baseline never stops before
    DECODE_TOKENS: the end tokens do not end a row, and a generation cut short by the
    context is followed by another with the next seed."""
    temperature = (0.0 if n == 1 else 1.0) if temperature is None else temperature
    steps, seconds = 0, 0.0
    with endless_rows(engine):
        for seed in range(1, 50):  # greedy repeats the same generation: more of the same steps
            stats = GenerationStats()
            for _ in engine.generate(
                prompt,
                num_samples=n,
                max_tokens=DECODE_TOKENS,
                temperature=temperature,
                top_k=None,
                seed=seed,
                use_tools=False,
                stats=stats,
            ):
                pass
            # The decode steps only: the first column comes from the prefill.
            steps, seconds = steps + stats.steps - 1, seconds + stats.decode_s
            if steps >= DECODE_TOKENS:
                break
    return n * steps / max(seconds, 1e-9)


def _baseline_decode(model, prompt: list[int], n: int) -> float:
    steps = 0
    t0 = None
    for step, _ in enumerate(
        baseline_generate(model, prompt, n, DECODE_TOKENS, 0.0 if n == 1 else 1.0, None, 1)
    ):
        if step == 0:
            t0 = time.perf_counter()
        steps = step
    return n * steps / max(time.perf_counter() - t0, 1e-9)


def chat_ttft(model, tokenizer, plain: bool, compile: bool = False) -> dict[str, float]:
    """The best time to first token at given turns of a scripted chat (the same in both
    modes), over as many chats as fit in CHAT_SECONDS (at least one).

    A small model's turn is short enough for the host's noise to move it by a large part,
    so many chats run. A big model's chat takes seconds and runs once a round, so each
    measured turn is sent TTFT_SAMPLES times (any model's), from the state before it: the
    reply is popped and regenerated with the cache rewound to what it held before the turn
    (unlike /retry, which reuses the turn's cached prompt), and the earlier tries stop at
    their first streamed event, the first token timed. The figures behind both:
    docs/performance-notes.md, "Figures behind the code".

    plain: the baseline's way, every turn re-prefills the whole conversation; otherwise the
    session keeps its KV cache and prefills only the new turn. compile: the sessions' as
    `chat --compile` runs.
    """
    # Short replies too in a short context (a nanochat fixture's 256), so that ten turns fit.
    context = getattr(getattr(model, "config", None), "sequence_len", 512)
    opts = SamplingOptions(
        temperature=0.0, top_k=None, max_tokens=12 if context >= 512 else 4, seed=1, tools=False
    )
    best: dict[str, float] = {}
    t0 = time.perf_counter()
    while not best or time.perf_counter() - t0 < CHAT_SECONDS:
        session = ChatSession(model, tokenizer, opts, compile=compile)
        for turn in range(1, max(TURNS) + 1):
            # Short turns, so that ten of them fit a 512-token context without the guard
            # dropping (and re-prefilling) anything: this measures reuse, not the guard.
            text = f"Turn {turn}: and the fox?"
            tries = TTFT_SAMPLES if turn in TURNS else 1
            held = list(session.warm.tokens)  # what the cache holds before this turn
            for attempt in range(tries):
                if plain:
                    session.warm.cache, session.warm.tokens = None, []
                else:  # back to the cache before the turn: it prefills the turn again
                    session.warm.tokens = list(held)
                events = session.send(text) if attempt == 0 else session.regenerate()
                if attempt == tries - 1:
                    for _ in events:
                        pass
                else:  # the first token is timed; the rest would not be
                    next(events, None)
                    events.close()
                    session.pop_last_reply()
                if turn in TURNS:
                    ttft = session.last_reply.stats.ttft_s
                    best[f"ttft{turn}"] = min(best.get(f"ttft{turn}", ttft), ttft)
                # A context too short even so: the guard dropped turns and rebuilt the cache,
                # which the turns after it measure (the report says so).
                if any("dropped" in n.text for n in session.take_notices()):
                    best["chat_dropped"] = 1.0
    best.setdefault("chat_dropped", 0.0)
    return best


class Mode:
    """How one side of the bench runs: its threads, and whether the model's compact decode
    copies are in place (ours) or set aside, so that every product reads fp32 (the
    baseline). Switching is a few attribute writes, so rounds can alternate the modes."""

    def __init__(self, model: GPT, threads: int, copies: bool) -> None:
        self.model, self.threads, self.copies = model, threads, copies

    @contextmanager
    def active(self) -> Iterator[None]:
        with torch_threads(self.threads):
            if self.copies:
                yield
            else:
                with self.model.decode_weights_set_aside():
                    yield


Measures = dict[str, Callable[[], float | dict[str, float]]]


def run_rounds(sides: list[tuple[Mode, Measures]]) -> list[dict[str, float]]:
    """Run every side's measures for REPEATS rounds, the sides alternating in each round,
    each measure as many times as fit in MEASURE_SECONDS (at least once) a round, and keep
    each measure's best: the highest throughput, the shortest time (`ttft...`)."""
    best: list[dict[str, float]] = [{} for _ in sides]
    for _ in range(REPEATS):
        for (mode, measures), kept in zip(sides, best, strict=True):
            with mode.active():
                for name, measure in measures.items():
                    t0 = time.perf_counter()
                    while True:
                        value = measure()  # one number, or several from one run (a dict)
                        items = value.items() if isinstance(value, dict) else [(name, value)]
                        for key, v in items:
                            better = min if key.startswith("ttft") else max
                            kept[key] = better(kept.get(key, v), v)
                        if time.perf_counter() - t0 >= MEASURE_SECONDS:
                            break
    return best


QUALITY_PROMPTS = (
    "What is 1234*56?",
    "How many r's are in strawberry?",
    "Tell me about the quick brown fox.",
)


def _greedy_tokens(generate, tokenizer) -> list[list[int]]:
    """The greedy reply to each quality prompt under one generation mode, up to (without) the
    first <|assistant_end|> or <|bos|>: the engine stops there, the baseline does not."""
    stops = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
    out = []
    for text in QUALITY_PROMPTS:
        if hasattr(tokenizer, "render_for_completion"):
            prompt = tokenizer.render_for_completion([{"role": "user", "content": text}])
        else:
            prompt = tokenizer.encode(text, prepend=tokenizer.get_bos_token_id())
        tokens = generate(prompt)
        cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
        out.append(tokens[:cut])
    return out


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of greedy tokens that agree before the first divergence, over all prompts."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        total += max(len(x), len(y))
        for s, t in zip(x, y, strict=False):
            if s != t:
                break
            same += 1
    return round(same / max(total, 1), 3)


def run_bench(
    model: GPT, tokenizer: Any, label: str, precision: str = "auto", compile: bool = False
) -> dict[str, Any]:
    """The baseline (eager fp32, default threads) against ours (the CPU plan applied, and
    the decode copies `precision` asks for), in alternating rounds (run_rounds), on the
    model's device (fp32 weights on it: the baseline's).

    precision: on the CPU the decode weights ours reads: auto (for large models the 16-bit
    copies the loader gives them, quantize.default_half_kind; else the fp32 weights),
    float32, or a quantize.QUANTIZE_KINDS format for any model. On a CUDA device the
    weights ours runs (gpu_weights: auto is what chatcli loads there).

    compile: ours as `--compile` runs it (step_choice.pick_decode_step).
    """
    device = model.get_device()
    if device.type == "cuda":
        with torch.cuda.device(device):  # what _sync waits for
            torch.cuda.reset_peak_memory_stats()
            weights = gpu_weights(precision, device)
            return _run_bench(model, tokenizer, label, weights, compile)
    return _run_bench(model, tokenizer, label, precision, compile)


def _run_bench(
    model: GPT, tokenizer: Any, label: str, precision: str | torch.dtype, compile: bool
) -> dict[str, Any]:
    torch.manual_seed(0)
    model.drop_decode_weights()  # the baseline reads fp32, whatever the loader added
    default_threads = torch.get_num_threads()
    # Greedy output: the baseline's is the reference; ours in fp32 must equal it, run as
    # ours runs (the CPU plan's threads).
    reference = _greedy_tokens(_baseline_greedy(model), tokenizer)
    plan = apply_cpu_plan(model)
    engine = Engine(model, tokenizer, compile=compile)
    fp32_identical = _greedy_tokens(_ours_greedy(engine), tokenizer) == reference
    ours_model, engine, decode_kind = _ours_side(model, tokenizer, engine, precision, compile)
    agreement = _agreement(_greedy_tokens(_ours_greedy(engine), tokenizer), reference)
    memory = _PeakMemory(model.get_device().type == "cuda")
    setup = _Setup(
        model=model,
        ours_model=ours_model,
        tokenizer=tokenizer,
        engine=engine,
        plan=plan,
        default_threads=default_threads,
        decode_kind=decode_kind,
        compile=compile,
        prompt=_prompt(tokenizer, min(512, model.config.sequence_len // 2)),
        short=_prompt(tokenizer, 32),
        # One buffer for every probe, none allocated each time; on a GPU 2 GB, since 512 MB
        # streams through its memory in about a kernel launch's own time.
        probe=bandwidth_probe(2048 if memory.gpu else 512, model.get_device()),
        wbytes=weight_bytes_per_token(ours_model),
        bf16_bytes=2 * matrix_params(model),
    )
    base, mine = _measure(setup)
    peak_mb, peak_device_mb = memory.peaks(setup.probe)
    torch.set_num_threads(default_threads)
    return {
        **_report(setup, label, base, mine),
        "greedy_identical_fp32": fp32_identical,
        "greedy_agreement": agreement,
        "peak_rss_mb": round(peak_mb, 1),
        # Device memory torch allocated at its peak (the probe taken out); None on the CPU.
        "peak_device_mb": peak_device_mb,
    }


def _baseline_greedy(model: GPT) -> Callable[[list[int]], list[int]]:
    def greedy(p: list[int]) -> list[int]:
        # Within the context, as ours stops there: past it the two cannot be compared.
        room = min(DECODE_TOKENS, model.config.sequence_len - len(p))
        return [c[0] for c in baseline_generate(model, p, 1, room, 0.0)]

    return greedy


def _ours_greedy(engine: Engine) -> Callable[[list[int]], list[int]]:
    def greedy(p: list[int]) -> list[int]:
        cols = engine.generate(p, max_tokens=DECODE_TOKENS, temperature=0.0, use_tools=False)
        return [c[0] for c, _ in cols]

    return greedy


def _ours_side(
    model: GPT, tokenizer: Any, engine: Engine, precision: str | torch.dtype, compile: bool
) -> tuple[GPT, Engine, str | None]:
    """(the model ours reads, its engine, the decode weights' kind or None for fp32): on a
    GPU its own copy in `precision`; on the CPU the same model with the decode copies
    `precision` asks for, and an engine that decides its decode path for them."""
    if isinstance(precision, torch.dtype):  # a GPU: ours runs its own copy in that dtype
        decode_kind = None if precision == torch.float32 else str(precision).split(".")[-1]
        if decode_kind is None:
            return model, engine, None
        ours_model = cast_copy(model, precision)
        return ours_model, Engine(ours_model, tokenizer, compile=compile), decode_kind
    decode_kind = precision if precision in QUANTIZE_KINDS else None
    if precision == "auto" and weight_bytes_per_token(model) / 4 > LARGE_MODEL_MATRIX_PARAMS:
        decode_kind = default_half_kind()
    if decode_kind is None:
        return model, engine, None
    model.add_decode_weights(decode_kind)
    return model, Engine(model, tokenizer, compile=compile), decode_kind


@dataclass
class _Setup:
    """What one bench run's two sides read: the models, ours' engine and threads, the
    prompts, the bandwidth probe's buffer and the bytes a decoded token reads."""

    model: GPT  # the baseline's, fp32
    ours_model: GPT
    tokenizer: Any
    engine: Engine
    plan: CpuPlan | None
    default_threads: int
    decode_kind: str | None
    compile: bool
    prompt: list[int]
    short: list[int]
    probe: torch.Tensor
    wbytes: float  # the weights a decoded token reads, as ours reads them
    bf16_bytes: float  # the same matrices read as bf16

    @property
    def ours_threads(self) -> int:
        return self.plan.threads if self.plan else self.default_threads


class _PeakMemory:
    """The process's peak memory without the bandwidth probe's buffer: the model's and the
    engines', not the bench's measuring buffer. Made before the probe is allocated."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        self.host_mb = _rss_mb()
        self.device_mb = torch.cuda.max_memory_allocated() / 2**20 if gpu else 0.0

    def peaks(self, probe: torch.Tensor) -> tuple[float, float | None]:
        """(the host's peak MB, the device's peak MB or None on the CPU)."""
        probe_mb = probe.numel() * probe.element_size() / 2**20
        if self.gpu:  # the probe is on the device: the host's peak is all ours
            after = torch.cuda.max_memory_allocated() / 2**20 - probe_mb
            return _rss_mb(), round(max(self.device_mb, after), 1)
        return max(self.host_mb, _rss_mb() - probe_mb), None


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _measure(s: _Setup) -> list[dict[str, float]]:
    """(the baseline's best measures, ours'), in alternating rounds (run_rounds)."""
    model, engine, prompt, short = s.model, s.engine, s.prompt, s.short
    baseline = Mode(model, s.default_threads, copies=False)
    ours = Mode(s.ours_model, s.ours_threads, copies=True)
    return run_rounds(
        [
            (
                baseline,
                {
                    "bandwidth": lambda: bandwidth_of(s.probe),
                    "prefill": lambda: _prefill_tps(model, prompt),
                    "decode1": lambda: _baseline_decode(model, short, 1),
                    "decode8": lambda: _baseline_decode(model, prompt, SAMPLES),
                    "ttft": lambda: chat_ttft(model, s.tokenizer, plain=True),
                },
            ),
            (
                ours,
                {
                    "prefill": lambda: _ours_prefill_tps(engine, prompt),
                    "decode1": lambda: ours_decode(engine, short, 1),
                    "decode8": lambda: ours_decode(engine, prompt, SAMPLES),
                    # What 8 samples gain over one of the same request: same prompt, sampling.
                    "sampled1": lambda: ours_decode(engine, prompt, 1, temperature=1.0),
                    "paired": lambda: roofline_fractions(
                        lambda: ours_decode(engine, short, 1),
                        s.probe,
                        s.default_threads,
                        s.wbytes,
                        s.bf16_bytes,
                    ),
                    "ttft": lambda: chat_ttft(
                        s.ours_model, s.tokenizer, plain=False, compile=s.compile
                    ),
                },
            ),
        ]
    )


def _report(
    s: _Setup, label: str, base: dict[str, float], mine: dict[str, float]
) -> dict[str, Any]:
    """The run's measures as the result dict reports them (the CLI's table and JSON)."""
    model, engine, device = s.model, s.engine, s.model.get_device()
    bandwidth = base["bandwidth"]
    base_1, ours_1 = base["decode1"], mine["decode1"]
    base_8, ours_8 = base["decode8"], mine["decode8"]
    ours_1_sampled = mine["sampled1"]
    ttft_base = {t: base[f"ttft{t}"] for t in TURNS}
    ttft_ours = {t: mine[f"ttft{t}"] for t in TURNS}

    def ratio(a: float, b: float) -> float:
        return round(a / b, 2) if b else 0.0

    step = engine.decode_step if isinstance(engine.decode_step, DecodeStep) else None
    roofline = bandwidth * 1e9 / s.wbytes
    # The same matrices read as bf16, whatever ours reads: the yardstick for big models.
    bf16_roofline = bandwidth * 1e9 / s.bf16_bytes
    copies_read = model.decode_weights() if not (step and step.kernel) else []
    return {
        "model": label,
        "params": sum(p.numel() for p in model.parameters()),
        "weights": s.decode_kind or "float32",
        "threads": {"baseline": s.default_threads, "ours": s.ours_threads},
        "plan": s.plan.reason if s.plan else "not a CPU model",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "decode_path": _decode_path(engine),
        "compile": s.compile,  # asked for; "compiled": whether ours' forward was compiled
        "compiled": engine.compiled,
        "step_kernel": step.kernel if step else None,
        # Why our C kernels do not run here (None where they do), and what builds them.
        "kernels": kernels_line() if device.type == "cpu" else None,
        "kernels_toolchain": toolchain_line() if device.type == "cpu" else None,
        # The threads ours' decode settled on by row count: a small model's plan is one
        # thread, yet its step through our kernel runs on every core where that is faster.
        "decode_threads": step.threads_by_rows() if step else {},
        # The copies' own kernels, where decode reads them: not where our step kernel
        # reads their panels itself.
        "one_row_kernels": sorted(
            {getattr(c, "one_row_kernel", type(c).__name__) for c in copies_read}
        ),
        "sample_rows_kernels": sorted(
            {getattr(c, "rows_kernel", type(c).__name__) for c in copies_read}
        ),
        "bandwidth_gbs": round(bandwidth, 1),
        "weight_mb_per_token": round(s.wbytes / 1e6, 1),
        "roofline_tps": round(roofline, 1),
        "prefill_tps": {"baseline": round(base["prefill"], 1), "ours": round(mine["prefill"], 1)},
        "decode_tps": {
            "baseline": round(base_1, 1),
            "ours": round(ours_1, 1),
            "ratio": ratio(ours_1, base_1),
        },
        "decode8_tps": {
            "baseline": round(base_8, 1),
            "ours": round(ours_8, 1),
            "ratio": ratio(ours_8, base_8),
        },
        "single_sampled_tps": round(ours_1_sampled, 1),
        "samples8_vs_single": ratio(ours_8, ours_1_sampled),
        "ttft_s": {
            "baseline": {t: round(v, 4) for t, v in ttft_base.items()},
            "ours": {t: round(v, 4) for t, v in ttft_ours.items()},
            "ours_turn10_over_turn1": ratio(ttft_ours[10], ttft_ours[1]),
            "baseline_turn10_over_turn1": ratio(ttft_base[10], ttft_base[1]),
            # The scripted chat outgrew the model's context: later turns include a rebuild.
            "chat_outgrew_context": bool(mine.get("chat_dropped") or base.get("chat_dropped")),
        },
        "roofline_fraction": round(ours_1 / roofline, 3),
        "bf16_roofline_tps": round(bf16_roofline, 1),
        "bf16_roofline_fraction": round(ours_1 / bf16_roofline, 3),
        # The same fractions against the bandwidth probed beside a decode run (best run).
        "roofline_fraction_paired": round(mine["roofline_paired"], 3),
        "bf16_roofline_fraction_paired": round(mine["bf16_roofline_paired"], 3),
    }


def _decode_path(engine: Engine) -> str:
    """How ours decoded one row at a time, as the report names it."""
    step = engine.decode_step
    if isinstance(step, StepWithFallback):  # a GPU's: did the CUDA graph hold to the end?
        return "CUDA graph" if step.fast is not None else f"module forward ({step.what} failed)"
    return "decode_step" if step is not None else "module forward"
