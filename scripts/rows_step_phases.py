"""Where rows_step's time goes, phase by phase (a benchmark, not a test).

    python scripts/rows_step_phases.py [--synthetic d20] [--calls N]

Builds chatcli/kernels/decode_ops.c with -DROWS_STEP_PHASES, where the first OpenMP thread
adds each phase's time (its barrier included, so a phase's wait for the slower thread is
its own) to a table the library exports, and calls it on the embedded model's captured
steps (or a synthetic model's, with its fp16 copies) of one row and of 8 sample rows over a
shared prompt (256 tokens; 512 for a synthetic model), as a generation at temperature 1
last made them (scripts/ab_rows_step.py's calls). Prints each phase's time per call, on
two threads: the products (qkv, proj, fc, fc_proj, the vocabulary's with the softcap), the
attention (its units: rotary and the K/V writes, the scores, the softmax and the values,
each unit on one thread) and the rest.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "100000")  # as the CLI runs (openmp_wait.py)

import torch
from ab_rows_step import build_rows_step, captured_calls

from chatcli.kernels.rows_step import DECODE_OPS_SOURCE

PHASES = (
    "lambdas and norm",
    "qkv",
    "attention",
    "proj",
    "norm",
    "fc",
    "fc_proj",
    "backout, last norm",
    "vocabulary, softcap",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", default=None, help="d4, d12 or d20 (fp16 copies)")
    parser.add_argument("--calls", type=int, default=None, help="calls timed per row count")
    args = parser.parse_args()
    captured = captured_calls(args.synthetic)
    big = bool(args.synthetic)
    calls = args.calls or (20 if big else 2000)
    unit, scale = ("ms", 1e3) if big else ("us", 1e6)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        source = DECODE_OPS_SOURCE.read_text()
        kernel, loaded = build_rows_step(source, Path(folder), "phases", ("-DROWS_STEP_PHASES",))
        loaded.rows_step_phases.restype = ctypes.POINTER(ctypes.c_double)
        table = loaded.rows_step_phases()
        for rows, call in sorted(captured.items()):
            x, x0 = call[1], call[1].clone()  # the residual stream, updated in place
            two = (*call[:-1], 2)
            with torch.inference_mode():
                for _ in range(3):  # warm-up
                    x.copy_(x0)
                    kernel.run(*two)
                for i in range(len(PHASES)):
                    table[i] = 0.0
                t0 = time.perf_counter()
                for _ in range(calls):
                    x.copy_(x0)
                    kernel.run(*two)
                total = (time.perf_counter() - t0) / calls
            parts = ", ".join(
                f"{name} {table[i] / calls * scale:.1f}" for i, name in enumerate(PHASES)
            )
            print(f"{rows} row(s), 2 threads: {total * scale:.1f} {unit} a call: {parts}")


if __name__ == "__main__":
    main()
