"""Samples of the synthetic training data and eval sets that several test modules read.

Drawn once per test session (each takes a few seconds), and read only: a test that changes
what it gets would change it for the others.
"""

from __future__ import annotations

import functools
import re

from chatcli.training.eval_sets import EvalItem, generate_eval_set
from chatcli.training.synthetic import generate_labelled_conversations

# Unsigned: in "6362-4835" the numbers are 6362 and 4835.
NUMBER = re.compile(r"\d+(?:\.\d+)?")


@functools.cache
def train_sample() -> list[tuple[str, list[dict]]]:
    return generate_labelled_conversations(20_000, seed=1234)


@functools.cache
def eval_split_sample() -> list[tuple[str, list[dict]]]:
    return generate_labelled_conversations(3_000, seed=99, split="eval")


@functools.cache
def eval_items() -> list[EvalItem]:
    return generate_eval_set(n_per_kind=300, seed=7)


def learned(conversation: list[dict]) -> list[dict]:
    """The conversation as far as the loss sees it: no message or part marked unlearned."""
    out = []
    for message in conversation:
        if message.get("learn") is False:
            continue
        content = message["content"]
        if isinstance(content, list):
            content = [part for part in content if part.get("learn") is not False]
        out.append({**message, "content": content})
    return out


def tool_turns(conversation: list[dict]) -> list[dict[str, str]]:
    """Each learned assistant tool reply as {"python": ..., "python_output": ..., "text": ...}."""
    return [
        {part["type"]: part["text"] for part in message["content"]}
        for message in learned(conversation)
        if message["role"] == "assistant" and isinstance(message["content"], list)
    ]


def user_texts(conversation: list[dict]) -> list[str]:
    return [message["content"] for message in conversation if message["role"] == "user"]


def training_calls() -> list[str]:
    """Every python call training writes, learned or not."""
    return [
        part["text"]
        for _, conversation in train_sample()
        for message in conversation
        if message["role"] == "assistant" and isinstance(message["content"], list)
        for part in message["content"]
        if part["type"] == "python"
    ]
