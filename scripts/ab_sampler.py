"""Chat-default decode speed with the sample_rows kernel against torch's sampling ops (a
benchmark, not a test).

    python scripts/ab_sampler.py [--rounds 8]

Generates 48 tokens of one row from a 64-token prompt of the embedded model, eleven seeds a
measure, at chat's defaults (temperature 0.6, top-k 50), with sampling.sample_next_token
through the kernel and with the kernel turned off (torch's ~10 ops), alternating which goes
first each round so that a slow spell of the shared host falls on both. Prints the median
tok/s of each and the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("GOMP_SPINCOUNT", "100000")  # as the CLI runs (openmp_wait.py)

from chatcli.bench.bench import _prompt
from chatcli.engine.cpu_plan import apply_cpu_plan
from chatcli.engine.engine import Engine, GenerationStats
from chatcli.kernels.sample_rows import sample_rows
from chatcli.model import sampling
from chatcli.model.checkpoint import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    if sample_rows() is None:
        raise SystemExit("the sample_rows kernel is not available here")
    model, tokenizer, _ = load_model(None, device="cpu")
    apply_cpu_plan(model)
    engine = Engine(model, tokenizer)
    prompt = _prompt(tokenizer, 64)

    def tokens_per_second() -> float:
        steps, seconds = 0, 0.0
        for seed in range(1, 12):
            stats = GenerationStats()
            for _ in engine.generate(
                prompt, max_tokens=48, temperature=0.6, top_k=50, seed=seed, use_tools=False,
                stats=stats,
            ):  # fmt: skip
                pass
            steps, seconds = steps + stats.steps - 1, seconds + stats.decode_s
        return steps / seconds

    kernel = {"native": sample_rows, "torch": lambda: None}
    results: dict[str, list[float]] = {"native": [], "torch": []}
    for r in range(args.rounds):
        for name in ("native", "torch") if r % 2 == 0 else ("torch", "native"):
            sampling.sample_rows = kernel[name]
            results[name].append(tokens_per_second())
    ratios = [a / b for a, b in zip(results["native"], results["torch"], strict=True)]
    print(
        f"one row at chat's defaults: kernel {statistics.median(results['native']):.0f} tok/s, "
        f"torch's ops {statistics.median(results['torch']):.0f} tok/s, kernel / torch "
        f"{statistics.median(ratios):.3f} (median of {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
