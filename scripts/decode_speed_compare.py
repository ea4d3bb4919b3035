"""Batch-1 greedy decode speed of two checkpoints on equal work: every reply runs its full length.

    python scripts/decode_speed_compare.py --model OLD --model NEW     # None: the embedded model

No row ends (`chatcli.bench.bench.endless_rows`, as `chatcli bench` times its decode): each
model decodes --steps tokens, longer than the bench's 48, after prompts of 32 and 256 tokens
(best of three, two alternating rounds), so the figures compare the models' step cost alone,
whatever each answers to the prompt.
"""

from __future__ import annotations

import argparse

from chatcli.bench.bench import _prompt, endless_rows
from chatcli.engine.engine import Engine, GenerationStats
from chatcli.model.checkpoint import load_model


def decode_tps(engine: Engine, prompt: list[int], steps: int) -> float:
    best = 0.0
    for _ in range(3):
        stats = GenerationStats()
        for _ in engine.generate(
            prompt, max_tokens=steps, temperature=0.0, use_tools=False, stats=stats
        ):
            pass
        best = max(best, (stats.steps - 1) / stats.decode_s)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None, help="a checkpoint; twice")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    for round_ in range(2):
        for path in args.model or [None]:
            model, tokenizer, _ = load_model(None if path in (None, "None") else path, device="cpu")
            with endless_rows(Engine(model, tokenizer)) as engine:  # no row ends before --steps
                for n in (32, 256):
                    tps = decode_tps(engine, _prompt(tokenizer, n), args.steps)
                    print(f"round {round_ + 1}  {path or 'embedded'}  prompt {n}: {tps:.0f} tok/s")


if __name__ == "__main__":
    main()
