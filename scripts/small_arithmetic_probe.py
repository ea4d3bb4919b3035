"""Does a chat model compute one- and two-digit arithmetic, or take it for something else?

    python scripts/small_arithmetic_probe.py                 # the embedded default model
    python scripts/small_arithmetic_probe.py --model runs/X

The held-out sets ask arithmetic on numbers of 3-6 digits (eval-only numbers are picked by a
hash of their digits, which small numbers cannot be split by), so they never see the
questions people type first: "What is 7*8?". A model trained on power questions with small
numbers ("What is {a}^{b}?", "{a}**{b}") can read a one-digit product as one of them and
decline it. Here every pair of operands 2-9 and a sample of two-digit ones are asked with
each operator in a few plain frames (greedy, through the real Engine and calculator); a reply
is right when its first calculator call is the expression and its last sentence holds the
result. It prints the share right per frame and operator, and the first replies that are not.
"""

from __future__ import annotations

import argparse
import random
from collections import defaultdict

from chatcli.engine.calculator import format_result, use_calculator
from chatcli.engine.engine import Engine
from chatcli.model.checkpoint import load_model
from chatcli.training.evaluate import contains_number, final_sentence, greedy_reply

FRAMES = ["What is {e}?", "{e}", "what's {e}", "Compute {e}."]
OPERATORS = "+-*/"


def questions(two_digit: int, seed: int) -> list[tuple[str, str, str]]:
    """(frame, operator, expression) for every one-digit pair 2-9 and `two_digit` random
    two-digit pairs, each operator."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(2, 10) for b in range(2, 10)]
    pairs += [(rng.randint(10, 99), rng.randint(2, 99)) for _ in range(two_digit)]
    return [(f, op, f"{a}{op}{b}") for f in FRAMES for op in OPERATORS for a, b in pairs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: embedded model)")
    parser.add_argument("--two-digit", type=int, default=16, help="random two-digit pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=8, help="wrong replies to print")
    args = parser.parse_args(argv)
    model, tokenizer, _ = load_model(args.model, device="cpu")
    engine = Engine(model, tokenizer)
    right: dict[tuple[str, str], list[bool]] = defaultdict(list)
    wrong = []
    for frame, op, expression in questions(args.two_digit, args.seed):
        question = frame.format(e=expression)
        parts, _ = greedy_reply(engine, tokenizer, [{"role": "user", "content": question}])
        calls = [p["text"] for p in parts if p["type"] == "python"]
        result = format_result(use_calculator(expression))
        ok = (
            bool(calls)
            and calls[0] == expression
            and contains_number(final_sentence(parts), result)
        )
        right[(frame, op)].append(ok)
        if not ok:
            wrong.append((question, "".join(p["text"] for p in parts)[:90]))
    print(f"{'frame':<16} " + " ".join(f"{op:>6}" for op in OPERATORS))
    for frame in FRAMES:
        cells = [right[(frame, op)] for op in OPERATORS]
        print(f"{frame:<16} " + " ".join(f"{100 * sum(c) / len(c):5.1f}%" for c in cells))
    total = [ok for cells in right.values() for ok in cells]
    print(f"\n{sum(total)} of {len(total)} right ({100 * sum(total) / len(total):.1f}%)")
    for question, text in wrong[: args.show]:
        print(f"  {question!r}: {text!r}")


if __name__ == "__main__":
    main()
