"""What speculative decoding gives and costs (a benchmark, not a test).

    python scripts/bench_speculation.py [--synthetic d12|d20] [--rows 2,3,4] [--json]

The speculation rows `chatcli bench` adds (chatcli.bench.speculation_rows), alone, without the
rest of the bench: the embedded model, or random weights of nanochat's shapes with the 16-bit
decode copies the bench gives a big model (then the copy prompt's reply is also replayed as
drafts, all taken and none). Then what a verification costs alone: the fastest of 12 calls of
Engine.forward_last (one token) and Engine.forward_verify (2, 4 and 7 tokens), 60 positions
into the cache, which is rewound between calls. Then a server worker's batch: N rows (--rows)
joined at once into a Scheduler's slots, each the copy prompt or each the open-ended one,
decoded plainly and drafting in turn (best of 3 rounds each): the batch's tokens a second.
"""

# ruff: noqa: E402 (OpenMP's wait is chosen before torch is imported)
from __future__ import annotations

import argparse
import json
import time

from chatcli.cli.openmp_wait import choose_openmp_wait

choose_openmp_wait()

import torch

from chatcli.bench.models import synthetic_model
from chatcli.bench.roofline import matrix_params
from chatcli.bench.speculation_rows import (
    COPY_PROMPT,
    OPEN_PROMPT,
    REPLY_TOKENS,
    chat_prompt,
    run_speculation_bench,
)
from chatcli.engine.cpu_plan import apply_cpu_plan
from chatcli.engine.engine import Engine
from chatcli.engine.scheduler import RowRequest, Scheduler
from chatcli.model.checkpoint import load_model
from chatcli.model.model_build import LARGE_MODEL_MATRIX_PARAMS
from chatcli.model.quantize import default_half_kind


@torch.inference_mode()
def verify_costs(engine: Engine) -> dict[int, float]:
    """Milliseconds of a step (1) and of verifications of 2, 4 and 7 positions: best of 12."""
    cache = engine.new_cache(1, 256)
    g = torch.Generator().manual_seed(0)
    engine.forward_last(torch.randint(0, 200, (1, 60), generator=g), cache)
    base = cache.get_pos()
    out = {}
    for T in (1, 2, 4, 7):
        best = float("inf")
        for _ in range(12):
            cache.rewind(base, 5)
            ids = torch.randint(0, 200, (1, T), generator=g)
            t0 = time.perf_counter()
            if T == 1:
                engine.forward_last(ids, cache)
            else:
                engine.forward_verify(ids, cache)
            best = min(best, time.perf_counter() - t0)
        out[T] = round(1e3 * best, 2)
    return out


@torch.inference_mode()
def batch_rows(engine: Engine, tokenizer, rows: list[int]) -> list[dict]:
    """Each count of rows, each workload: the batch's tok/s plain and drafting."""
    out = []
    for n in rows:
        for name, text in (("copy", COPY_PROMPT), ("open-ended", OPEN_PROMPT)):
            prompt = chat_prompt(tokenizer, text)
            tps, replies, accepted = {}, {}, 0
            for _ in range(3):
                for speculate in (False, True):
                    engine.speculate = speculate
                    batch = Scheduler(engine, rows=n)
                    gens = [
                        batch.join(RowRequest(prompt, max_tokens=REPLY_TOKENS, temperature=0.0))
                        for _ in range(n)
                    ]
                    t0, tokens = time.perf_counter(), 0
                    while batch.running:
                        tokens += len(batch.step().tokens)
                    rate = tokens / (time.perf_counter() - t0)
                    tps[speculate] = max(tps.get(speculate, 0.0), rate)
                    replies[speculate] = [g.tokens for g in gens]
                    if speculate:
                        accepted = sum(g.stats.speculation.accepted for g in gens)
            out.append({
                "rows": n, "workload": name, "plain_tps": round(tps[False], 1),
                "speculate_tps": round(tps[True], 1),
                "ratio": round(tps[True] / tps[False], 3), "accepted": accepted,
                "same_replies": replies[False] == replies[True],
            })  # fmt: skip
    engine.speculate = False
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", choices=["d4", "d12", "d20"], default=None)
    parser.add_argument("--rows", default="2,3,4", help="a server batch's row counts")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.synthetic is None:
        model, tokenizer, _ = load_model(device="cpu")
    else:
        model, tokenizer = synthetic_model(args.synthetic)
        if matrix_params(model) > LARGE_MODEL_MATRIX_PARAMS:  # as `chatcli bench` does
            model.add_decode_weights(default_half_kind())
    apply_cpu_plan(model)
    engine = Engine(model, tokenizer)
    result = {
        "rows": run_speculation_bench(engine, tokenizer, args.synthetic is not None),
        "verify_ms": verify_costs(engine),
        "batch": batch_rows(engine, tokenizer, [int(n) for n in args.rows.split(",")]),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for row in result["rows"]:
        print(
            f"{row['workload']:>24}: plain {row['plain_tps']} tok/s, drafting "
            f"{row['speculate_tps']} ({row['ratio']}x), drafts taken {row['acceptance']:.0%}, "
            f"{row['tokens_per_verification']} tokens a verification, same reply "
            f"{row['same_reply']}"
        )
    ms = result["verify_ms"]
    print(
        "verification, best of 12: "
        + ", ".join(f"{t} token{'s' if t > 1 else ''} {v} ms" for t, v in ms.items())
        + f"; 7 / 1: {ms[7] / ms[1]:.2f}"
    )
    for row in result["batch"]:
        print(
            f"{row['rows']} rows, {row['workload']:>10}: plain {row['plain_tps']} tok/s, drafting "
            f"{row['speculate_tps']} ({row['ratio']}x), {row['accepted']} drafts taken, same "
            f"replies {row['same_replies']}"
        )


if __name__ == "__main__":
    main()
