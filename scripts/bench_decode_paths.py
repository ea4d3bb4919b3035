"""Time the pieces behind `chatcli bench`'s decode numbers (a benchmark, not a test).

    python scripts/bench_decode_paths.py steps    # one model: module forward, fused, compiled
    python scripts/bench_decode_paths.py kernels  # d20-shaped matrices: fp32/bf16/int8/int4/fp16
    python scripts/bench_decode_paths.py layouts  # one model's matrices: (out, in) or (in, out)
    python scripts/bench_decode_paths.py parts    # a step's parts: kernel, rest, sampling

`steps` decodes 48 greedy tokens from a fixed prompt through Engine.generate with each decode
path of one model (default: the embedded one) and prints milliseconds per token, best of three,
and whether the greedy tokens are identical. `kernels` times one token's worth of
matrix-vector products over nanochat d20's matrices (20 layers, 1280 wide, vocab 65536) in each
weight format of chatcli/model/quantize.py and prints the bandwidth each streams and how far one
layer's products land from fp32's (relative error); then, in rounds that alternate the forms
(as a difference of ~10% needs on a noisy host), one row through fp16 copies against bf16
ones and a plain fp16 torch.mv, and 8 sample rows through fp16 copies against fp32; then
int8 copies through our kernel against fbgemm's and against fp16 copies, one row and 8.
`layouts` times each kind of matrix of one model (default: the embedded one; q, k and v
stacked) for one row and for 8 rows, read as the (out, in) weight and as a transposed (in,
out) copy, with the caches flushed before every pass so the weights come from memory as they
do in a step: the measurements behind step_matrices.StepMatrix's choice of layout.
`parts` splits one model's decode (default: the embedded one) over a 256-token prompt, as
`chatcli bench` runs it, into its parts: in generations of one row and of 8 sample rows
(temperature 1, 200 tokens at most, three seeds) the time a step spends in our rows_step
kernel, in the rest of the decode step and in sampling, in us per step; then the kernel
alone, called again and again on the same arguments, on one thread and on two (best of five
rounds of 300 calls), where the weights stay in the caches between calls.
"""

# ruff: noqa: E402 (OpenMP's wait is chosen before torch is imported)
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from chatcli.cli.openmp_wait import choose_openmp_wait

choose_openmp_wait()  # before torch starts its threads, as the CLI does

import torch

from chatcli.engine.engine import Engine
from chatcli.engine.static_step import StaticDecodeStep
from chatcli.model.checkpoint import load_model
from chatcli.model.kv_cache import KVCache
from chatcli.model.linear import linear
from chatcli.model.quantize import QUANTIZE_KINDS, DecodeWeight, Int8Weight, make_decode_weight

TOKENS = 48


def _per_token_ms(engine: Engine, prompt: list[int]) -> tuple[float, list[int]]:
    best, tokens = float("inf"), []
    for _ in range(3):
        t0 = time.perf_counter()
        tokens = [c[0] for c, _ in engine.generate(prompt, max_tokens=TOKENS, temperature=0.0)]
        best = min(best, (time.perf_counter() - t0) / len(tokens))
    return best * 1e3, tokens


class _CompiledStatic:
    """The static step through torch.compile (what --compile once did for small models)."""

    reads_whole_cache = True  # under a mask: the Engine hands it a zeroed cache
    wants_full_cache = False

    def __init__(self, model) -> None:
        self.step = StaticDecodeStep(model)
        self.fn = torch.compile(self.step.forward_static, fullgraph=True, dynamic=False)

    def __call__(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        idx = ids.view(-1)
        pos = torch.tensor([cache.get_pos()])
        has_prev = cache.get_pos() > 0 and cache.prev_token is not None
        prev = cache.prev_token.clone() if has_prev else idx.clone()
        flag = torch.ones(1) if has_prev else torch.zeros(1)
        logits = self.fn(idx, pos, prev, flag, cache.k_cache, cache.v_cache)
        cache.prev_token = idx
        cache.advance(1)
        return logits


def steps(model_path: str | None) -> None:
    torch.set_num_threads(1)  # the CPU plan for a small model
    model, tokenizer, _ = load_model(model_path, device="cpu")
    prompt = tokenizer.render_for_completion([{"role": "user", "content": "Who are you?"}])
    fused = Engine(model, tokenizer)
    module = Engine(model, tokenizer)
    module.decode_step = None
    compiled = Engine(model, tokenizer)
    compiled.decode_step = _CompiledStatic(model)
    t0 = time.perf_counter()
    _per_token_ms(compiled, prompt)
    print(f"compiling the static step: {time.perf_counter() - t0:.1f} s")
    reference = None
    for name, engine in [("module forward", module), ("fused step", fused), ("compiled", compiled)]:
        ms, tokens = _per_token_ms(engine, prompt)
        reference = reference or tokens
        print(f"{name:15s} {ms:6.3f} ms/token  greedy identical: {tokens == reference}")


def kernels() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    shapes = [(3840, 1280), (1280, 1280), (5120, 1280), (1280, 5120)] * 20 + [(65536, 1280)]
    xs = {1280: torch.randn(1280), 5120: torch.randn(5120)}
    weights = [torch.randn(*s) * 0.02 for s in shapes]
    with torch.inference_mode():
        for kind in ("float32", *QUANTIZE_KINDS):
            if kind == "float32":
                copies, nbytes = None, sum(w.numel() * 4 for w in weights)
            else:
                copies = [make_decode_weight(w, kind) for w in weights]
                nbytes = sum(c.nbytes for c in copies)

            def token(copies=copies) -> None:
                for i, w in enumerate(weights):
                    x = xs[w.shape[1]]
                    torch.mv(w, x) if copies is None else copies[i].matvec(x)

            token()
            t0 = time.perf_counter()
            for _ in range(3):
                token()
            ms = (time.perf_counter() - t0) / 3 * 1e3
            error = 0.0 if copies is None else _relative_error(weights[:4], copies, xs)
            print(
                f"{kind:11s} {ms:6.1f} ms/token  {nbytes / ms / 1e6:5.1f} GB/s  "
                f"{1e3 / ms:5.1f} tok/s  {error:.1e} from fp32"
            )
            del copies
        _fp16_kernels(weights, xs)
        _int8_kernels(weights, xs)


def _relative_error(
    weights: list[torch.Tensor], copies: list[DecodeWeight], xs: dict[int, torch.Tensor]
) -> float:
    """How far one layer's products through the copies are from fp32's: the mean over its
    matrices of |copy @ x - W @ x| / |W @ x|."""
    errors = []
    for w, c in zip(weights, copies, strict=False):
        want = torch.mv(w, xs[w.shape[1]])
        errors.append(float((c.matvec(xs[w.shape[1]]) - want).norm() / want.norm()))
    return sum(errors) / len(errors)


def _alternating(
    tokens: dict[str, Callable[[], object]], rounds: int = 8
) -> dict[str, list[float]]:
    """ms of each callable in rounds that alternate their order (after one warm-up each)."""
    times: dict[str, list[float]] = {k: [] for k in tokens}
    for token in tokens.values():
        token()
    for round_ in range(rounds):
        order = list(tokens.items())
        for label, token in order if round_ % 2 == 0 else reversed(order):
            t0 = time.perf_counter()
            token()
            times[label].append((time.perf_counter() - t0) * 1e3)
    return times


def _print_rounds(title: str, times: dict[str, list[float]], against: str) -> None:
    print(f"{title}, ms a token (median, range), in rounds alternating the forms:")
    for label, ms in times.items():
        print(f"  {label:17s} {statistics.median(ms):6.1f}  {min(ms):6.1f}-{max(ms):6.1f}")
    for label in times:
        if label != against:
            ratios = [a / b for a, b in zip(times[label], times[against], strict=True)]
            print(f"  {label} / {against} per round: " + " ".join(f"{r:.2f}" for r in ratios))


def _fp16_kernels(weights: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> None:
    """fp16 copies (quantize.Fp16Weight: fbgemm's fp16 GEMM on x86) against bf16 ones and a
    plain fp16 torch.mv for one row, and against fp32 (model.linear) for 8 sample rows."""
    copies = {k: [make_decode_weight(w, k) for w in weights] for k in ("bfloat16", "float16")}
    plain = [w.to(torch.float16) for w in weights]
    rows = {k: torch.randn(8, k) for k in xs}

    def one_row(kind: str) -> Callable[[], None]:
        def token() -> None:
            for w, c in zip(weights, copies[kind], strict=True):
                c.matvec(xs[w.shape[1]])

        return token

    def plain_fp16() -> None:
        for w in plain:
            torch.mv(w, xs[w.shape[1]].half()).float()

    def rows_fp32() -> None:
        for w in weights:
            linear(rows[w.shape[1]], w)

    def rows_fp16() -> None:
        for w, c in zip(weights, copies["float16"], strict=True):
            c.matmul(rows[w.shape[1]])

    one = {"bfloat16": one_row("bfloat16"), "float16": one_row("float16")}
    one["plain fp16 mv"] = plain_fp16
    _print_rounds("one row", _alternating(one), against="bfloat16")
    eight = {"fp32": rows_fp32, "float16": rows_fp16}
    _print_rounds("8 rows", _alternating(eight, rounds=4), against="fp32")


def _int8_kernels(weights: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> None:
    """int8 copies read by our kernel (weight-only, fp32 activations: rows_int8_product)
    against fbgemm's dynamic int8 linear and the fp16 copies, for one row and for 8."""
    forms = {
        "int8 ours": [Int8Weight(w, use_native=True) for w in weights],
        "int8 fbgemm": [Int8Weight(w, use_fbgemm=True) for w in weights],
        "float16": [make_decode_weight(w, "float16") for w in weights],
    }
    rows = {k: torch.randn(8, k) for k in xs}

    def pass_of(copies: list[DecodeWeight], n: int) -> Callable[[], None]:
        def token() -> None:
            for w, c in zip(weights, copies, strict=True):
                c.matvec(xs[w.shape[1]]) if n == 1 else c.matmul(rows[w.shape[1]])

        return token

    for n, title in ((1, "int8, one row"), (8, "int8, 8 rows")):
        tokens = {label: pass_of(copies, n) for label, copies in forms.items()}
        _print_rounds(title, _alternating(tokens, rounds=6), against="int8 fbgemm")


def _layout_passes(ws: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    """One pass over every matrix of a kind, in each layout, for one row and for 8."""
    wts = [w.t().contiguous() for w in ws]
    x, rows = torch.randn(ws[0].size(1)), torch.randn(8, ws[0].size(1))
    return {
        "1 row mv(W)": lambda: [torch.mv(w, x) for w in ws],
        "1 row x @ Wt": lambda: [x @ w for w in wts],
        "8 rows linear(W)": lambda: [torch.nn.functional.linear(rows, w) for w in ws],
        "8 rows x @ Wt": lambda: [rows @ w for w in wts],
    }


def layouts(model_path: str | None) -> None:
    torch.set_num_threads(1)  # the CPU plan for a small model
    model, _, _ = load_model(model_path, device="cpu")
    kinds: dict[str, list[torch.Tensor]] = {"qkv": [], "proj": [], "fc": [], "fc_proj": []}
    for block in model.transformer.h:
        a, m = block.attn, block.mlp
        kinds["qkv"].append(torch.cat([a.c_q.weight, a.c_k.weight, a.c_v.weight]).detach())
        kinds["proj"].append(a.c_proj.weight.detach())
        kinds["fc"].append(m.c_fc.weight.detach())
        kinds["fc_proj"].append(m.c_proj.weight.detach())
    kinds["lm_head"] = [model.lm_head.weight.detach()]
    flush = torch.randn(4 << 20)  # 16 MB: more than this CPU's L2, most of its L3
    with torch.inference_mode():
        for name, ws in kinds.items():
            passes = _layout_passes(ws)
            best = dict.fromkeys(passes, float("inf"))
            for _ in range(30):
                for label, run in passes.items():
                    flush.sum()
                    t0 = time.perf_counter()
                    run()
                    best[label] = min(best[label], (time.perf_counter() - t0) / len(ws))
            shape = "x".join(map(str, ws[0].shape))
            cells = "  ".join(f"{k} {v * 1e6:4.0f}" for k, v in best.items())
            print(f"{name:8s} {shape:9s} {cells}  (us per matrix)")


def parts(model_path: str | None) -> None:
    from chatcli.bench.bench import _prompt
    from chatcli.engine import engine as engine_module
    from chatcli.engine.cpu_plan import apply_cpu_plan
    from chatcli.engine.decode_step import DecodeStep
    from chatcli.kernels.rows_step import RowsStep

    model, tokenizer, _ = load_model(model_path, device="cpu")
    apply_cpu_plan(model)
    engine = Engine(model, tokenizer)
    if not isinstance(engine.decode_step, DecodeStep) or engine.decode_step.kernel is None:
        raise SystemExit("this model's step does not run through rows_step here")
    prompt = _prompt(tokenizer, 256)
    spent: dict[str, float] = {}
    calls: dict[int, tuple] = {}  # rows -> the last kernel call's arguments

    def timed(name: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

        return run

    run_kernel = RowsStep.run
    step_call = DecodeStep.__call__
    sample = engine_module.sample_next_token

    def kernel(self, *args):
        calls[args[1].size(0)] = (self, args)
        return run_kernel(self, *args)

    RowsStep.run = timed("kernel", kernel)
    DecodeStep.__call__ = timed("step", step_call)
    engine_module.sample_next_token = timed("sampling", sample)
    try:
        for rows in (1, 8):
            for seed in (1, 2, 3):
                spent.clear()
                columns = sum(
                    1
                    for _ in engine.generate(
                        prompt, rows, max_tokens=200, temperature=1.0, seed=seed, use_tools=False
                    )
                )
                us = {k: v / max(columns - 1, 1) * 1e6 for k, v in spent.items()}
                print(
                    f"{rows} row(s), {columns - 1} steps: kernel {us['kernel']:4.0f}  rest of "
                    f"the step {us['step'] - us['kernel']:4.0f}  sampling {us['sampling']:4.0f} "
                    "us per step"
                )
    finally:
        RowsStep.run, DecodeStep.__call__ = run_kernel, step_call
        engine_module.sample_next_token = sample
    torch.set_num_threads(1)
    for rows in (1, 8):
        for threads in (1, 2):
            best = _kernel_alone(run_kernel, *calls[rows], threads)
            print(f"kernel alone, {rows} row(s) on {threads} thread(s): {best * 1e6:4.0f} us")


def _kernel_alone(run_kernel: Callable, kernel: object, args: tuple, threads: int) -> float:
    """Seconds a call of rows_step on `args` takes on `threads`, best of five rounds of 300,
    the residual stream (which the kernel updates in place) put back before every call."""
    x, x0 = args[1], args[1].clone()
    call = (*args[:-1], threads)  # the last argument: the kernel's thread count
    best = float("inf")
    with torch.inference_mode():
        for _ in range(5):
            for i in range(320):
                if i == 20:  # after a warm-up
                    t0 = time.perf_counter()
                x.copy_(x0)  # ~1 us
                run_kernel(kernel, *call)
            best = min(best, (time.perf_counter() - t0) / 300)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["steps", "kernels", "layouts", "parts"])
    parser.add_argument(
        "--model", default=None, help="checkpoint for `steps` and `layouts` (default: embedded)"
    )
    args = parser.parse_args()
    if args.what == "kernels":
        kernels()
    else:
        {"steps": steps, "layouts": layouts, "parts": parts}[args.what](args.model)


if __name__ == "__main__":
    main()
