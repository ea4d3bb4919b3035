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

from chatcli.bench.roofline import bandwidth_of, bandwidth_probe
from chatcli.engine.cpu_plan import torch_threads
from chatcli.kernels.rows_step import DECODE_OPS_SOURCE, RowsModel

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


def products_rate(model: RowsModel, table: object, calls: int) -> str:
    """GB/s each product phase read its matrices at (a layer's, times the layers; the
    vocabulary's with its softcap), from the phases' times."""
    layer_bytes = [0, 0, 0, 0]
    for la in model.layers:
        for i, m in enumerate(la.matrices):
            layer_bytes[i] += _nbytes(m)
    rates = []
    for name, phase, nbytes in zip(
        ("qkv", "proj", "fc", "fc_proj", "vocabulary"),
        (1, 3, 5, 6, 8),
        (*layer_bytes, _nbytes(model.lm_head)),
        strict=True,
    ):
        rates.append(f"{name} {nbytes / (table[phase] / calls) / 1e9:.1f}")
    total = sum(layer_bytes) + _nbytes(model.lm_head)
    return f"products' GB/s: {', '.join(rates)} ({total / 1e6:.0f} MB a token)"


def _nbytes(matrix: object) -> int:
    for attr in ("buffer", "panels"):
        if hasattr(matrix, attr):
            t = getattr(matrix, attr)
            return t.numel() * t.element_size()
    return matrix.numel() * matrix.element_size()


def probe_rate(threads: int) -> str:
    """The memory's streaming read on `threads` threads (the bench's probe), best of 5."""
    with torch_threads(threads):
        return f"probe {bandwidth_of(bandwidth_probe()):.1f} GB/s on {threads} thread(s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", default=None, help="d4, d12 or d20 (fp16 copies)")
    parser.add_argument("--calls", type=int, default=None, help="calls timed per row count")
    parser.add_argument(
        "--quantize", default=None, help="int8 or int4: a synthetic model's copies of that kind"
    )
    parser.add_argument("--threads", type=int, default=2, help="the step's threads")
    args = parser.parse_args()
    captured = captured_calls(args.synthetic, args.quantize)
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
            two = (*call[:-1], args.threads)
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
            print(
                f"{rows} row(s), {args.threads} threads: {total * scale:.1f} {unit} a call: {parts}"
            )
            if big and rows == 1:  # the products' streams against the memory's
                rate = products_rate(call[0], table, calls)
                print(f"  {rate}; {probe_rate(args.threads)}", flush=True)


if __name__ == "__main__":
    main()
