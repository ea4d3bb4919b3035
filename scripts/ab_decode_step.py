"""A/B the fused decode step of the working tree against an earlier revision's (a benchmark,
not a test).

    python scripts/ab_decode_step.py --against b3c7638 [--rounds 12] [--model PATH]

On a shared host a slow spell can outlast a whole benchmark run, so timing two versions in
two runs compares the host more than the code. This loads the other revision's
chatcli/engine/decode_step.py beside the working tree's, in one process over the same loaded model,
and times both in ABBA rounds (old, new, new, old): 48 steps of one row, then of 8 sample rows
over one shared 256-token prompt, one thread (the small-model plan). It prints each mode's
best time per step and the median and quartiles of the rounds' new/old ratios.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from types import ModuleType

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its threads

import torch
from ab_rounds import comparison_parser, rounds, source_at

from chatcli.bench.bench import _prompt
from chatcli.engine import decode_step
from chatcli.engine.engine import Engine
from chatcli.model.checkpoint import load_model
from chatcli.model.kv_cache import SharedPrefixCache

STEPS = 48


def _module_at(revision: str) -> ModuleType:
    """chatcli/engine/decode_step.py as it was at `revision`, imported under another name."""
    source = source_at(revision, "chatcli/engine/decode_step.py")
    module = ModuleType("decode_step_then")
    sys.modules[module.__name__] = module  # its dataclasses look their module up there
    exec(compile(source, f"{revision}:chatcli/engine/decode_step.py", "exec"), module.__dict__)
    return module


def main() -> None:
    parser = comparison_parser(__doc__)
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded one)")
    args = parser.parse_args()
    rounds(parser, args)
    torch.set_num_threads(1)
    model, tokenizer, _ = load_model(args.model, device="cpu")
    engine = Engine(model, tokenizer)
    prompt = _prompt(tokenizer, 256)
    with torch.inference_mode():
        shared = engine.new_cache(1, len(prompt))
        engine.forward_last(torch.tensor([prompt]), shared)
    steps = {
        "old": _module_at(args.against).DecodeStep(model),
        "new": decode_step.DecodeStep(model),
    }

    def per_step(step, rows: int) -> float:
        with torch.inference_mode():
            if rows > 1:
                cache = SharedPrefixCache(shared, rows, STEPS + 1)
            else:
                cache = engine.new_cache(1, len(prompt) + STEPS + 1)
                cache.prefill(shared)
            ids = torch.full((rows, 1), 65)
            t0 = time.perf_counter()
            for _ in range(STEPS):
                step(ids, cache)
            return (time.perf_counter() - t0) / STEPS

    for rows in (1, 8):
        for step in steps.values():  # warm both
            per_step(step, rows)
        ratios, best = [], {"old": float("inf"), "new": float("inf")}
        for _ in range(args.rounds):
            old1, new1 = per_step(steps["old"], rows), per_step(steps["new"], rows)
            new2, old2 = per_step(steps["new"], rows), per_step(steps["old"], rows)
            ratios.append((new1 + new2) / (old1 + old2))
            best["old"] = min(best["old"], old1, old2)
            best["new"] = min(best["new"], new1, new2)
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        print(
            f"{rows} row{'s' if rows > 1 else ''}: best old {best['old'] * 1e3:.3f} ms, "
            f"new {best['new'] * 1e3:.3f} ms per step; new/old median {median:.3f} "
            f"(quartiles {q1:.3f}-{q3:.3f}, {args.rounds} rounds)"
        )


if __name__ == "__main__":
    sys.exit(main())
