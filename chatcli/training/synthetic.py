"""Seeded synthetic chat data for the embedded default model: the mix of conversation kinds.

This module owns what the tiny built-in model is taught, as a mix: which kinds of
conversation there are (small talk, who it is, arithmetic and letter counting through the
calculator, whole expressions, signed and decimal numbers, percentages, averages, numbers in
words, counting in a phrase, what the calculator cannot do, follow-ups on a previous answer
and switches to the other tool, polite refusals of everything else, recovering after a
flawed reply, and conversations chaining several of these, some as long as the context),
how often each is drawn, and the public API that draws them. It writes conversations as nanochat messages:

    {"role": "user", "content": "What is 1234*56?"}
    {"role": "assistant", "content": [{"type": "python", "text": "1234*56"},
                                      {"type": "python_output", "text": "69104"},
                                      {"type": "text", "text": "1234*56 = 69104."}]}

It knows nothing about tokens or training: the tokenizer renders these messages into ids.
Each skill's questions and answers live in its own module (arithmetic_data, counting_data,
expression_data, everyday_math_data, followup_data, recovery_data, small_talk_data), their
wording in phrasings.py and math_phrasings.py, the split of numbers and strings between
training and eval in held_out.py, and the held-out eval sets in eval_sets.py.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

from chatcli.training.arithmetic_data import arithmetic_exchange
from chatcli.training.counting_data import counting_exchange, phrase_count_exchange
from chatcli.training.everyday_math_data import average_exchange, percent_exchange
from chatcli.training.exchange import Exchange, render_text_only
from chatcli.training.expression_data import expression_exchange, signed_exchange, worded_exchange
from chatcli.training.followup_data import followup, switch
from chatcli.training.held_out import SPLITS, check_split, pool
from chatcli.training.recovery_data import recovery
from chatcli.training.small_talk_data import beyond_calculator, greeting, identity, out_of_scope

# The mix of conversation kinds, as sampling weights (they sum to 1). Tool use dominates: it is
# the one skill the default model exists to show.
KIND_WEIGHTS: dict[str, float] = {
    "greeting": 0.025,
    "identity": 0.03,
    "arithmetic": 0.14,
    "counting": 0.11,
    "followup": 0.09,
    "out_of_scope": 0.08,
    "mixed": 0.05,  # requests of different kinds in one conversation
    "long_chat": 0.025,  # many of them, as long as the context allows
    "expression": 0.07,  # several operators and parentheses in one call
    "signed": 0.05,  # negative numbers and decimals
    "percent": 0.06,
    "average": 0.07,
    "number_words": 0.09,  # "twelve times seven"
    "phrase_count": 0.02,  # a letter in a short phrase
    "beyond": 0.045,  # powers, roots, functions: what the calculator does instead
    "switch": 0.03,  # a tool question of the other kind right after an answer
    "recovery": 0.015,  # going on well after a flawed reply (not learned)
}
# A mixed conversation chains 2-3 segments, each a short conversation of its own kind, no two
# in a row of the same kind. From single-kind conversations only, the model learnt that what
# follows a tool exchange is another tool request: asked after a calculation or a count and a
# follow-up, held-out out-of-scope questions got a calculator call more often than they were
# declined (scripts/context_check.py; docs/training-history.md).
MIXED_SEGMENT_WEIGHTS: dict[str, float] = {
    "arithmetic": 0.18,
    "counting": 0.18,
    "followup": 0.14,
    "out_of_scope": 0.16,
    "identity": 0.08,
    "expression": 0.06,
    "signed": 0.04,
    "percent": 0.04,
    "average": 0.04,
    "number_words": 0.04,
    "phrase_count": 0.02,
    "beyond": 0.02,
}
MAX_MIXED_SEGMENTS = 3
# Of render_text_only, without the system prompt: with the default 1024-token vocabulary
# (digits are single tokens) that is under the 512-token row a conversation must fit in, with
# room to spare (docs/training-history.md, "What the data's comments stand on").
MAX_MIXED_CHARS = 1000
# A long chat: segments drawn as a mixed conversation's, until about 20 short exchanges would
# not fit a 1280-token context (about 2.5 characters a token).
LONG_CHAT_SEGMENTS = (6, 20)
MAX_LONG_CHAT_CHARS = 2800
SYSTEM_PROMPT_PROBABILITY = 0.15

TRAIN_SYSTEM_PROMPTS = [
    "You are a helpful assistant.", "You are a concise assistant.", "Be helpful and brief.",
    "You are chatcli's assistant.", "Answer briefly.",
]  # fmt: skip
EVAL_SYSTEM_PROMPTS = ["You are a friendly assistant.", "Keep answers short."]  # eval only

Generator = Callable[[random.Random, str], list[dict]]


def generate_conversations(n: int, seed: int, split: str = "train") -> list[list[dict]]:
    """`n` conversations drawn from KIND_WEIGHTS; the same seed and split give the same list."""
    return [conversation for _, conversation in generate_labelled_conversations(n, seed, split)]


def generate_labelled_conversations(
    n: int, seed: int, split: str = "train"
) -> list[tuple[str, list[dict]]]:
    """Like generate_conversations, each paired with its kind (a key of KIND_WEIGHTS)."""
    check_split(split)
    rng = random.Random(seed)
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    labelled = []
    for _ in range(n):
        kind = rng.choices(kinds, weights)[0]
        labelled.append((kind, conversation(rng, split, kind)))
    return labelled


def conversation(rng: random.Random, split: str, kind: str) -> list[dict]:
    """One conversation of `kind`, sometimes opened by a system prompt."""
    messages = KIND_GENERATORS[kind](rng, split)
    if rng.random() < SYSTEM_PROMPT_PROBABILITY:
        prompt = rng.choice(pool(split, TRAIN_SYSTEM_PROMPTS, EVAL_SYSTEM_PROMPTS))
        messages.insert(0, {"role": "system", "content": prompt})
    return messages


def _arithmetic(rng: random.Random, split: str) -> list[dict]:
    return arithmetic_exchange(rng, split).messages()


def _counting(rng: random.Random, split: str) -> list[dict]:
    return counting_exchange(rng, split).messages()


def _exchange_kind(make: Callable[[random.Random, str], Exchange]) -> Generator:
    def generate(rng: random.Random, split: str) -> list[dict]:
        return make(rng, split).messages()

    return generate


def _mixed(rng: random.Random, split: str) -> list[dict]:
    """Not an eval kind: the eval set asks each question at a conversation's start
    (scripts/context_check.py asks them later)."""
    return [message for _, segment in mixed_segments(rng, split) for message in segment]


def _long_chat(rng: random.Random, split: str) -> list[dict]:
    segments = mixed_segments(rng, split, LONG_CHAT_SEGMENTS, MAX_LONG_CHAT_CHARS)
    return [message for _, segment in segments for message in segment]


def mixed_segments(
    rng: random.Random,
    split: str,
    n_range: tuple[int, int] = (2, MAX_MIXED_SEGMENTS),
    max_chars: int = MAX_MIXED_CHARS,
) -> list[tuple[str, list[dict]]]:
    """n_range (kind, messages) segments, kinds from MIXED_SEGMENT_WEIGHTS and no two in a
    row alike, while the whole stays under max_chars (which may end it with fewer)."""
    kinds, weights = list(MIXED_SEGMENT_WEIGHTS), list(MIXED_SEGMENT_WEIGHTS.values())
    n_segments = rng.randint(*n_range)
    segments: list[tuple[str, list[dict]]] = []
    messages: list[dict] = []
    while len(segments) < n_segments:
        kind = rng.choices(kinds, weights)[0]
        if segments and kind == segments[-1][0]:
            continue
        segment = KIND_GENERATORS[kind](rng, split)
        if len(render_text_only(messages + segment)) >= max_chars:
            if len(segments) >= 2:
                break
            continue  # a long first or second segment: draw another
        segments.append((kind, segment))
        messages += segment
    return segments


KIND_GENERATORS: dict[str, Generator] = {
    "greeting": greeting,
    "identity": identity,
    "arithmetic": _arithmetic,
    "counting": _counting,
    "followup": followup,
    "out_of_scope": out_of_scope,
    "mixed": _mixed,
    "long_chat": _long_chat,
    "expression": _exchange_kind(expression_exchange),
    "signed": _exchange_kind(signed_exchange),
    "percent": _exchange_kind(percent_exchange),
    "average": _exchange_kind(average_exchange),
    "number_words": _exchange_kind(worded_exchange),
    "phrase_count": _exchange_kind(phrase_count_exchange),
    "beyond": beyond_calculator,
    "switch": switch,
    "recovery": recovery,
}
assert set(KIND_GENERATORS) == set(KIND_WEIGHTS)
assert set(MIXED_SEGMENT_WEIGHTS) <= set(KIND_GENERATORS) - {"mixed", "long_chat", "recovery"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print sample synthetic chat conversations.")
    parser.add_argument("--n", type=int, default=5, help="how many conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=SPLITS, default="train")
    args = parser.parse_args(argv)
    for kind, messages in generate_labelled_conversations(args.n, args.seed, args.split):
        print(f"--- {kind}")
        print(render_text_only(messages))


if __name__ == "__main__":
    main()
