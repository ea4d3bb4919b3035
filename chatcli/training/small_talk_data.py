"""Small talk's data: greetings, who the model is, and declining what it cannot do.

Owns the fixed replies a tiny model learns far better than a paraphrase family (one answer
per intent), and the conversations around them: a greeting (sometimes before a task and a
thanks), an identity question, an out-of-scope question. It knows nothing about the mix of
conversation kinds or about evaluation.
"""

from __future__ import annotations

import random

from chatcli.training import math_phrasings, phrasings
from chatcli.training.arithmetic_data import arithmetic_exchange
from chatcli.training.counting_data import counting_exchange
from chatcli.training.exchange import vary, with_filler
from chatcli.training.held_out import pool, sample_int
from chatcli.training.vocabulary import pseudo_word

MADE_UP_TOPIC_PROBABILITY = 0.35  # of training out-of-scope questions: "the Blorfin river"
MADE_UP_TOPIC_KINDS = ["{}", "the {} empire", "{} music", "the {} festival",
                       "the {} language", "{} cheese", "the planet {}", "King {}", "the {} app", "the {} bridge"]  # fmt: skip

# intent -> (training questions, eval-only questions, the one answer). One answer per intent:
# a tiny model learns a fixed reply far better than a paraphrase family.
IDENTITY = {
    "who": (
        ["Who are you?", "What are you?", "What's your name?", "Are you ChatGPT?",
         "Introduce yourself."],
        ["Tell me about yourself."],
        "I'm chatcli's small built-in demo model. I can do arithmetic with my calculator and "
        "count letters. For anything else, load a real nanochat checkpoint with "
        "chatcli chat --model PATH.",
    ),
    "abilities": (
        ["What can you do?", "Can you do math?", "What are you good at?", "help",
         "What can I ask you?", "Tell me your abilities."],
        ["What are your abilities?"],
        "I can do arithmetic with my calculator and count letters in words. I'm only chatcli's "
        "small built-in demo model; for more, load a real nanochat checkpoint with "
        "chatcli chat --model PATH.",
    ),
    "model": (
        ["What model is this?", "Which model are you?", "How big are you?",
         "How many parameters do you have?", "Am I talking to a real model?",
         "What am I chatting with?"],
        ["What model am I talking to?"],
        "This is chatcli's small built-in demo model, with a few million parameters. It can do "
        "arithmetic with its calculator and count letters. Load a real nanochat checkpoint with "
        "chatcli chat --model PATH.",
    ),
    "real_model": (
        ["How do I use a real model?", "How do I load a bigger model?",
         "Can I use a real nanochat model?", "How do I load my own checkpoint?"],
        ["How can I switch to a real checkpoint?"],
        "Run chatcli chat --model PATH, where PATH is a nanochat checkpoint. I'm just the small "
        "built-in demo model: I can do arithmetic with my calculator and count letters.",
    ),
}  # fmt: skip

# One fixed reply: a tiny model learns it far better than a paraphrase family.
OUT_OF_SCOPE_ANSWERS = [
    "I'm too small to know that. I can do arithmetic and count letters; for general questions "
    "load a real nanochat model with --model.",
]

# Powers, roots and functions are outside the calculator's grammar: one fixed reply says what
# it does instead.
BEYOND_ANSWER = (
    "My calculator only does +, -, *, / and parentheses, so I can't work out powers, roots or "
    "functions. I can do arithmetic with those and count letters."
)

# intent -> (training messages, eval-only messages, replies)
GREETINGS = {
    "hello": (
        ["hi", "hello!", "hey", "Hello", "hi there", "good morning", "hey there!"],
        ["greetings!", "yo"],
        ["Hello! I can do arithmetic and count letters. What would you like to know?",
         "Hi! Ask me an arithmetic question or to count letters in a word."],
    ),
    "how_are_you": (
        ["how are you?", "how's it going?", "How are you doing?"],
        ["how have you been?"],
        ["I'm doing well, thanks! What would you like to calculate?"],
    ),
    "thanks": (
        ["thanks", "thank you!", "thanks a lot", "thx"],
        ["much appreciated"],
        ["You're welcome!", "Happy to help!"],
    ),
    "bye": (
        ["bye", "goodbye!", "see you", "Bye!"],
        ["see you later!"],
        ["Goodbye!", "Bye! Have a nice day."],
    ),
}  # fmt: skip


def greeting(rng: random.Random, split: str) -> list[dict]:
    # Either an opener, sometimes followed by a task and a closer, or a closer on its own.
    if rng.random() < 0.3:
        return chat_turn(rng, split, rng.choice(("thanks", "bye")))
    messages = chat_turn(rng, split, rng.choice(("hello", "hello", "how_are_you")))
    if rng.random() < 0.5:
        task = arithmetic_exchange if rng.random() < 0.7 else counting_exchange
        messages += task(rng, split).messages()
        if rng.random() < 0.7:
            messages += chat_turn(rng, split, rng.choice(("thanks", "thanks", "bye")))
    return messages


def chat_turn(rng: random.Random, split: str, intent: str) -> list[dict]:
    train, held_out, replies = GREETINGS[intent]
    return [
        {"role": "user", "content": rng.choice(pool(split, train, held_out))},
        {"role": "assistant", "content": rng.choice(replies)},
    ]


def identity(rng: random.Random, split: str) -> list[dict]:
    train, held_out, answer = IDENTITY[rng.choice(list(IDENTITY))]
    question = with_filler(rng, split, vary(rng, rng.choice(pool(split, train, held_out))))
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def out_of_scope(rng: random.Random, split: str) -> list[dict]:
    if split == "train" and rng.random() < MADE_UP_TOPIC_PROBABILITY:
        # Unfamiliar words are no sign of a counting question: they are everywhere.
        kind = rng.choice(MADE_UP_TOPIC_KINDS)
        topic = kind.format(pseudo_word(rng, split, 1, 3).capitalize())
        question = rng.choice(phrasings.OUT_OF_SCOPE_FRAMES).format(t=topic)
    else:
        question = phrasings.out_of_scope_question(rng, split)
    question = with_filler(rng, split, vary(rng, question))
    answer = rng.choice(OUT_OF_SCOPE_ANSWERS)
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def beyond_calculator(rng: random.Random, split: str) -> list[dict]:
    """A power, a root or a function asked for, and what the calculator does instead."""
    a = sample_int(rng, split, max_digits=3)
    b = str(rng.randint(2, 9))
    question = math_phrasings.beyond_question(rng, split, a, b)
    question = with_filler(rng, split, vary(rng, question))
    return [{"role": "user", "content": question}, {"role": "assistant", "content": BEYOND_ANSWER}]
