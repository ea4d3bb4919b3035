"""Tests for chatcli.training.number_words: whole numbers spelt as people write them."""

from __future__ import annotations

import random

import pytest

from chatcli.training.number_words import MAX_WORDED, number_in_words, random_style

SMALL = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
         "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
         "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17,
         "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50,
         "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}  # fmt: skip


def read_words(text: str) -> int:
    """An independent reader of what number_in_words writes, for the round trip."""
    total = current = 0
    for word in text.replace("-", " ").split():
        if word == "and":
            continue
        if word == "hundred":
            current *= 100
        elif word == "thousand":
            total, current = (total + current) * 1000, 0
        else:
            current += SMALL[word]
    return total + current


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "zero"),
        (7, "seven"),
        (13, "thirteen"),
        (20, "twenty"),
        (42, "forty-two"),
        (100, "one hundred"),
        (105, "one hundred and five"),
        (342, "three hundred and forty-two"),
        (1000, "one thousand"),
        (2005, "two thousand and five"),
        (12345, "twelve thousand three hundred and forty-five"),
        (999_999, "nine hundred and ninety-nine thousand nine hundred and ninety-nine"),
    ],
)
def test_numbers_are_spelt_in_british_style_by_default(n, text):
    assert number_in_words(n) == text


def test_without_and_or_hyphen():
    assert number_in_words(342, use_and=False, hyphen=False) == "three hundred forty two"
    assert number_in_words(2005, use_and=False) == "two thousand five"


def test_every_style_reads_back_as_the_same_number():
    for n in [*range(0, 2000), *range(2000, MAX_WORDED, 997), MAX_WORDED]:
        for use_and in (True, False):
            for hyphen in (True, False):
                assert read_words(number_in_words(n, use_and=use_and, hyphen=hyphen)) == n


def test_random_styles_vary_and_read_back():
    rng = random.Random(0)
    styles = {random_style(rng, 342) for _ in range(100)}
    assert styles == {
        "three hundred and forty-two",
        "three hundred forty-two",
        "three hundred and forty two",
        "three hundred forty two",
    }


@pytest.mark.parametrize("n", [-1, MAX_WORDED + 1])
def test_numbers_out_of_range_are_refused(n):
    with pytest.raises(ValueError, match="can spell 0 to"):
        number_in_words(n)
