"""The held-out eval sets: prompts from the eval split, each with what a right answer holds.

Owns EvalItem, the kinds of eval set and how each is built from eval-split conversations
(numbers, words and phrasings that training never uses; see held_out.py and phrasings.py).
It knows nothing about models: evaluate.py asks the prompts and grades the replies.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from chatcli.training.synthetic import conversation

EVAL_KINDS = ("arithmetic", "counting", "followup", "identity", "out_of_scope")


@dataclass(frozen=True)
class EvalItem:
    """One held-out prompt and what a correct final answer must contain."""

    kind: str  # one of EVAL_KINDS
    messages: list[dict]  # up to and including the last user message
    expected: str | None  # the result text the answer must contain; None when there is no tool
    expected_expression: str | None  # the python the model should write; None when no tool


def generate_eval_set(n_per_kind: int, seed: int) -> list[EvalItem]:
    """`n_per_kind` held-out items of each of EVAL_KINDS, in that order."""
    rng = random.Random(seed)
    items = []
    for kind in EVAL_KINDS:
        for _ in range(n_per_kind):
            *prompt, answer = conversation(rng, "eval", kind)
            assert answer["role"] == "assistant" and prompt[-1]["role"] == "user"
            expected = expression = None
            if isinstance(answer["content"], list):
                parts = {part["type"]: part["text"] for part in answer["content"]}
                expected, expression = parts["python_output"], parts["python"]
            items.append(EvalItem(kind, prompt, expected, expression))
    return items
