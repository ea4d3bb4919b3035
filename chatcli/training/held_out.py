"""The held-out scheme: which numbers and strings belong to the eval split, and drawing them.

Owns the split of numbers and random letter strings between "train" and "eval", and the
samplers that draw a number of one split. It knows nothing about questions, phrasings or
conversations; the generators ask it for numbers and check operands against it.

- Numbers: a number's key is its digits without sign or point ("12.5" -> 125). Keys above 100
  are held out when a multiplicative hash puts them in 50 of 1000 buckets (about 5%); keys
  under 100 are too few to split and belong to training only, and so does 100 itself, the
  constant of every percentage call (`15*80/100`). Every operand in a training
  python expression (follow-ups' previous results included) is a kept number. Every operand of
  an eval question of the original kinds is a held-out one, so eval arithmetic needs at least 3
  digits; an eval question with several operands (an expression, a percentage, an average) has
  at least one held-out operand and may share small ones with training (`operands_in_split`).
- Random letter strings for counting are split the same way by a CRC32 bucket (1 in 20).
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Iterable

SPLITS = ("train", "eval")

HELD_OUT_BUCKETS = 50  # of 1000
MIN_HELD_OUT_KEY = 101  # 100 would be held out, and it is in every percentage call
HELD_OUT_STRING_MODULUS = 20

# Digit counts of integer operands: biased to long numbers, which a tiny model gets wrong
# without the tool. Eval starts at 3 digits (see the held-out scheme above).
TRAIN_DIGIT_WEIGHTS = {1: 1, 2: 2, 3: 3, 4: 3, 5: 3, 6: 3}
EVAL_DIGIT_WEIGHTS = {3: 1, 4: 1, 5: 1, 6: 1}
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")


def is_held_out_number(text: str) -> bool:
    """Whether a plain number ("482", "12.5", "-3.25") belongs to the eval split."""
    key = int(text.lstrip("-").replace(".", ""))
    if key < MIN_HELD_OUT_KEY:
        return False
    # Knuth's multiplicative hash, reduced to 32 bits so every digit of the key matters.
    return (key * 2654435761) % 2**32 % 1000 < HELD_OUT_BUCKETS


def is_held_out_string(text: str) -> bool:
    """Whether a random letter string belongs to the eval split."""
    return zlib.crc32(text.encode()) % HELD_OUT_STRING_MODULUS == 0


def in_split(text: str, split: str) -> bool:
    """Whether a number belongs to the split: held out for eval, kept for train."""
    return is_held_out_number(text) == (split == "eval")


def operands_in_split(numbers: Iterable[str], split: str) -> bool:
    """The rule for questions with several operands: a training one uses no held-out number,
    an eval one at least one (the small ones it may share with training cannot be split)."""
    held_out = [is_held_out_number(n) for n in numbers]
    return any(held_out) if split == "eval" else not any(held_out)


def numbers_in(text: str) -> list[str]:
    """The unsigned numbers written in a call or a question ("6362-4835" -> 6362, 4835)."""
    return _NUMBER.findall(text)


def pool(split: str, train: list, held_out: list) -> list:
    return train if split == "train" else held_out


def sample_int(rng: random.Random, split: str, max_digits: int = 6) -> str:
    weights = TRAIN_DIGIT_WEIGHTS if split == "train" else EVAL_DIGIT_WEIGHTS
    digit_counts = [d for d in weights if d <= max_digits]
    while True:
        d = rng.choices(digit_counts, [weights[d] for d in digit_counts])[0]
        text = str(rng.randint(10 ** (d - 1), 10**d - 1))
        if in_split(text, split):
            return text


def sample_decimal(rng: random.Random, split: str) -> str:
    """A number with 1-2 decimals and no trailing zero ("3.10" is written 3.1 by people)."""
    while True:
        whole = rng.randint(0, 10 ** rng.randint(1, 3) - 1)
        places = rng.choice((1, 2))
        fraction = rng.randint(1, 10**places - 1)
        if fraction % 10 == 0:
            continue
        text = f"{whole}.{fraction:0{places}d}"
        if in_split(text, split):
            return text


def exact_division(rng: random.Random, split: str, max_digits: int) -> tuple[str, str]:
    """A dividend and divisor whose quotient is whole."""
    while True:
        b = sample_int(rng, split, max_digits=3)
        q = rng.randint(2, 10 ** rng.randint(1, 3) - 1)
        a = str(int(b) * q)
        if len(a) <= max_digits and in_split(a, split):
            return a, b
