"""A/B the working tree's rows_step kernel against an earlier revision's (a benchmark, not a
test).

    python scripts/ab_rows_step.py --against d05e391 [--rounds 12] [--synthetic d20 [--quantize int8]]

On a shared host a slow spell can outlast a whole benchmark run, so two runs compare the
host more than the code. This builds chatcli/kernels/decode_ops.c as it was at the other
revision and as it is now (the flags kernels/build.py uses), loads both into one process, and
calls both on the same captured calls: the embedded model's step (or a synthetic model's,
with its fp16 copies) of one row and of 8 sample rows over one shared prompt (256 tokens;
512 for a synthetic model), as a generation at temperature 1 last made them. Each round
times both builds, in ABBA order (old, new, then new, old), on 1 and on 2 threads; it prints
the median and quartiles of the rounds' new/old ratios. The two builds share the model as
packed now, so the revision must read the same structs and panels.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "100000")  # as the CLI runs (openmp_wait.py)

import torch
from ab_rounds import ROOT, comparison_parser, rounds, source_at

from chatcli.bench.bench import _prompt
from chatcli.bench.models import synthetic_model
from chatcli.engine.cpu_plan import apply_cpu_plan
from chatcli.engine.engine import Engine
from chatcli.kernels.build import toolchain
from chatcli.kernels.rows_step import DECODE_OPS_SOURCE, RowsStep
from chatcli.model.checkpoint import load_model
from chatcli.model.quantize import default_half_kind


def build_rows_step(
    source: str, folder: Path, name: str, extra: tuple[str, ...] = (), openmp: bool = True
) -> tuple[RowsStep, ctypes.CDLL]:
    """decode_ops.c's text compiled into `folder` (the flags kernels/build.py uses, then
    `extra`; without -fopenmp where `openmp` is False: team.h's own threads) and loaded:
    the kernel, and the library for what else it exports."""
    c_file, library = folder / f"{name}.c", folder / f"{name}.so"
    c_file.write_text(source)
    flags = [f for f in toolchain().flags if openmp or f != "-fopenmp"]
    subprocess.run([toolchain().path, *flags, *extra, str(c_file), "-o", str(library)], check=True)
    loaded = ctypes.CDLL(str(library))
    return RowsStep(loaded), loaded


def captured_calls(synthetic: str | None, kind: str | None = None) -> dict[int, tuple]:
    """The embedded model's captured calls (_captured_calls) over a 256-token prompt, or a
    synthetic model's with its fp16 copies (or `kind`'s: int8) over 512 tokens."""
    if synthetic:
        torch.manual_seed(0)
        model, tokenizer = synthetic_model(synthetic)
        apply_cpu_plan(model)
        model.add_decode_weights(kind or default_half_kind())
        prompt_len = 512
    else:
        model, tokenizer, _ = load_model(None, device="cpu")
        apply_cpu_plan(model)
        prompt_len = 256
    calls = _captured_calls(Engine(model, tokenizer), _prompt(tokenizer, prompt_len))
    if not calls:
        raise SystemExit("this model's step does not run through rows_step here")
    return calls


def _captured_calls(engine: Engine, prompt: list[int]) -> dict[int, tuple]:
    """The last rows_step call's arguments of a generation of 1 row and one of 8."""
    calls: dict[int, tuple] = {}
    run = RowsStep.run

    def keep(self: RowsStep, *args: object) -> torch.Tensor:
        calls[args[1].size(0)] = args
        return run(self, *args)

    RowsStep.run = keep
    try:
        for rows in (1, 8):
            kwargs = dict(max_tokens=40, temperature=1.0, seed=3, use_tools=False)
            for _ in engine.generate(prompt, rows, **kwargs):
                pass
    finally:
        RowsStep.run = run
    return calls


def report_pair(
    old: RowsStep, new: RowsStep, calls: dict[int, tuple], n_rounds: int, per_round: int
) -> None:
    """Prints, for each captured call on 1 and 2 threads, the median and quartiles of the
    rounds' new/old time ratios, each round both in ABBA order."""
    for rows, captured in sorted(calls.items()):
        x, x0 = captured[1], captured[1].clone()  # the residual stream, updated in place
        for threads in (1, 2):
            call = (*captured[:-1], threads)
            ratios = []
            with torch.inference_mode():
                for r in range(n_rounds):
                    spent = {}
                    for name, kernel in [("old", old), ("new", new)][:: 1 if r % 2 == 0 else -1]:
                        for i in range(per_round + 2):
                            if i == 2:  # after a warm-up
                                t0 = time.perf_counter()
                            x.copy_(x0)
                            kernel.run(*call)
                        spent[name] = time.perf_counter() - t0
                    ratios.append(spent["new"] / spent["old"])
            low, _, high = statistics.quantiles(ratios, n=4)
            print(
                f"{rows} row(s), {threads} thread(s): new / old {statistics.median(ratios):.3f}"
                f" (quartiles {low:.3f}-{high:.3f}, {n_rounds} rounds)",
                flush=True,
            )


def main() -> None:
    parser = comparison_parser(__doc__)
    parser.add_argument("--synthetic", default=None, help="d4, d12 or d20 (fp16 copies)")
    parser.add_argument(
        "--quantize", default=None, help="int8 or int4: a synthetic model's copies of that kind"
    )
    args = parser.parse_args()
    n_rounds = rounds(parser, args)
    then = source_at(args.against, str(DECODE_OPS_SOURCE.relative_to(ROOT)))
    calls = captured_calls(args.synthetic, args.quantize)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        old, _ = build_rows_step(then, Path(folder), "old")
        new, _ = build_rows_step(DECODE_OPS_SOURCE.read_text(), Path(folder), "new")
        report_pair(old, new, calls, n_rounds, 3 if args.synthetic else 200)


if __name__ == "__main__":
    main()
