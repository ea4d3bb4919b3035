"""The data of arithmetic past one plain operator: whole expressions, signs and decimals, words.

Owns three skills, each one question and one calculator call with the whole calculation in
it (the calculator applies the precedence; the model only writes what was asked, in order):

- expressions with several operators and parentheses: "What is 6*7*7?" -> `6*7*7`, "the sum
  of 12 and 8, times 3" -> `(12+8)*3`, "3 plus 4 times 5" -> `3+4*5` (23);
- negative numbers and decimals: "-12.5 plus 3.75" -> `-12.5+3.75`, "5 times negative 3" ->
  `5*(-3)`;
- numbers in words: "twelve times seven" -> `12*7`.

Operands follow held_out.py: a training question uses no held-out number; an eval question
of several small operands has at least one held-out one (signed questions use held-out
numbers only, as plain arithmetic does). It knows nothing about the mix or about evaluation.
"""

from __future__ import annotations

import random

from chatcli.engine.calculator import format_result, use_calculator
from chatcli.training import math_phrasings, phrasings
from chatcli.training.exchange import Exchange, display, vary, with_filler
from chatcli.training.held_out import (
    is_held_out_number,
    operands_in_split,
    sample_decimal,
    sample_int,
)
from chatcli.training.math_phrasings import GROUP_WORDS, OPERATOR_WORDS, SYMBOL_FORMS, THEN_FORMS
from chatcli.training.number_words import random_style

ANSWERS = ["{expr} = {result}.", "The answer is {result}."]
OPERATORS, OPERATOR_WEIGHTS = "+-*/", (3, 3, 3, 1)
SHAPE_WEIGHTS = {"flat": 0.45, "group_left": 0.25, "group_right": 0.15, "two_groups": 0.15}
WORDS_PROBABILITY = 0.4  # of expressions whose shape can be said in words
SMALL_DIGIT_WEIGHTS = {1: 3, 2: 3, 3: 2, 4: 1}  # expressions are mostly small numbers
DECIMAL_OPERAND_PROBABILITY = 0.4  # of signed questions' operands
NEGATIVE_OPERAND_PROBABILITY = 0.45
NEGATIVE_WORD_PROBABILITY = 0.25  # "negative 12" rather than "-12"
WORDED_DIGITS_PROBABILITY = 0.25  # of number-word questions: one operand stays in digits
MAX_RESULT = 10**12
# Training only: a number-words operand of 3-4 digits. Eval asks one in every question, while
# the base draw makes most operands two digits at most, and a model trained on that lost
# the zeros of larger ones ("nine hundred and three" -> 93).
LARGE_WORDED_PROBABILITY = 0.5
# How many terms a flat chain has, drawn from these: training asks more of four than eval
# does, as models trained on fewer dropped a term of held-out four-term chains ("9658 minus
# 8997 times 400 times 801" -> 9658-8997*4001; docs/training-history.md).
FLAT_TERMS = {"train": (3, 4), "eval": (3, 3, 4)}


def expression_exchange(rng: random.Random, split: str) -> Exchange:
    """Several operators, maybe parentheses, asked whole and computed in one call."""
    while True:
        operands = [small_operand(rng) for _ in range(4)]
        if split == "eval":  # one held-out number, anywhere
            operands[rng.randrange(4)] = sample_int(rng, "eval", max_digits=4)
        call, shown, used = _expression(rng, operands, FLAT_TERMS[split])
        result = _acceptable_result(call)
        if result is not None and operands_in_split(used, split):
            break
    question = with_filler(
        rng, split, vary(rng, math_phrasings.expression_question(rng, split, shown))
    )
    sentence = rng.choice(ANSWERS).format(expr=call, result=result)
    return Exchange(question, call, result, sentence)


def signed_exchange(rng: random.Random, split: str) -> Exchange:
    """Two operands, at least one negative or with decimals; every operand of the split."""
    op = rng.choice(OPERATORS)
    while True:
        a, b = _signed_operand(rng, split), _signed_operand(rng, split)
        if a.startswith("-") or b.startswith("-") or "." in a + b:
            break
    call = f"{a}{op}{_grouped(b)}"
    result = _acceptable_result(call)
    if result is None:  # a quotient too small to print plainly: another pair
        return signed_exchange(rng, split)
    question = phrasings.arithmetic_question(rng, split, op, _shown(rng, a), _shown(rng, b))
    question = with_filler(rng, split, vary(rng, question))
    return Exchange(question, call, result, rng.choice(ANSWERS).format(expr=call, result=result))


def worded_exchange(rng: random.Random, split: str) -> Exchange:
    """Two whole numbers written in words ("twelve times seven"), the call in digits."""
    op = rng.choice(OPERATORS)
    a, b = _worded_operands(rng, split, op)
    call = f"{a}{op}{b}"
    result = _acceptable_result(call)
    assert result is not None, call
    shown = [random_style(rng, int(a)), random_style(rng, int(b))]
    if rng.random() < WORDED_DIGITS_PROBABILITY:
        i = rng.randrange(2)
        shown[i] = (a, b)[i]
    question = math_phrasings.worded_arithmetic_question(rng, split, op, *shown)
    question = with_filler(rng, split, vary(rng, question))
    return Exchange(question, call, result, rng.choice(ANSWERS).format(expr=call, result=result))


def small_operand(rng: random.Random) -> str:
    """A kept (never held-out) whole number of 1-4 digits, mostly short."""
    digits = rng.choices(list(SMALL_DIGIT_WEIGHTS), list(SMALL_DIGIT_WEIGHTS.values()))[0]
    while True:
        text = str(rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10**digits - 1))
        if not is_held_out_number(text):
            return text


def _expression(
    rng: random.Random, operands: list[str], flat_terms: tuple[int, ...]
) -> tuple[str, str, list[str]]:
    """(the call, the expression as the user writes it, the operands it uses); a flat chain
    has one of `flat_terms` terms."""
    shape = rng.choices(list(SHAPE_WEIGHTS), list(SHAPE_WEIGHTS.values()))[0]
    ops = rng.choices(OPERATORS, OPERATOR_WEIGHTS, k=3)
    words = rng.random() < WORDS_PROBABILITY
    if shape == "flat":
        n = rng.choice(flat_terms)
        call, shown = _flat(rng, operands[:n], ops[: n - 1], words)
        return call, shown, operands[:n]
    call, shown = _grouped_expression(rng, shape, operands, ops, words)
    return call, shown, operands if shape == "two_groups" else operands[:3]


def _flat(rng: random.Random, terms: list[str], ops: list[str], words: bool) -> tuple[str, str]:
    """a op b op c [op d], no parentheses: "6*7*7", "3 plus 4 times 5"."""
    call = terms[0] + "".join(op + t for op, t in zip(ops, terms[1:], strict=True))
    if not words:
        return call, _symbols(rng, call)
    said = " ".join(f"{_word(rng, op)} {t}" for op, t in zip(ops, terms[1:], strict=True))
    return call, f"{terms[0]} {said}"


def _grouped_expression(
    rng: random.Random, shape: str, operands: list[str], ops: list[str], words: bool
) -> tuple[str, str]:
    """(a op b) op c, a op (b op c) or (a op b) op (c op d)."""
    a, b, c, d = operands
    if shape == "group_left":
        call = f"({a}{ops[0]}{b}){ops[1]}{c}"
        if not words:
            return call, _symbols(rng, call)
        if rng.random() < 0.5:
            group = GROUP_WORDS[ops[0]].format(a=a, b=b)
            return call, f"{group}, {_word(rng, ops[1])} {c}"
        group = f"{a} {_word(rng, ops[0])} {b}"
        return call, rng.choice(THEN_FORMS).format(g=group, w=_word(rng, ops[1]), c=c)
    if shape == "group_right":
        call = f"{a}{ops[0]}({b}{ops[1]}{c})"
        if not words:
            return call, _symbols(rng, call)
        return call, f"{a} {_word(rng, ops[0])} {GROUP_WORDS[ops[1]].format(a=b, b=c)}"
    call = f"({a}{ops[0]}{b}){ops[1]}({c}{ops[2]}{d})"
    return call, _symbols(rng, call)


def _word(rng: random.Random, op: str) -> str:
    return rng.choice(OPERATOR_WORDS[op])


def _symbols(rng: random.Random, call: str) -> str:
    """The call as a person types it: spaced or not, sometimes x for *."""
    if rng.random() < 0.5:
        return call
    out = []
    for ch in call:
        if ch in SYMBOL_FORMS:
            out.append(f" {rng.choice(SYMBOL_FORMS[ch])} ")
        else:
            out.append(ch)
    return "".join(out)


def _acceptable_result(call: str) -> str | None:
    """The calculator's output for `call`, or None when it refuses it or the result is too
    large or too small to print as a plain number (1e-05)."""
    value = use_calculator(call)
    if value is None or abs(value) > MAX_RESULT:
        return None
    text = format_result(value)
    return None if "e" in text else text


def _signed_operand(rng: random.Random, split: str) -> str:
    if rng.random() < DECIMAL_OPERAND_PROBABILITY:
        text = sample_decimal(rng, split)
    else:
        text = sample_int(rng, split, max_digits=4)
    return "-" + text if rng.random() < NEGATIVE_OPERAND_PROBABILITY else text


def _grouped(operand: str) -> str:
    """A negative right operand in parentheses: 5*(-3), 5-(-3)."""
    return f"({operand})" if operand.startswith("-") else operand


def _shown(rng: random.Random, operand: str) -> str:
    if operand.startswith("-") and rng.random() < NEGATIVE_WORD_PROBABILITY:
        return "negative " + operand[1:]
    return operand if operand.startswith("-") else display(rng, operand)


def _worded_operands(rng: random.Random, split: str, op: str) -> tuple[str, str]:
    """Two whole numbers for a question in words: mostly small, as people write them; an
    eval question has one held-out number of 3-4 digits."""
    while True:
        a, b = _word_sized(rng, split), _word_sized(rng, split)
        if split == "eval":
            held = sample_int(rng, "eval", max_digits=4)
            a, b = (held, b) if rng.random() < 0.5 else (a, held)
        if op == "/":  # a whole quotient: the divisor small, the dividend its multiple
            b = str(rng.randint(2, 12))
            a = str(int(b) * rng.randint(2, 300))
        if op == "-" and int(a) < int(b):
            a, b = b, a
        if operands_in_split((a, b), split) and int(a) <= 999_999:
            return a, b


def _word_sized(rng: random.Random, split: str) -> str:
    if split == "train" and rng.random() < LARGE_WORDED_PROBABILITY:
        return _large_worded(rng)
    draw = rng.random()
    if draw < 0.55:
        return str(rng.randint(1, 20))
    if draw < 0.8:
        return str(rng.randint(21, 99))
    while True:
        text = str(rng.randint(100, 9999))
        if not is_held_out_number(text):
            return text


def _large_worded(rng: random.Random) -> str:
    """A kept number of 3-4 digits, half of them with a zero inside (903, 3098, 8240)."""
    while True:
        digits = [str(rng.randint(1, 9))] + [
            str(rng.randint(0, 9)) for _ in range(rng.choice((2, 3)))
        ]
        if rng.random() < 0.5:
            digits[rng.randrange(1, len(digits))] = "0"
        text = "".join(digits)
        if not is_held_out_number(text):
            return text
