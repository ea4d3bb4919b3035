"""How long `chatcli arena stats` takes to rank a leaderboard (a benchmark, not a test).

    python scripts/bench_arena_stats.py                  # 10 models, 5000 votes
    python scripts/bench_arena_stats.py --models 4 --votes 1000

Draws votes between models of known Bradley-Terry strengths (0.3 apart in log-odds),
times the leaderboard (the fit and its 200 bootstrap refits), and
prints the time with how far each fitted gap is from the true one, in rating points (the
votes' sampling noise: it shrinks as their number grows).
"""

from __future__ import annotations

import argparse
import math
import random
import time

from chatcli.chat.ratings import ELO_SCALE, Battle, leaderboard

STEP = 0.3  # log-odds between neighbours


def draw(models: int, votes: int, seed: int = 1) -> list[Battle]:
    rng = random.Random(seed)
    names = [f"m{i}" for i in range(models)]
    battles = []
    for _ in range(votes):
        a, b = rng.sample(range(models), 2)
        p = 1 / (1 + math.exp(STEP * (b - a)))
        battles.append(Battle(names[a], names[b], "a" if rng.random() < p else "b"))
    return battles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=10)
    parser.add_argument("--votes", type=int, default=5000)
    args = parser.parse_args()
    battles = draw(args.models, args.votes)
    t0 = time.perf_counter()
    board = leaderboard(battles)
    seconds = time.perf_counter() - t0
    rating = {r.model: r.rating for r in board}
    errors = [
        abs(rating[f"m{i}"] - rating["m0"] - ELO_SCALE * STEP * i) for i in range(args.models)
    ]
    print(
        f"{args.models} models, {args.votes} votes: leaderboard in {seconds:.2f} s; "
        f"fitted gaps off the true ones by {max(errors):.0f} points at most"
    )


if __name__ == "__main__":
    main()
