"""A/B the rows_step kernel's source built two ways by the compiler kernels/build.py uses (a
benchmark, not a test).

    python scripts/ab_kernel_builds.py --threads [--rounds 12] [--synthetic d20 [--quantize int8]]
    python scripts/ab_kernel_builds.py -D INT8_PREFETCH_BYTES=1536 --synthetic d20 --quantize int8

--threads: OpenMP (old) against team.h's own pthreads pool (new): what a compiler without
OpenMP (Apple clang, clang without libomp) gets, measured where one with OpenMP can stand
beside it. -D NAME=VALUE: the source as it is (old) against it built with that define (new).
Both builds are loaded into one process and timed in ABBA rounds on the same captured calls
as scripts/ab_rows_step.py (its report: new / old time ratios).
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
    parser.add_argument(
        "--quantize", default=None, help="int8 or int4: a synthetic model's copies of that kind"
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--threads", action="store_true", help="OpenMP against pthreads")
    which.add_argument("-D", dest="define", help="NAME=VALUE: as is against with the define")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: the quartiles need two ratios")
    if args.threads and not toolchain().openmp:
        parser.error(f"{toolchain().compiler} has no OpenMP here: nothing to compare against")
    calls = captured_calls(args.synthetic, args.quantize)
    torch.set_num_threads(1)
    source = DECODE_OPS_SOURCE.read_text()
    with tempfile.TemporaryDirectory() as folder:
        old, _ = build_rows_step(source, Path(folder), "old")
        if args.threads:
            new, _ = build_rows_step(source, Path(folder), "new", openmp=False)
        else:
            new, _ = build_rows_step(source, Path(folder), "new", (f"-D{args.define}",))
        report_pair(old, new, calls, args.rounds, 3 if args.synthetic else 200)


if __name__ == "__main__":
    main()
