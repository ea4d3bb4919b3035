"""Conversations whose later questions build on an earlier answer.

Owns the follow-up conversation: a calculation or a count, then 1-2 questions that reuse
its result ("and times 3?") or its word or letter ("what about banana?"); and its opposite,
the switch: a tool question of the other kind right after an answer, which must not reuse
it (a count after 1234*5678 = 7006652 is `"tattoo".count("t")`, not `7006652*tattoo`). It
knows nothing about the mix of conversation kinds or about evaluation.
"""

from __future__ import annotations

import random

from chatcli.training.arithmetic_data import (
    arithmetic_exchange,
    arithmetic_followup,
    large_product_exchange,
    usable_left_operand,
)
from chatcli.training.counting_data import (
    counting_exchange,
    counting_followup,
    phrase_count_exchange,
)
from chatcli.training.exchange import Exchange
from chatcli.training.expression_data import expression_exchange

ARITHMETIC_FOLLOWUP_PROBABILITY = 0.7  # of follow-up conversations; the rest count letters
COUNT_AFTER_CALCULATION_PROBABILITY = 0.5  # of switches; the rest calculate after a count
PHRASE_SWITCH_PROBABILITY = 0.2  # of counts in a switch: a phrase rather than a word
EXPRESSION_SWITCH_PROBABILITY = 0.3  # of calculations in a switch: a whole expression


def followup(rng: random.Random, split: str) -> list[dict]:
    """2-3 user turns; each later one builds on the answer before it."""
    n_followups = rng.choice((1, 1, 2))
    if rng.random() < ARITHMETIC_FOLLOWUP_PROBABILITY:
        exchange = arithmetic_exchange(rng, split)
        while not usable_left_operand(exchange.result, split):
            exchange = arithmetic_exchange(rng, split)
        exchanges = [exchange]
        for _ in range(n_followups):
            if not usable_left_operand(exchanges[-1].result, split):
                break
            exchanges.append(arithmetic_followup(rng, split, exchanges[-1].result))
    else:
        exchanges = [counting_exchange(rng, split)]
        for _ in range(n_followups):
            exchanges.append(counting_followup(rng, split, exchanges[-1]))
    return [message for exchange in exchanges for message in exchange.messages()]


def switch(rng: random.Random, split: str) -> list[dict]:
    """A calculation with a large result then a count, or a count then a calculation; in
    training sometimes a third exchange of the first kind again (eval: exactly two). The eval
    asks the second question in the base skills only (a word to count, one operator), so that
    it measures the switch, not the newer skills."""
    count_second = rng.random() < COUNT_AFTER_CALCULATION_PROBABILITY
    exchanges = [_calculation(rng, split, large=True) if count_second else _count(rng, split)]
    exchanges.append(_count(rng, split) if count_second else _calculation(rng, split, large=False))
    if split == "train" and rng.random() < 0.3:
        exchanges.append(
            _calculation(rng, split, large=True) if count_second else _count(rng, split)
        )
    return [message for exchange in exchanges for message in exchange.messages()]


def _calculation(rng: random.Random, split: str, large: bool) -> Exchange:
    if large:
        return large_product_exchange(rng, split)
    if split == "train" and rng.random() < EXPRESSION_SWITCH_PROBABILITY:
        return expression_exchange(rng, split)
    return arithmetic_exchange(rng, split)


def _count(rng: random.Random, split: str) -> Exchange:
    if split == "train" and rng.random() < PHRASE_SWITCH_PROBABILITY:
        return phrase_count_exchange(rng, split)
    return counting_exchange(rng, split)
