"""A leaderboard from arena votes: Bradley-Terry ratings on the Elo scale, their bootstrap
intervals, and each pair's wins, losses and ties.

Owns the rating maths, in pure Python (a few models and a few thousand votes need no torch).
A vote between models i and j is a game: a win counts 1 to the winner, a tie (or "both bad")
half to each. Bradley-Terry says i beats j with probability p_i / (p_i + p_j); the strengths p
are fitted by Hunter's MM iteration (2004), which climbs the likelihood at every step. Each
pair that met also counts `prior_ties` virtual ties, so a clean sweep gives a finite gap
rather than an infinite one. Ratings are `ELO_SCALE * ln p`, shifted so their mean is
`ANCHOR`: a gap of 400 means 10:1 odds, as on the public arenas.

Knows nothing of files, models or terminals: votes come in as `Battle`s.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

ANCHOR = 1000.0  # the mean rating
ELO_SCALE = 400 / math.log(10)  # a rating gap of 400 is 10:1 odds
OUTCOMES = ("a", "b", "tie", "bad")  # a won, b won, a tie, both bad (a tie for the ratings)
BOOTSTRAP_ROUNDS = 200
BOOTSTRAP_SEED = 0
MM_TOLERANCE = 1e-10
MM_MAX_ITERATIONS = 10_000


@dataclass(frozen=True)
class Battle:
    """One vote: model `a` against model `b`, and how it went (an OUTCOMES value)."""

    a: str
    b: str
    outcome: str


@dataclass(frozen=True)
class Rating:
    model: str
    rating: float
    low: float  # the bootstrap interval's ends (2.5th and 97.5th percentiles)
    high: float
    votes: int


@dataclass(frozen=True)
class PairTally:
    """Two models' record against each other, from `first`'s side."""

    first: str
    second: str
    wins: int
    losses: int
    ties: int
    both_bad: int


def _scores(battles: Sequence[Battle]) -> dict[tuple[str, str], float]:
    """(i, j) -> what i scored against j: 1 a win, 0.5 a tie or both bad."""
    score: dict[tuple[str, str], float] = {}
    # Counted first: a bootstrap sample repeats its votes, and a count is one step each.
    for (a, b, outcome), n in Counter((x.a, x.b, x.outcome) for x in battles).items():
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        if a == b:
            continue  # a model against itself says nothing about either
        a_gets = {"a": 1.0, "b": 0.0}.get(outcome, 0.5)
        score[a, b] = score.get((a, b), 0.0) + n * a_gets
        score[b, a] = score.get((b, a), 0.0) + n * (1.0 - a_gets)
    return score


def fit_strengths(battles: Sequence[Battle], prior_ties: float = 1.0) -> dict[str, float]:
    """Bradley-Terry log-strengths (natural log, mean 0) of every model in `battles`."""
    score = _scores(battles)
    for i, j in list(score):  # each pair that met: its virtual ties, half a point each way
        score[i, j] += prior_ties / 2
    models = sorted({i for i, _ in score} | {j for _, j in score})
    if not models:
        return {}
    # Each model's opponents and the games it played with each (both directions' scores).
    games: dict[str, list[tuple[str, float]]] = {m: [] for m in models}
    won = dict.fromkeys(models, 0.0)
    for (i, j), s in score.items():
        games[i].append((j, s + score[j, i]))
        won[i] += s
    p = dict.fromkeys(models, 1.0)
    for _ in range(MM_MAX_ITERATIONS):
        new = {}
        for m in models:
            denominator = sum(n / (p[m] + p[j]) for j, n in games[m])
            new[m] = won[m] / denominator if denominator else p[m]
        # Scale fixed by the geometric mean: BT's strengths are only known up to a factor.
        mean_log = sum(math.log(v) for v in new.values()) / len(new)
        new = {m: v / math.exp(mean_log) for m, v in new.items()}
        change = max(abs(math.log(new[m]) - math.log(p[m])) for m in models)
        p = new
        if change < MM_TOLERANCE:
            break
    return {m: math.log(v) for m, v in p.items()}


def elo_ratings(battles: Sequence[Battle], prior_ties: float = 1.0) -> dict[str, float]:
    """Each model's rating on the Elo scale, their mean ANCHOR."""
    return {m: ANCHOR + ELO_SCALE * s for m, s in fit_strengths(battles, prior_ties).items()}


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def leaderboard(
    battles: Sequence[Battle],
    rounds: int = BOOTSTRAP_ROUNDS,
    seed: int = BOOTSTRAP_SEED,
    prior_ties: float = 1.0,
) -> list[Rating]:
    """Every model's rating with its 95% bootstrap interval (votes drawn with replacement,
    `rounds` times, from a generator seeded with `seed`), best first."""
    point = elo_ratings(battles, prior_ties)
    draws: dict[str, list[float]] = {m: [] for m in point}
    rng = random.Random(seed)
    for _ in range(rounds if battles else 0):
        sample = rng.choices(battles, k=len(battles))
        for m, r in elo_ratings(sample, prior_ties).items():
            draws[m].append(r)
    votes = {m: sum(m in (b.a, b.b) and b.a != b.b for b in battles) for m in point}
    board = [
        Rating(
            model=m,
            rating=r,
            # A model absent from every resample has no spread to show: its point alone.
            low=_percentile(draws[m], 0.025) if draws[m] else r,
            high=_percentile(draws[m], 0.975) if draws[m] else r,
            votes=votes[m],
        )
        for m, r in point.items()
    ]
    return sorted(board, key=lambda x: (-x.rating, x.model))


def pair_tallies(battles: Sequence[Battle]) -> list[PairTally]:
    """Each pair of models that met, named in alphabetical order, with the first's record."""
    counts: dict[tuple[str, str], list[int]] = {}
    for b in battles:
        if b.a == b.b:
            continue
        first, second = sorted((b.a, b.b))
        tally = counts.setdefault((first, second), [0, 0, 0, 0])
        if b.outcome in ("tie", "bad"):
            tally[2 if b.outcome == "tie" else 3] += 1
        else:
            winner = b.a if b.outcome == "a" else b.b
            tally[0 if winner == first else 1] += 1
    return [PairTally(f, s, *t) for (f, s), t in sorted(counts.items())]
