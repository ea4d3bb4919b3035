"""Bradley-Terry ratings from arena votes: known cases, the likelihood equations, the
bootstrap's intervals and each pair's tally."""

from __future__ import annotations

import math

import pytest

from chatcli.chat.ratings import (
    ANCHOR,
    Battle,
    PairTally,
    elo_ratings,
    fit_strengths,
    leaderboard,
    pair_tallies,
)


def votes(a: str, b: str, outcome: str, n: int) -> list[Battle]:
    return [Battle(a, b, outcome)] * n


def test_symmetric_votes_give_equal_ratings_at_the_anchor():
    battles = votes("x", "y", "a", 5) + votes("x", "y", "b", 5) + votes("y", "x", "tie", 3)
    ratings = elo_ratings(battles)
    assert ratings["x"] == pytest.approx(ANCHOR)
    assert ratings["y"] == pytest.approx(ANCHOR)


def test_a_clean_sweep_gives_a_finite_gap_from_the_virtual_tie():
    # 10 wins, plus one virtual tie: 10.5 to 0.5, odds of 21, a gap of 400*log10(21).
    ratings = elo_ratings(votes("strong", "weak", "a", 10))
    gap = ratings["strong"] - ratings["weak"]
    assert gap == pytest.approx(400 * math.log10(21))
    assert (ratings["strong"] + ratings["weak"]) / 2 == pytest.approx(ANCHOR)


def test_two_models_odds_are_their_scores_ratio():
    # 3 wins to 1 without the prior: odds 3, a gap of 400*log10(3).
    battles = votes("x", "y", "a", 3) + votes("x", "y", "b", 1)
    ratings = elo_ratings(battles, prior_ties=0)
    assert ratings["x"] - ratings["y"] == pytest.approx(400 * math.log10(3))


def test_a_tie_counts_half_a_win_each_way():
    with_ties = votes("x", "y", "a", 2) + votes("x", "y", "tie", 2)
    as_wins = votes("x", "y", "a", 3) + votes("y", "x", "a", 1)
    assert elo_ratings(with_ties) == pytest.approx(elo_ratings(as_wins))
    both_bad = votes("x", "y", "a", 2) + votes("y", "x", "bad", 2)
    assert elo_ratings(both_bad) == pytest.approx(elo_ratings(as_wins))


def test_the_fit_solves_the_likelihood_equations_for_three_models():
    # Bradley-Terry's maximum: each model's expected score equals its actual one.
    battles = (
        votes("a", "b", "a", 7)
        + votes("a", "b", "b", 3)
        + votes("b", "c", "a", 6)
        + votes("b", "c", "b", 4)
        + votes("a", "c", "a", 8)
        + votes("a", "c", "b", 2)
        + votes("a", "c", "tie", 2)
    )
    s = fit_strengths(battles, prior_ties=0)
    p = {m: math.exp(v) for m, v in s.items()}
    played = {("a", "b"): 10, ("b", "c"): 10, ("a", "c"): 12}
    actual = {"a": 7 + 8 + 1, "b": 3 + 6, "c": 4 + 2 + 1}
    for m in p:
        expected = sum(
            n * p[m] / (p[m] + p[o])
            for (i, j), n in played.items()
            for o in (i, j)
            if m in (i, j) and o != m
        )
        assert expected == pytest.approx(actual[m], abs=1e-6)
    assert sum(s.values()) == pytest.approx(0.0, abs=1e-9)
    ratings = elo_ratings(battles, prior_ties=0)
    assert ratings["a"] > ratings["b"] > ratings["c"]


def test_the_leaderboard_is_best_first_with_seeded_intervals_around_the_point():
    battles = votes("good", "bad", "a", 12) + votes("good", "bad", "b", 4)
    board = leaderboard(battles, rounds=200, seed=3)
    assert [r.model for r in board] == ["good", "bad"]
    for r in board:
        assert r.low <= r.rating <= r.high
        assert r.votes == 16
    assert board[0].high > board[0].low  # the votes vary between resamples
    again = leaderboard(battles, rounds=200, seed=3)
    assert again == board
    assert leaderboard(battles, rounds=200, seed=4) != board


def test_no_votes_no_ratings_and_a_model_against_itself_is_skipped():
    assert leaderboard([]) == []
    assert elo_ratings(votes("x", "x", "a", 3)) == {}
    assert pair_tallies(votes("x", "x", "a", 3)) == []


def test_pair_tallies_count_from_the_alphabetically_first_side():
    battles = (
        votes("zeta", "alpha", "a", 2)  # zeta won twice: alpha's losses
        + votes("alpha", "zeta", "a", 1)
        + votes("alpha", "zeta", "tie", 3)
        + votes("zeta", "alpha", "bad", 1)
        + votes("alpha", "mid", "b", 1)
    )
    assert pair_tallies(battles) == [
        PairTally("alpha", "mid", wins=0, losses=1, ties=0, both_bad=0),
        PairTally("alpha", "zeta", wins=1, losses=2, ties=3, both_bad=1),
    ]
