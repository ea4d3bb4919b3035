"""Conversations whose later questions build on an earlier answer.

Owns the follow-up conversation: a calculation or a count, then 1-2 questions that reuse
its result ("and times 3?") or its word or letter ("what about banana?"). It knows nothing
about the mix of conversation kinds or about evaluation.
"""

from __future__ import annotations

import random

from chatcli.training.arithmetic_data import (
    arithmetic_exchange,
    arithmetic_followup,
    usable_left_operand,
)
from chatcli.training.counting_data import counting_exchange, counting_followup

ARITHMETIC_FOLLOWUP_PROBABILITY = 0.7  # of follow-up conversations; the rest count letters


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
