"""One question and its tool answer, and how a person types the question around it.

Owns the shape every tool exchange of the synthetic data takes (a user question; the
assistant's calculator call, the calculator's output and one sentence copying it), the one
place a generated expression is computed, the small ways users vary their typing (case, a
missing question mark, chatter, thousands separators), and the readable text view of a
conversation. It knows nothing about which skills exist or how they are worded.

Every python_output is computed by chatcli.engine.calculator, so it is exactly the text the
engine injects at run time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from chatcli.engine.calculator import format_result, use_calculator
from chatcli.model.special_tokens import OUTPUT_END, OUTPUT_START, PYTHON_END, PYTHON_START

FILLER_PROBABILITY = 0.25  # of training questions: chatter before or after the question
COMMA_PROBABILITY = 0.25  # a user writes 1,234 rather than 1234

# Chatter around a training question, so that the question's words (not its position in the
# message) locate the operands. None of these words occurs in an eval wrapper.
TRAIN_FILLER_PREFIXES = [
    "ok so", "hi!", "hello.", "quick one:", "so,", "hmm.", "one more:", "next question:",
    "for my homework:", "my teacher asked this.", "thanks for the help!", "good morning.",
    "this is for a quiz.", "sorry to bother you.", "right,", "question:", "ok.", "yo,",
]  # fmt: skip
TRAIN_FILLER_SUFFIXES = [
    "thanks!", "thank you.", "please.", "asap", "no rush.", "cheers", "ty", "it's for school.",
    "just curious.",
]  # fmt: skip


@dataclass(frozen=True)
class Exchange:
    """A user question and the assistant's tool call, its output and the sentence after it."""

    question: str
    expression: str
    result: str
    sentence: str

    def messages(self) -> list[dict]:
        parts = [
            {"type": "python", "text": self.expression},
            {"type": "python_output", "text": self.result},
            {"type": "text", "text": self.sentence},
        ]
        return [{"role": "user", "content": self.question}, {"role": "assistant", "content": parts}]


def calculate(expression: str) -> str:
    """The calculator's output text for a generated expression (which it must accept)."""
    value = use_calculator(expression)
    assert value is not None, f"the calculator refused a generated expression: {expression}"
    return format_result(value)


def display(rng: random.Random, text: str) -> str:
    """How the user writes an operand: sometimes 1,234 for 1234 (the expression never does)."""
    if "." not in text and int(text) >= 1000 and rng.random() < COMMA_PROBABILITY:
        return f"{int(text):,}"
    return text


def vary(rng: random.Random, text: str) -> str:
    """Type like a person: sometimes no capital, sometimes no question mark."""
    if rng.random() < 0.3:
        text = text[0].lower() + text[1:]
    if text.endswith("?") and rng.random() < 0.2:
        text = text[:-1]
    return text


def with_filler(rng: random.Random, split: str, question: str) -> str:
    """Training only: chatter before or after a question (eval questions stay as they are)."""
    if split != "train" or rng.random() >= FILLER_PROBABILITY:
        return question
    if rng.random() < 0.6:
        return f"{rng.choice(TRAIN_FILLER_PREFIXES)} {question}"
    return f"{question} {rng.choice(TRAIN_FILLER_SUFFIXES)}"


def render_text_only(conversation: list[dict]) -> str:
    """A readable one-line-per-message view, tool parts shown between their special tokens."""
    wrappers = {
        "text": ("", ""),
        "python": (PYTHON_START, PYTHON_END),
        "python_output": (OUTPUT_START, OUTPUT_END),
    }
    lines = []
    for message in conversation:
        content = message["content"]
        if not isinstance(content, str):
            content = "".join(
                wrappers[part["type"]][0] + part["text"] + wrappers[part["type"]][1]
                for part in content
            )
        lines.append(f"{message['role']}: {content}")
    return "\n".join(lines)
