"""Tests for chatcli.training.counting_data: which letter a counting question asks about."""

from __future__ import annotations

import random
from collections import Counter

from chatcli.training.counting_data import sample_letter


def letter_shares(split: str, word: str, draws: int = 4000) -> Counter[str]:
    rng = random.Random(0)
    return Counter(sample_letter(rng, split, word) for _ in range(draws))


def test_training_asks_each_of_a_words_letters_alike():
    # "eeeex": under frequency weighting x would be asked a quarter as often as e.
    counts = letter_shares("train", "eeeex")
    assert 0.8 < counts["x"] / counts["e"] < 1.25, counts


def test_eval_asks_a_letter_as_often_as_it_occurs():
    # The held-out set draws as it always has (its digest test pins the whole set).
    counts = letter_shares("eval", "eeeex")
    assert 3.2 < counts["e"] / counts["x"] < 4.8, counts


def test_some_questions_ask_about_a_letter_the_word_lacks():
    for split in ("train", "eval"):
        counts = letter_shares(split, "ab")
        absent = sum(n for letter, n in counts.items() if letter not in "ab")
        assert 0.1 < absent / sum(counts.values()) < 0.3, (split, counts)
