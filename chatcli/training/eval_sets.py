"""The held-out eval sets: prompts from the eval split, each with what a right answer holds.

Owns EvalItem, the kinds of eval set and how each is built from eval-split conversations
(numbers, words and phrasings that training never uses; see held_out.py, phrasings.py and
math_phrasings.py). It knows nothing about models: evaluate.py asks the prompts and grades
the replies.

The five BASE_EVAL_KINDS are drawn in turn from one generator seeded with `seed`, as they
always were: their items are pinned by a test, so scores stay comparable across models. Each
of the NEW_EVAL_KINDS draws from a generator of its own (seeded with the seed and its name),
so adding a kind never moves another's items.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from chatcli.training.synthetic import conversation

BASE_EVAL_KINDS = ("arithmetic", "counting", "followup", "identity", "out_of_scope")
NEW_EVAL_KINDS = (
    "expression",  # several operators and parentheses: 6*7*7, (12+8)*3, 3 plus 4 times 5
    "signed",  # negative numbers and decimals
    "percent",  # 15% of 80, 80 increased by 15%, what percent of 80 is 12
    "average",  # the average of 3, 5 and 10
    "number_words",  # twelve times seven
    "phrase_count",  # a letter in a short phrase
    "beyond",  # powers, roots, functions: says what it can do, calls nothing
    "cross_followup",  # a count right after a large product, a calculation after a count
)
EVAL_KINDS = BASE_EVAL_KINDS + NEW_EVAL_KINDS
# The conversation kind (synthetic.KIND_GENERATORS) an eval kind is drawn from, where the
# names differ.
_CONVERSATION_KIND = {"cross_followup": "switch"}


@dataclass(frozen=True)
class EvalItem:
    """One held-out prompt and what a correct final answer must contain."""

    kind: str  # one of EVAL_KINDS
    messages: list[dict]  # up to and including the last user message
    expected: str | None  # the result text the answer must contain; None when there is no tool
    expected_expression: str | None  # the python the model should write; None when no tool


def generate_eval_set(
    n_per_kind: int, seed: int, kinds: Sequence[str] = EVAL_KINDS
) -> list[EvalItem]:
    """`n_per_kind` held-out items of each of `kinds`, in EVAL_KINDS order."""
    unknown = set(kinds) - set(EVAL_KINDS)
    if unknown:
        raise ValueError(f"unknown eval kinds {sorted(unknown)}; choose from {EVAL_KINDS}")
    items = []
    base_rng = random.Random(seed)
    for kind in BASE_EVAL_KINDS:
        # Drawn even when not asked for, so the others' items stay as they are.
        drawn = [_item(base_rng, kind) for _ in range(n_per_kind)]
        if kind in kinds:
            items += drawn
    for kind in NEW_EVAL_KINDS:
        if kind in kinds:
            rng = random.Random(f"{seed}:{kind}")
            items += [_item(rng, kind) for _ in range(n_per_kind)]
    return items


def _item(rng: random.Random, kind: str) -> EvalItem:
    *prompt, answer = conversation(rng, "eval", _CONVERSATION_KIND.get(kind, kind))
    assert answer["role"] == "assistant" and prompt[-1]["role"] == "user"
    expected = expression = None
    if isinstance(answer["content"], list):
        parts = {part["type"]: part["text"] for part in answer["content"]}
        expected, expression = parts["python_output"], parts["python"]
    return EvalItem(kind, prompt, expected, expression)
