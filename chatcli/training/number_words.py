"""Whole numbers written in English words, as people type them ("three hundred and forty-two").

Owns the spelling of a whole number from 0 to 999,999 in the styles people use (with or
without "and", "forty-two" or "forty two"). It knows nothing about questions or splits.
"""

from __future__ import annotations

import random

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
        "eighteen", "nineteen"]  # fmt: skip
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
MAX_WORDED = 999_999


def number_in_words(n: int, *, use_and: bool = True, hyphen: bool = True) -> str:
    """`n` (0..999,999) in words: 342 -> "three hundred and forty-two" (use_and, hyphen),
    "three hundred forty two" (neither)."""
    if not 0 <= n <= MAX_WORDED:
        raise ValueError(f"can spell 0 to {MAX_WORDED}, not {n}")
    if n < 1000:
        return _below_thousand(n, use_and, hyphen)
    thousands, rest = divmod(n, 1000)
    head = f"{_below_thousand(thousands, use_and, hyphen)} thousand"
    if rest == 0:
        return head
    if rest < 100 and use_and:  # "two thousand and five"
        return f"{head} and {_below_hundred(rest, hyphen)}"
    return f"{head} {_below_thousand(rest, use_and, hyphen)}"


def random_style(rng: random.Random, n: int) -> str:
    """`n` in words in one of the styles people write (British "and" or not, hyphen or not)."""
    return number_in_words(n, use_and=rng.random() < 0.5, hyphen=rng.random() < 0.7)


def _below_thousand(n: int, use_and: bool, hyphen: bool) -> str:
    hundreds, rest = divmod(n, 100)
    if hundreds == 0:
        return _below_hundred(rest, hyphen)
    head = f"{ONES[hundreds]} hundred"
    if rest == 0:
        return head
    joiner = " and " if use_and else " "
    return head + joiner + _below_hundred(rest, hyphen)


def _below_hundred(n: int, hyphen: bool) -> str:
    if n < 20:
        return ONES[n]
    tens, ones = divmod(n, 10)
    if ones == 0:
        return TENS[tens]
    return TENS[tens] + ("-" if hyphen else " ") + ONES[ones]
