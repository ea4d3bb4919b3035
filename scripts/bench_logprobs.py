"""What asking for logprobs costs a decode (a benchmark, not a test).

    python scripts/bench_logprobs.py [--model PATH] [--tokens 200] [--rounds 15]

Decodes `--tokens` tokens (temperature 1, top-k 50, calculator off, a fixed seed) through
Engine.generate with logprobs not asked, asked with 0 alternatives, 5 (the chat's) and 20,
the four interleaved round by round so a noisy host's drift falls on all alike, and prints
each one's median decode tok/s and its cost against not asking. Then the cost alone: a
log_softmax and a top-k over one row of logits of the model's vocabulary and of nanochat
d20's (65536), in microseconds (best of five runs of 200). Prints JSON with --json.
"""

# ruff: noqa: E402 (OpenMP's wait is chosen before torch is imported)
from __future__ import annotations

import argparse
import json
import statistics
import time

from chatcli.cli.openmp_wait import choose_openmp_wait

choose_openmp_wait()

import torch

from chatcli.engine.cpu_plan import apply_cpu_plan
from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.logprobs import LogprobRecord, column_logprobs, distributions
from chatcli.model.checkpoint import load_model

ASKS = {"none": None, "top 0": 0, "top 5": 5, "top 20": 20}


def decode_tps(engine: Engine, prompt: list[int], tokens: int, top: int | None) -> float:
    stats = GenerationStats()
    record = None if top is None else LogprobRecord(top)
    steps = engine.generate(
        prompt, max_tokens=tokens, temperature=1.0, top_k=50, seed=1, use_tools=False,
        stats=stats, logprobs=record,
    )  # fmt: skip
    for _ in steps:
        pass
    return stats.decode_tps


def cost_us(vocab: int, top: int) -> float:
    logits = torch.randn(1, vocab)
    picked = torch.tensor([[3]])
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(200):
            column_logprobs(distributions(logits), picked, [3], [1], top)
        best = min(best, (time.perf_counter() - t) / 200 * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model, tokenizer, _ = load_model(args.model, device="cpu")
    apply_cpu_plan(model)
    engine = Engine(model, tokenizer)
    prompt = tokenizer.render_for_completion([{"role": "user", "content": "Tell me a story."}])
    decode_tps(engine, prompt, 16, 5)  # warm up
    runs: dict[str, list[float]] = {name: [] for name in ASKS}
    for _ in range(args.rounds):
        for name, top in ASKS.items():
            runs[name].append(decode_tps(engine, prompt, args.tokens, top))
    medians = {name: statistics.median(v) for name, v in runs.items()}
    vocab = int(model.config.vocab_size)
    costs = {f"vocab {v}, top {k}": cost_us(v, k) for v in (vocab, 65536) for k in (0, 5, 20)}
    if args.json:
        print(json.dumps({"decode_tps": medians, "runs": runs, "cost_us": costs}))
        return
    for name, tps in medians.items():
        change = tps / medians["none"] - 1
        print(f"logprobs {name:7s} {tps:8.1f} tok/s  ({change:+.1%} against none)")
    for name, us in costs.items():
        print(f"{name:24s} {us:7.1f} us a token")


if __name__ == "__main__":
    main()
