"""Seeded synthetic chat data for the embedded default model, and its held-out eval set.

This module owns what the tiny built-in model is taught: small talk, who it is, arithmetic and
letter counting through the calculator tool, follow-ups on a previous answer, and polite refusals
of everything else. It writes conversations as nanochat messages:

    {"role": "user", "content": "What is 1234*56?"}
    {"role": "assistant", "content": [{"type": "python", "text": "1234*56"},
                                      {"type": "python_output", "text": "69104"},
                                      {"type": "text", "text": "1234*56 = 69104."}]}

It knows nothing about tokens or training: the tokenizer renders these messages into ids. Every
python_output is computed by chatcli.engine.calculator, so it is exactly the text the engine injects at
run time, and every sentence after a tool call copies that text verbatim.

Held-out split (split="eval"): numbers and phrasings the training split never uses.
- Numbers: a number's key is its digits without sign or point ("12.5" -> 125). Keys of 100 or
  more are held out when a multiplicative hash puts them in 50 of 1000 buckets (about 5%); keys
  under 100 are too few to split and belong to training only. Every operand in a training python
  expression (follow-ups' previous results included) is a kept number; every operand of an eval
  arithmetic question is a held-out one, so eval arithmetic needs at least 3 digits.
- Random letter strings for counting are split the same way by a CRC32 bucket (1 in 20).
- Phrasing templates, counting words, names, items, identity and out-of-scope questions and
  system prompts come in TRAIN_* and EVAL_* lists; the EVAL_* ones never appear in training.
"""

from __future__ import annotations

import argparse
import functools
import random
import re
import string
import zlib
from dataclasses import dataclass

from chatcli.engine.calculator import format_result, use_calculator
from chatcli.errors import ChatcliError
from chatcli.model.special_tokens import OUTPUT_END, OUTPUT_START, PYTHON_END, PYTHON_START
from chatcli.training import phrasings

SPLITS = ("train", "eval")
EVAL_KINDS = ("arithmetic", "counting", "followup", "identity", "out_of_scope")

# The mix of conversation kinds, as sampling weights (they sum to 1). Tool use dominates: it is
# the one skill the default model exists to show.
KIND_WEIGHTS: dict[str, float] = {
    "greeting": 0.06,
    "identity": 0.07,
    "arithmetic": 0.30,
    "counting": 0.22,
    "followup": 0.14,
    "out_of_scope": 0.11,
    "mixed": 0.10,  # requests of different kinds in one conversation
}
# A mixed conversation chains 2-3 segments, each a short conversation of its own kind, no two
# in a row of the same kind. From single-kind conversations only, the model learnt that what
# follows a tool exchange is another tool request: asked after a calculation or a count and a
# follow-up, held-out out-of-scope questions got a calculator call 11 times in 20 and were
# declined only 9 (scripts/context_check.py, run 16).
MIXED_SEGMENT_WEIGHTS: dict[str, float] = {
    "arithmetic": 0.25,
    "counting": 0.25,
    "followup": 0.2,
    "out_of_scope": 0.2,
    "identity": 0.1,
}
MAX_MIXED_SEGMENTS = 3
# Of render_text_only, without the system prompt: with the default 1024-token vocabulary
# (digits are single tokens) that is under the 512-token row a conversation must fit in (the
# longest of 20,000 generated conversations rendered to 387 tokens with run 19's tokenizer).
MAX_MIXED_CHARS = 1000
SYSTEM_PROMPT_PROBABILITY = 0.15
WORD_PROBLEM_PROBABILITY = 0.25  # of arithmetic questions
DECIMAL_PROBABILITY = 0.25  # of plain arithmetic questions
EXACT_DIVISION_PROBABILITY = 0.35  # of plain divisions
NEGATIVE_DIFFERENCE_PROBABILITY = 0.2  # of plain subtractions whose first operand is smaller
COMMA_PROBABILITY = 0.25  # a user writes 1,234 rather than 1234
ARITHMETIC_FOLLOWUP_PROBABILITY = 0.7  # of follow-up conversations; the rest count letters
# Counting words: English (memorisable), English words from a dictionary, made-up pronounceable
# words and random letter strings. All but the first force the model to copy whatever word it
# is given, so a word it never saw (the eval's) is copied rather than replaced by a familiar
# one. Dictionary words (~97k, most never seen twice) are the eval's kind of word: with only
# the 113 memorisable ones and made-up words, the model copied an unseen English word's first
# pieces and then finished it with a familiar ending ("saxophone" -> "saxophapp",
# "peppermint" -> "peppermther").
DICTIONARY_WORD_PROBABILITY = 0.45  # of counting questions
PSEUDO_WORD_PROBABILITY = 0.15  # of counting questions
RANDOM_STRING_PROBABILITY = 0.25  # of counting questions; the rest use TRAIN_WORDS
EVAL_RANDOM_STRING_PROBABILITY = 0.3  # of eval counting questions; the rest use EVAL_WORDS
VERB_FRAME_PROBABILITY = 0.3  # of training letter-counting follow-ups: "now {verb} X"
STRAY_WORD_PROBABILITY = 0.3  # of training counting questions: a dictionary word among its words
PSEUDO_NAME_PROBABILITY = 0.4  # of word problems: a made-up name, and (separately) a made-up item
FILLER_PROBABILITY = 0.25  # of training questions: chatter before or after the question
MADE_UP_TOPIC_PROBABILITY = 0.35  # of training out-of-scope questions: "the Blorfin river"
MADE_UP_TOPIC_KINDS = ["{}", "the {} empire", "{} music", "the {} festival",
                       "the {} language", "{} cheese", "the planet {}", "King {}", "the {} app", "the {} bridge"]  # fmt: skip
LETTER_IN_WORD_PROBABILITY = 0.8  # the letter asked about occurs in the word

# Digit counts of integer operands: biased to long numbers, which a tiny model gets wrong
# without the tool. Eval starts at 3 digits (see the held-out scheme above).
TRAIN_DIGIT_WEIGHTS = {1: 1, 2: 2, 3: 3, 4: 3, 5: 3, 6: 3}
EVAL_DIGIT_WEIGHTS = {3: 1, 4: 1, 5: 1, 6: 1}

HELD_OUT_BUCKETS = 50  # of 1000
MIN_HELD_OUT_KEY = 100
HELD_OUT_STRING_MODULUS = 20
# Follow-ups chain on the previous result only when it is a short plain number: a 17-digit
# float would crowd the 256-token context.
MAX_FOLLOWUP_OPERAND_CHARS = 10
_PLAIN_NUMBER = re.compile(r"-?\d+(\.\d+)?")

# --- phrasings ---------------------------------------------------------------------------------
ARITHMETIC_ANSWERS = ["{expr} = {result}.", "The answer is {result}."]


@dataclass(frozen=True)
class WordProblem:
    """A story template; {a} {op} {b} is the expression, {result} its answer."""

    op: str
    question: str
    answer: str
    exact: bool = False  # division that comes out whole (sharing things out)
    money: bool = False  # {a} may be a price with cents


TRAIN_WORD_PROBLEMS = [
    WordProblem("+", "{name} has {a} {items} and buys {b} more. "
                "How many {items} does {name} have now?", "{name} has {result} {items} now."),
    WordProblem("+", "A shop sold {a} {items} on Monday and {b} on Tuesday. "
                "How many {items} did it sell in total?", "It sold {result} {items} in total."),
    WordProblem("-", "{name} had {a} {items} and gave away {b}. How many {items} are left?",
                "{name} has {result} {items} left."),
    WordProblem("-", "A tower is {a} meters tall and a tree is {b} meters tall. "
                "How much taller is the tower?", "The tower is {result} meters taller."),
    WordProblem("*", "One {item} costs {a} dollars. How much do {b} {items} cost?",
                "They cost {result} dollars.", money=True),
    WordProblem("*", "A car drives at {a} km per hour for {b} hours. How far does it go?",
                "It goes {result} km."),
    WordProblem("*", "There are {a} boxes with {b} {items} in each. How many {items} are there?",
                "There are {result} {items}."),
    WordProblem("/", "{name} shares {a} {items} equally among {b} friends. "
                "How many {items} does each friend get?", "Each friend gets {result} {items}.",
                exact=True),
    WordProblem("/", "A trip of {a} km takes {b} hours. What is the average speed in km per hour?",
                "The average speed is {result} km per hour."),
]  # fmt: skip
EVAL_WORD_PROBLEMS = [  # eval only
    WordProblem("+", "{name} collected {a} {items} last week and {b} this week. "
                "How many {items} is that altogether?", "That is {result} {items} altogether."),
    WordProblem("-", "{name} wants {a} {items} and already has {b}. "
                "How many more does {name} need?", "{name} needs {result} more {items}."),
    WordProblem("*", "A farmer plants {a} rows with {b} trees in each row. "
                "How many trees are planted?", "{result} trees are planted."),
    WordProblem("/", "{a} liters of water are poured equally into {b} tanks. "
                "How many liters go in each tank?", "Each tank gets {result} liters.", exact=True),
]  # fmt: skip
TRAIN_NAMES = ["Sam", "Mia", "Leo", "Ava", "Tom", "Zoe", "Ben", "Lily", "Max", "Emma", "Noah"]
EVAL_NAMES = ["Ivy", "Omar", "Rosa", "Hugo"]  # eval only
TRAIN_ITEMS = [("apple", "apples"), ("cookie", "cookies"), ("book", "books"),
               ("pencil", "pencils"), ("marble", "marbles"), ("sticker", "stickers"),
               ("card", "cards"), ("orange", "oranges"), ("stamp", "stamps"),
               ("ticket", "tickets")]  # fmt: skip
EVAL_ITEMS = [("shell", "shells"), ("button", "buttons"), ("candle", "candles")]  # eval only

FOLLOWUP_ANSWERS = ["{expr} = {result}.", "That gives {result}."]

TRAIN_WORDS = [
    "strawberry", "banana", "apple", "hello", "mississippi", "letter", "butter", "coffee",
    "balloon", "bookkeeper", "committee", "occurrence", "raspberry", "blueberry", "cherry",
    "orange", "lemon", "grape", "pineapple", "watermelon", "computer", "keyboard", "window",
    "garden", "teacher", "student", "school", "pencil", "paper", "rabbit", "giraffe", "elephant",
    "kangaroo", "hippopotamus", "penguin", "dolphin", "turtle", "monkey", "parrot", "squirrel",
    "chocolate", "vanilla", "cinnamon", "pepper", "tomato", "potato", "carrot", "broccoli",
    "spaghetti", "pizza", "sandwich", "cookie", "muffin", "pancake", "breakfast", "dinner",
    "summer", "winter", "autumn", "spring", "rainbow", "thunder", "lightning", "mountain", "river",
    "ocean", "island", "forest", "desert", "volcano", "planet", "galaxy", "rocket", "astronaut",
    "bicycle", "airplane", "train", "bottle", "kettle", "puzzle", "guitar", "piano", "violin",
    "trumpet", "drummer", "success", "address", "possess", "necessary", "accommodate", "embarrass",
    "assessment", "tennessee", "referee", "coconut", "avocado", "zebra", "alphabet", "umbrella",
    "yellow", "purple", "silver", "happiness", "sunshine", "moonlight", "butterfly", "caterpillar",
    "grasshopper", "library", "calendar", "tomorrow", "yesterday", "parallel",
]  # fmt: skip
EVAL_WORDS = [  # eval only
    "cucumber", "mango", "peppermint", "lollipop", "marshmallow", "crocodile", "flamingo",
    "octopus", "pumpkin", "blizzard", "hurricane", "telescope", "saxophone", "accordion",
    "wallpaper", "carpenter", "engineer", "nonsense", "mushroom", "avalanche", "referral",
    "bubblegum", "pepperoni", "cappuccino", "kayak",
]  # fmt: skip

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

# Pieces of made-up words: onset + nucleus + coda, one to three syllables.
_ONSETS = ["b", "bl", "br", "c", "ch", "cl", "cr", "d", "dr", "f", "fl", "fr", "g", "gl", "gr",
           "h", "j", "k", "l", "m", "n", "p", "pl", "pr", "qu", "r", "s", "sh", "sk", "sl", "sn",
           "sp", "st", "t", "th", "tr", "v", "w", "z", ""]  # fmt: skip
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ee", "oo", "ou", "ea", "y"]
_CODAS = ["", "", "", "n", "r", "l", "m", "s", "t", "ck", "ng", "sh", "x", "p", "rt", "nd"]

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
         "What can I ask you?"],
        ["What are your abilities?"],
        "I can do arithmetic with my calculator and count letters in words. I'm only chatcli's "
        "small built-in demo model; for more, load a real nanochat checkpoint with "
        "chatcli chat --model PATH.",
    ),
    "model": (
        ["What model is this?", "Which model are you?", "How big are you?",
         "How many parameters do you have?"],
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

TRAIN_SYSTEM_PROMPTS = [
    "You are a helpful assistant.", "You are a concise assistant.", "Be helpful and brief.",
    "You are chatcli's assistant.", "Answer briefly.",
]  # fmt: skip
EVAL_SYSTEM_PROMPTS = ["You are a friendly assistant.", "Keep answers short."]  # eval only


@dataclass(frozen=True)
class EvalItem:
    """One held-out prompt and what a correct final answer must contain."""

    kind: str  # one of EVAL_KINDS
    messages: list[dict]  # up to and including the last user message
    expected: str | None  # the result text the answer must contain; None when there is no tool
    expected_expression: str | None  # the python the model should write; None when no tool


@dataclass(frozen=True)
class _Exchange:
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


# --- public API ---------------------------------------------------------------------------------


def generate_conversations(n: int, seed: int, split: str = "train") -> list[list[dict]]:
    """`n` conversations drawn from KIND_WEIGHTS; the same seed and split give the same list."""
    return [conversation for _, conversation in generate_labelled_conversations(n, seed, split)]


def generate_labelled_conversations(
    n: int, seed: int, split: str = "train"
) -> list[tuple[str, list[dict]]]:
    """Like generate_conversations, each paired with its kind (a key of KIND_WEIGHTS)."""
    _check_split(split)
    rng = random.Random(seed)
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    labelled = []
    for _ in range(n):
        kind = rng.choices(kinds, weights)[0]
        labelled.append((kind, _conversation(rng, split, kind)))
    return labelled


def generate_eval_set(n_per_kind: int, seed: int) -> list[EvalItem]:
    """`n_per_kind` held-out items of each of EVAL_KINDS, in that order."""
    rng = random.Random(seed)
    items = []
    for kind in EVAL_KINDS:
        for _ in range(n_per_kind):
            *prompt, answer = _conversation(rng, "eval", kind)
            assert answer["role"] == "assistant" and prompt[-1]["role"] == "user"
            expected = expression = None
            if isinstance(answer["content"], list):
                parts = {part["type"]: part["text"] for part in answer["content"]}
                expected, expression = parts["python_output"], parts["python"]
            items.append(EvalItem(kind, prompt, expected, expression))
    return items


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


# --- conversations by kind ----------------------------------------------------------------------


def _conversation(rng: random.Random, split: str, kind: str) -> list[dict]:
    messages = _KIND_GENERATORS[kind](rng, split)
    if rng.random() < SYSTEM_PROMPT_PROBABILITY:
        prompt = rng.choice(_pool(split, TRAIN_SYSTEM_PROMPTS, EVAL_SYSTEM_PROMPTS))
        messages.insert(0, {"role": "system", "content": prompt})
    return messages


def _greeting(rng: random.Random, split: str) -> list[dict]:
    # Either an opener, sometimes followed by a task and a closer, or a closer on its own.
    if rng.random() < 0.3:
        return _chat_turn(rng, split, rng.choice(("thanks", "bye")))
    messages = _chat_turn(rng, split, rng.choice(("hello", "hello", "how_are_you")))
    if rng.random() < 0.5:
        task = _arithmetic_exchange if rng.random() < 0.7 else _counting_exchange
        messages += task(rng, split).messages()
        if rng.random() < 0.7:
            messages += _chat_turn(rng, split, rng.choice(("thanks", "thanks", "bye")))
    return messages


def _chat_turn(rng: random.Random, split: str, intent: str) -> list[dict]:
    train, held_out, replies = GREETINGS[intent]
    return [
        {"role": "user", "content": rng.choice(_pool(split, train, held_out))},
        {"role": "assistant", "content": rng.choice(replies)},
    ]


def _identity(rng: random.Random, split: str) -> list[dict]:
    train, held_out, answer = IDENTITY[rng.choice(list(IDENTITY))]
    question = _with_filler(rng, split, _vary(rng, rng.choice(_pool(split, train, held_out))))
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _out_of_scope(rng: random.Random, split: str) -> list[dict]:
    if split == "train" and rng.random() < MADE_UP_TOPIC_PROBABILITY:
        # Unfamiliar words are no sign of a counting question: they are everywhere.
        kind = rng.choice(MADE_UP_TOPIC_KINDS)
        topic = kind.format(_pseudo_word(rng, split, 1, 3).capitalize())
        question = rng.choice(phrasings.OUT_OF_SCOPE_FRAMES).format(t=topic)
    else:
        question = phrasings.out_of_scope_question(rng, split)
    question = _with_filler(rng, split, _vary(rng, question))
    answer = rng.choice(OUT_OF_SCOPE_ANSWERS)
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _arithmetic(rng: random.Random, split: str) -> list[dict]:
    return _arithmetic_exchange(rng, split).messages()


def _counting(rng: random.Random, split: str) -> list[dict]:
    return _counting_exchange(rng, split).messages()


def _followup(rng: random.Random, split: str) -> list[dict]:
    """2-3 user turns; each later one builds on the answer before it."""
    n_followups = rng.choice((1, 1, 2))
    if rng.random() < ARITHMETIC_FOLLOWUP_PROBABILITY:
        exchange = _arithmetic_exchange(rng, split)
        while not _usable_left_operand(exchange.result, split):
            exchange = _arithmetic_exchange(rng, split)
        exchanges = [exchange]
        for _ in range(n_followups):
            if not _usable_left_operand(exchanges[-1].result, split):
                break
            exchanges.append(_arithmetic_followup(rng, split, exchanges[-1].result))
    else:
        exchanges = [_counting_exchange(rng, split)]
        for _ in range(n_followups):
            exchanges.append(_counting_followup(rng, split, exchanges[-1]))
    return [message for exchange in exchanges for message in exchange.messages()]


def _mixed(rng: random.Random, split: str) -> list[dict]:
    """Not an EVAL_KIND: the eval set asks each question at a conversation's start
    (scripts/context_check.py asks them later)."""
    return [message for _, segment in _mixed_segments(rng, split) for message in segment]


def _mixed_segments(rng: random.Random, split: str) -> list[tuple[str, list[dict]]]:
    """2-3 (kind, messages) segments, kinds from MIXED_SEGMENT_WEIGHTS and no two in a row
    alike, while the whole stays under MAX_MIXED_CHARS."""
    kinds, weights = list(MIXED_SEGMENT_WEIGHTS), list(MIXED_SEGMENT_WEIGHTS.values())
    n_segments = rng.randint(2, MAX_MIXED_SEGMENTS)
    segments: list[tuple[str, list[dict]]] = []
    messages: list[dict] = []
    while len(segments) < n_segments:
        kind = rng.choices(kinds, weights)[0]
        if segments and kind == segments[-1][0]:
            continue
        segment = _KIND_GENERATORS[kind](rng, split)
        if len(render_text_only(messages + segment)) >= MAX_MIXED_CHARS:
            if len(segments) >= 2:
                break
            continue  # a long first or second segment: draw another
        segments.append((kind, segment))
        messages += segment
    return segments


_KIND_GENERATORS = {
    "greeting": _greeting,
    "identity": _identity,
    "arithmetic": _arithmetic,
    "counting": _counting,
    "followup": _followup,
    "out_of_scope": _out_of_scope,
    "mixed": _mixed,
}
assert set(_KIND_GENERATORS) == set(KIND_WEIGHTS) >= set(EVAL_KINDS)
assert set(MIXED_SEGMENT_WEIGHTS) <= set(_KIND_GENERATORS) - {"mixed"}


# --- arithmetic ---------------------------------------------------------------------------------


def _arithmetic_exchange(rng: random.Random, split: str) -> _Exchange:
    if rng.random() < WORD_PROBLEM_PROBABILITY:
        return _word_problem(rng, split)
    op = rng.choice("+-*/")
    a, b = _plain_operands(rng, split, op)
    expression = f"{a}{op}{b}"
    result = _calculate(expression)
    question = _vary(
        rng, phrasings.arithmetic_question(rng, split, op, _display(rng, a), _display(rng, b))
    )
    question = _with_filler(rng, split, question)
    sentence = rng.choice(ARITHMETIC_ANSWERS).format(expr=expression, result=result)
    return _Exchange(question, expression, result, sentence)


def _plain_operands(rng: random.Random, split: str, op: str) -> tuple[str, str]:
    if op == "/" and rng.random() < EXACT_DIVISION_PROBABILITY:
        return _exact_division(rng, split, max_digits=6)
    if rng.random() < DECIMAL_PROBABILITY:
        # Sometimes only one side has cents, as in 19.99*3.
        a = _sample_decimal(rng, split)
        b = _sample_decimal(rng, split) if rng.random() < 0.6 else _sample_int(rng, split)
        if rng.random() < 0.5:
            a, b = b, a
    else:
        a, b = _sample_int(rng, split), _sample_int(rng, split)
    # Quotients stay >= 1 (1/999999 prints as 1.000001000001e-06); differences mostly >= 0.
    keep_order = op == "-" and rng.random() < NEGATIVE_DIFFERENCE_PROBABILITY
    if op in "-/" and not keep_order and float(a) < float(b):
        a, b = b, a
    return a, b


def _word_problem(rng: random.Random, split: str) -> _Exchange:
    # Stories share their templates across splits (the operator words must be taught); eval
    # holds out the names, the items and the numbers, so every eval question is a new sentence.
    stories = TRAIN_WORD_PROBLEMS + EVAL_WORD_PROBLEMS
    if split == "eval":  # only stories whose sentence changes with the held-out words
        stories = [p for p in stories if "{name}" in p.question or "{item" in p.question]
    problem = rng.choice(stories)
    if problem.exact:
        a, b = _exact_division(rng, split, max_digits=4)
    else:
        money = problem.money and rng.random() < 0.3
        a = _sample_decimal(rng, split) if money else _sample_int(rng, split, max_digits=4)
        b = _sample_int(rng, split, max_digits=3)
        if problem.op in "-/" and float(a) < float(b):
            a, b = b, a
    expression = f"{a}{problem.op}{b}"
    result = _calculate(expression)
    name = rng.choice(_pool(split, TRAIN_NAMES, EVAL_NAMES))
    item, items = rng.choice(_pool(split, TRAIN_ITEMS, EVAL_ITEMS))
    if split == "train" and rng.random() < PSEUDO_NAME_PROBABILITY:
        name = _pseudo_word(rng, split, 1, 2).capitalize()
    if split == "train" and rng.random() < PSEUDO_NAME_PROBABILITY:
        item = _pseudo_word(rng, split, 1, 2)
        items = item + ("es" if item.endswith(("s", "sh", "ch", "x")) else "s")
    fields = {"name": name, "item": item, "items": items, "result": result}
    question = problem.question.format(a=_display(rng, a), b=_display(rng, b), **fields)
    question = _with_filler(rng, split, question)
    return _Exchange(question, expression, result, problem.answer.format(**fields))


def _arithmetic_followup(rng: random.Random, split: str, previous: str) -> _Exchange:
    template, op, fixed = phrasings.followup_question(rng, split)
    n = fixed or _followup_operand(rng)
    expression = f"{previous}{op}{n}"
    result = _calculate(expression)
    question = _vary(rng, template.format(n=n))
    sentence = rng.choice(FOLLOWUP_ANSWERS).format(expr=expression, result=result)
    return _Exchange(question, expression, result, sentence)


def _followup_operand(rng: random.Random) -> str:
    # Small and never held out, in both splits: what eval holds out in a follow-up is its
    # phrasing and its first question, not the "3" of "times 3".
    if rng.random() < 0.8:
        return str(rng.randint(2, 99))
    while True:
        n = str(rng.randint(100, 999))
        if not is_held_out_number(n):
            return n


def _usable_left_operand(result: str, split: str) -> bool:
    if not _PLAIN_NUMBER.fullmatch(result) or len(result) > MAX_FOLLOWUP_OPERAND_CHARS:
        return False
    # A training expression must never contain a held-out number, even as a previous result.
    return split == "eval" or not is_held_out_number(result)


# --- numbers ------------------------------------------------------------------------------------


def _sample_int(rng: random.Random, split: str, max_digits: int = 6) -> str:
    weights = TRAIN_DIGIT_WEIGHTS if split == "train" else EVAL_DIGIT_WEIGHTS
    digit_counts = [d for d in weights if d <= max_digits]
    while True:
        d = rng.choices(digit_counts, [weights[d] for d in digit_counts])[0]
        text = str(rng.randint(10 ** (d - 1), 10**d - 1))
        if _in_split(text, split):
            return text


def _sample_decimal(rng: random.Random, split: str) -> str:
    """A number with 1-2 decimals and no trailing zero ("3.10" is written 3.1 by people)."""
    while True:
        whole = rng.randint(0, 10 ** rng.randint(1, 3) - 1)
        places = rng.choice((1, 2))
        fraction = rng.randint(1, 10**places - 1)
        if fraction % 10 == 0:
            continue
        text = f"{whole}.{fraction:0{places}d}"
        if _in_split(text, split):
            return text


def _exact_division(rng: random.Random, split: str, max_digits: int) -> tuple[str, str]:
    """A dividend and divisor whose quotient is whole."""
    while True:
        b = _sample_int(rng, split, max_digits=3)
        q = rng.randint(2, 10 ** rng.randint(1, 3) - 1)
        a = str(int(b) * q)
        if len(a) <= max_digits and _in_split(a, split):
            return a, b


def _in_split(text: str, split: str) -> bool:
    return is_held_out_number(text) == (split == "eval")


def _display(rng: random.Random, text: str) -> str:
    """How the user writes an operand: sometimes 1,234 for 1234 (the expression never does)."""
    if "." not in text and int(text) >= 1000 and rng.random() < COMMA_PROBABILITY:
        return f"{int(text):,}"
    return text


def _calculate(expression: str) -> str:
    value = use_calculator(expression)
    assert value is not None, f"the calculator refused a generated expression: {expression}"
    return format_result(value)


# --- letter counting ----------------------------------------------------------------------------


def _counting_exchange(
    rng: random.Random, split: str, word: str | None = None, letter: str | None = None
) -> _Exchange:
    word = word or _sample_word(rng, split)
    letter = letter or _sample_letter(rng, word)
    stray = None
    if split == "train" and rng.random() < STRAY_WORD_PROBABILITY:
        stray = rng.choice(_dictionary_words())
    question = phrasings.counting_question(rng, split, word, letter, stray)
    return _count_exchange(_with_filler(rng, split, _vary(rng, question)), word, letter)


def _counting_followup(rng: random.Random, split: str, previous: _Exchange) -> _Exchange:
    word, letter = _COUNT_CALL.fullmatch(previous.expression).groups()
    verb = None
    if split == "train" and rng.random() < VERB_FRAME_PROBABILITY:
        verb = rng.choice(_dictionary_words())
    if rng.random() < 0.5:
        new_word = word
        while new_word == word:
            new_word = _sample_word(rng, split)
        question = phrasings.new_word_question(rng, split, new_word, verb)
        return _count_exchange(_vary(rng, question), new_word, letter)
    new_letter = letter
    while new_letter == letter:
        new_letter = _sample_letter(rng, word)
    question = phrasings.new_letter_question(rng, split, new_letter, verb)
    return _count_exchange(_vary(rng, question), word, new_letter)


_COUNT_CALL = re.compile(r'"([a-z]+)"\.count\("([a-z])"\)')


def _count_exchange(question: str, word: str, letter: str) -> _Exchange:
    expression = f'"{word}".count("{letter}")'
    result = _calculate(expression)
    if result == "1":
        sentence = f"There is 1 {letter} in {word}."
    else:
        sentence = f"There are {result} {letter}'s in {word}."
    return _Exchange(question, expression, result, sentence)


def _sample_word(rng: random.Random, split: str) -> str:
    draw = rng.random()
    if split == "eval":  # English words it never trained on, and random strings
        if draw < EVAL_RANDOM_STRING_PROBABILITY:
            return _random_string(rng, split)
        return rng.choice(EVAL_WORDS)
    if draw < DICTIONARY_WORD_PROBABILITY:
        return rng.choice(_dictionary_words())
    draw -= DICTIONARY_WORD_PROBABILITY
    if draw < PSEUDO_WORD_PROBABILITY:
        return _pseudo_word(rng, split, 1, 3)
    draw -= PSEUDO_WORD_PROBABILITY
    if draw < RANDOM_STRING_PROBABILITY:
        return _random_string(rng, split)
    return rng.choice(TRAIN_WORDS)


def _random_string(rng: random.Random, split: str) -> str:
    while True:
        # A small alphabet makes letters repeat, so counts above 1 are common.
        alphabet = rng.sample(string.ascii_lowercase, rng.randint(3, 8))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(4, 12)))
        in_split = is_held_out_string(text) == (split == "eval")
        if in_split and text not in _ALL_WORDS:
            return text


@functools.cache
def _dictionary_words() -> list[str]:
    """Training only: the GCIDE dictionary's words of 4-12 letters (the english-words package,
    in the train extra), less every eval word, any word containing one or inside one, and any
    word the eval split's random strings and made-up words may use (is_held_out_string)."""
    try:
        from english_words import get_english_words_set
    except ImportError as e:
        raise ChatcliError(
            "Generating training data needs english-words: pip install -e '.[train]'"
        ) from e
    words = get_english_words_set(["gcide"], lower=True, alpha=True)
    return sorted(
        w
        for w in words
        if 4 <= len(w) <= 12
        and w.isascii()
        and w.isalpha()
        and not any(e in w or w in e for e in EVAL_WORDS)
        and w not in _ALL_NAMES
        and not is_held_out_string(w)
    )


_ALL_WORDS = frozenset(TRAIN_WORDS) | frozenset(EVAL_WORDS)
_ALL_NAMES = frozenset(n.lower() for n in TRAIN_NAMES + EVAL_NAMES) | frozenset(
    form for pair in TRAIN_ITEMS + EVAL_ITEMS for form in pair
)


def _pseudo_word(rng: random.Random, split: str, min_syllables: int, max_syllables: int) -> str:
    """A made-up pronounceable word of the split ("blorfin"), never a real word we list."""
    while True:
        text = "".join(
            rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
            for _ in range(rng.randint(min_syllables, max_syllables))
        )
        in_split = is_held_out_string(text) == (split == "eval")
        if len(text) >= 3 and in_split and text not in _ALL_WORDS and text not in _ALL_NAMES:
            return text


def _sample_letter(rng: random.Random, word: str) -> str:
    if rng.random() < LETTER_IN_WORD_PROBABILITY:
        return rng.choice(word)
    return rng.choice(string.ascii_lowercase)


# --- small shared pieces ------------------------------------------------------------------------


def _pool(split: str, train: list, held_out: list) -> list:
    return train if split == "train" else held_out


def _vary(rng: random.Random, text: str) -> str:
    """Type like a person: sometimes no capital, sometimes no question mark."""
    if rng.random() < 0.3:
        text = text[0].lower() + text[1:]
    if text.endswith("?") and rng.random() < 0.2:
        text = text[:-1]
    return text


def _with_filler(rng: random.Random, split: str, question: str) -> str:
    """Training only: chatter before or after a question (eval questions stay as they are)."""
    if split != "train" or rng.random() >= FILLER_PROBABILITY:
        return question
    if rng.random() < 0.6:
        return f"{rng.choice(TRAIN_FILLER_PREFIXES)} {question}"
    return f"{question} {rng.choice(TRAIN_FILLER_SUFFIXES)}"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print sample synthetic chat conversations.")
    parser.add_argument("--n", type=int, default=5, help="how many conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=SPLITS, default="train")
    args = parser.parse_args(argv)
    for kind, conversation in generate_labelled_conversations(args.n, args.seed, args.split):
        print(f"--- {kind}")
        print(render_text_only(conversation))


if __name__ == "__main__":
    main()
