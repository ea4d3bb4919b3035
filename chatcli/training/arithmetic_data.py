"""The arithmetic skill's data: plain questions, word problems and follow-ups on a result.

Owns how a two-operand calculation is asked and answered ("What is 1234*56?", a story about
apples, "and times 3?" after an answer) and which operands each split uses. Every question
becomes one compact calculator call (`1234*56`) and one sentence copying its output. It
knows nothing about the mix of conversation kinds or about evaluation.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from chatcli.training import phrasings
from chatcli.training.exchange import Exchange, calculate, display, vary, with_filler
from chatcli.training.held_out import (
    exact_division,
    is_held_out_number,
    pool,
    sample_decimal,
    sample_int,
)
from chatcli.training.vocabulary import (
    EVAL_ITEMS,
    EVAL_NAMES,
    TRAIN_ITEMS,
    TRAIN_NAMES,
    pseudo_word,
)

WORD_PROBLEM_PROBABILITY = 0.25  # of arithmetic questions
DECIMAL_PROBABILITY = 0.25  # of plain arithmetic questions
EXACT_DIVISION_PROBABILITY = 0.35  # of plain divisions
NEGATIVE_DIFFERENCE_PROBABILITY = 0.2  # of plain subtractions whose first operand is smaller
# Training only: both operands of one or two digits, the questions people type first ("What
# is 7*8?"). Drawn by digit count alone they were rare, and a model that also learnt to
# decline powers of small numbers declined small products as powers
# (scripts/small_arithmetic_probe.py).
SMALL_OPERANDS_PROBABILITY = 0.15  # of plain training questions
ONE_DIGIT_PROBABILITY = 0.6  # of each small operand
# Training only: half the small-operand questions in the shortest frames, the operator a
# symbol ("7-2", "what's 3-2"), each the minimal pair of a power question ("7^2", "What's 3
# squared?"). Drawn through all the wrappers, such frames held fewer small differences than
# small powers, and a model declined small differences as powers. Held-out pairs stay out
# here too.
SHORT_FRAME_PROBABILITY = 0.5  # of small-operand training questions
SHORT_WRAPPERS = [
    "What is {x}?", "what's {x}", "Compute {x}.", "calculate {x}", "How much is {x}?",
    "{x} = ?", "{x}", "{x}?",
]  # fmt: skip
# The operator cores that write the operator as its symbol: "{a}-{b}" and "{a} - {b}".
SYMBOL_CORES = {
    op: [c for c in cores if c.replace(" ", "") == "{a}" + op + "{b}"]
    for op, cores in phrasings.OPERATOR_CORES.items()
}
PSEUDO_NAME_PROBABILITY = 0.4  # of word problems: a made-up name, and (separately) a made-up item
# Follow-ups chain on the previous result only when it is a short plain number: a 17-digit
# float would crowd the 256-token context.
MAX_FOLLOWUP_OPERAND_CHARS = 10
_PLAIN_NUMBER = re.compile(r"-?\d+(\.\d+)?")

ARITHMETIC_ANSWERS = ["{expr} = {result}.", "The answer is {result}."]
FOLLOWUP_ANSWERS = ["{expr} = {result}.", "That gives {result}."]


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


def arithmetic_exchange(rng: random.Random, split: str) -> Exchange:
    if rng.random() < WORD_PROBLEM_PROBABILITY:
        return word_problem(rng, split)
    op = rng.choice("+-*/")
    small = split == "train" and rng.random() < SMALL_OPERANDS_PROBABILITY
    a, b = small_operands(rng, op) if small else plain_operands(rng, split, op)
    expression = f"{a}{op}{b}"
    result = calculate(expression)
    if small and rng.random() < SHORT_FRAME_PROBABILITY:
        wrapper, core = phrasings.compose(rng, split, SHORT_WRAPPERS, [], SYMBOL_CORES[op])
        question = wrapper.format(x=core.format(a=a, b=b))
    else:
        question = phrasings.arithmetic_question(rng, split, op, display(rng, a), display(rng, b))
    question = with_filler(rng, split, vary(rng, question))
    sentence = rng.choice(ARITHMETIC_ANSWERS).format(expr=expression, result=result)
    return Exchange(question, expression, result, sentence)


def large_product_exchange(rng: random.Random, split: str) -> Exchange:
    """A product of two 3-4 digit numbers (a result of 5-8 digits), asked plainly: the
    calculation that a count asked right after it must not carry on from."""
    while True:
        a, b = sample_int(rng, split, max_digits=4), sample_int(rng, split, max_digits=4)
        if len(a) >= 3 and len(b) >= 3:
            break
    expression = f"{a}*{b}"
    result = calculate(expression)
    question = vary(
        rng, phrasings.arithmetic_question(rng, split, "*", display(rng, a), display(rng, b))
    )
    question = with_filler(rng, split, question)
    sentence = rng.choice(ARITHMETIC_ANSWERS).format(expr=expression, result=result)
    return Exchange(question, expression, result, sentence)


def plain_operands(rng: random.Random, split: str, op: str) -> tuple[str, str]:
    if op == "/" and rng.random() < EXACT_DIVISION_PROBABILITY:
        return exact_division(rng, split, max_digits=6)
    if rng.random() < DECIMAL_PROBABILITY:
        # Sometimes only one side has cents, as in 19.99*3.
        a = sample_decimal(rng, split)
        b = sample_decimal(rng, split) if rng.random() < 0.6 else sample_int(rng, split)
        if rng.random() < 0.5:
            a, b = b, a
    else:
        a, b = sample_int(rng, split), sample_int(rng, split)
    # Quotients stay >= 1 (1/999999 prints as 1.000001000001e-06); differences mostly >= 0.
    keep_order = op == "-" and rng.random() < NEGATIVE_DIFFERENCE_PROBABILITY
    if op in "-/" and not keep_order and float(a) < float(b):
        a, b = b, a
    return a, b


def small_operands(rng: random.Random, op: str) -> tuple[str, str]:
    """Two operands of one or two digits (never held out: keys under 100 are training's)."""
    a, b = (
        rng.randint(2, 9) if rng.random() < ONE_DIGIT_PROBABILITY else rng.randint(10, 99)
        for _ in range(2)
    )
    if op in "-/" and a < b and rng.random() < 0.8:
        a, b = b, a
    return str(a), str(b)


def word_problem(rng: random.Random, split: str) -> Exchange:
    # Stories share their templates across splits (the operator words must be taught); eval
    # holds out the names, the items and the numbers, so every eval question is a new sentence.
    stories = TRAIN_WORD_PROBLEMS + EVAL_WORD_PROBLEMS
    if split == "eval":  # only stories whose sentence changes with the held-out words
        stories = [p for p in stories if "{name}" in p.question or "{item" in p.question]
    problem = rng.choice(stories)
    if problem.exact:
        a, b = exact_division(rng, split, max_digits=4)
    else:
        money = problem.money and rng.random() < 0.3
        a = sample_decimal(rng, split) if money else sample_int(rng, split, max_digits=4)
        b = sample_int(rng, split, max_digits=3)
        if problem.op in "-/" and float(a) < float(b):
            a, b = b, a
    expression = f"{a}{problem.op}{b}"
    result = calculate(expression)
    name = rng.choice(pool(split, TRAIN_NAMES, EVAL_NAMES))
    item, items = rng.choice(pool(split, TRAIN_ITEMS, EVAL_ITEMS))
    if split == "train" and rng.random() < PSEUDO_NAME_PROBABILITY:
        name = pseudo_word(rng, split, 1, 2).capitalize()
    if split == "train" and rng.random() < PSEUDO_NAME_PROBABILITY:
        item = pseudo_word(rng, split, 1, 2)
        items = item + ("es" if item.endswith(("s", "sh", "ch", "x")) else "s")
    fields = {"name": name, "item": item, "items": items, "result": result}
    question = problem.question.format(a=display(rng, a), b=display(rng, b), **fields)
    question = with_filler(rng, split, question)
    return Exchange(question, expression, result, problem.answer.format(**fields))


def arithmetic_followup(rng: random.Random, split: str, previous: str) -> Exchange:
    template, op, fixed = phrasings.followup_question(rng, split)
    n = fixed or followup_operand(rng)
    expression = f"{previous}{op}{n}"
    result = calculate(expression)
    question = vary(rng, template.format(n=n))
    sentence = rng.choice(FOLLOWUP_ANSWERS).format(expr=expression, result=result)
    return Exchange(question, expression, result, sentence)


def followup_operand(rng: random.Random) -> str:
    # Small and never held out, in both splits: what eval holds out in a follow-up is its
    # phrasing and its first question, not the "3" of "times 3".
    if rng.random() < 0.8:
        return str(rng.randint(2, 99))
    while True:
        n = str(rng.randint(100, 999))
        if not is_held_out_number(n):
            return n


def usable_left_operand(result: str, split: str) -> bool:
    if not _PLAIN_NUMBER.fullmatch(result) or len(result) > MAX_FOLLOWUP_OPERAND_CHARS:
        return False
    # A training expression must never contain a held-out number, even as a previous result.
    return split == "eval" or not is_held_out_number(result)
