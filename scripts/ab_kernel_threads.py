"""A/B the rows_step kernel's threads: OpenMP (old) against team.h's own pthreads pool (new),
the same source built both ways by the compiler kernels/build.py uses (a benchmark, not a test).

    python scripts/ab_kernel_threads.py [--rounds 12] [--synthetic d20]

What a compiler without OpenMP (Apple clang, clang without libomp) gets, measured where one
with OpenMP can stand beside it: both builds loaded into one process and timed in ABBA rounds
on the same captured calls as scripts/ab_rows_step.py (its report: new / old time ratios).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from ab_rows_step import build_rows_step, captured_calls, report_pair

from chatcli.kernels.build import toolchain
from chatcli.kernels.rows_step import DECODE_OPS_SOURCE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="at least 2 (for quartiles)")
    parser.add_argument("--synthetic", default=None, help="d4, d12 or d20 (fp16 copies)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: the quartiles need two ratios")
    if not toolchain().openmp:
        parser.error(f"{toolchain().compiler} has no OpenMP here: nothing to compare against")
    calls = captured_calls(args.synthetic)
    torch.set_num_threads(1)
    source = DECODE_OPS_SOURCE.read_text()
    with tempfile.TemporaryDirectory() as folder:
        openmp, _ = build_rows_step(source, Path(folder), "openmp")
        pool, _ = build_rows_step(source, Path(folder), "pool", openmp=False)
        report_pair(openmp, pool, calls, args.rounds, 3 if args.synthetic else 200)


if __name__ == "__main__":
    main()
