"""Tests for chatcli.training.expression_data and everyday_math_data: each question and its
one calculator call say the same calculation, with the precedence the words mean."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from chatcli.engine.calculator import use_calculator
from chatcli.training.eval_sets import generate_eval_set
from chatcli.training.everyday_math_data import average_exchange, percent_exchange
from chatcli.training.expression_data import expression_exchange, signed_exchange, worded_exchange
from chatcli.training.number_words import number_in_words
from tests.training_data import NUMBER

OPERATOR_WORDS = {" plus ": "+", " minus ": "-", " times ": "*", " divided by ": "/"}
GROUPS = {
    "the sum of": "+",
    "the difference between": "-",
    "the product of": "*",
    "the quotient of": "/",
}
THEN = re.compile(r"(\d+ \S+(?: by)? \d+), (?:and then|then|all) (\S+(?: by)?) (\d+)")


def exchanges(make, split: str, n: int = 600, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [make(rng, split) for _ in range(n)]


def meaning(question: str) -> str:
    """The calculation a question asks, written as a calculator expression by rules of its
    own: a named group ("the sum of 12 and 8") or a "then" chain in parentheses, symbols as
    they are, operator words as symbols; what is left (the wrapper's words) dropped."""
    text = question.replace(" x ", " * ")
    for name, op in GROUPS.items():
        text = re.sub(rf"{name} (\d+) and (\d+)", rf"(\1{op}\2)", text)
    text = THEN.sub(lambda m: f"({m[1]}) {m[2]} {m[3]}", text)
    for word, op in OPERATOR_WORDS.items():
        text = text.replace(word, op)
    text = text.replace(",", "")
    return re.sub(r"[^\d+\-*/().]", "", text).strip(".")


@pytest.mark.parametrize("split", ["train", "eval"])
def test_an_expression_question_and_its_call_are_the_same_calculation(split):
    for exchange in exchanges(expression_exchange, split):
        assert use_calculator(meaning(exchange.question)) == use_calculator(exchange.expression), (
            exchange.question,
            exchange.expression,
        )


def test_operator_words_take_the_usual_precedence():
    # "3 plus 4 times 5" is 23: the call writes the operators in the order they are said and
    # the calculator applies the precedence; a "then" chain is parenthesised as said.
    assert meaning("What is 3 plus 4 times 5?") == "3+4*5"
    assert use_calculator("3+4*5") == 23
    assert meaning("What is 12 plus 8, then times 3?") == "(12+8)*3"
    assert meaning("the sum of 12 and 8, times 3") == "(12+8)*3"
    assert meaning("3 times the sum of 4 and 5") == "3*(4+5)"
    calls = [e.expression for e in exchanges(expression_exchange, "train", n=2000)]
    flat_mixed = [c for c in calls if "(" not in c and re.search(r"[-+].*[*/]", c)]
    assert len(flat_mixed) > 100  # a sum before a product, no parentheses: precedence decides


def test_expressions_come_in_every_shape():
    rng = random.Random(3)
    questions, calls = [], []
    for _ in range(2000):
        exchange = expression_exchange(rng, "train")
        questions.append(exchange.question)
        calls.append(exchange.expression)
    operator_counts = Counter(len(re.findall(r"[-+*/]", c)) for c in calls)
    assert operator_counts[2] > 500 and operator_counts[3] > 200
    assert sum(c.count("(") == 1 for c in calls) > 300
    assert sum(c.count("(") == 2 for c in calls) > 150
    assert sum(" plus " in q or " times " in q for q in questions) > 300  # said in words
    assert any(re.fullmatch(r"\d+\*\d+\*\d+", c) for c in calls)  # as in 6*7*7
    # Calls are compact: no spaces, no x for times, no thousands separators.
    assert not any(" " in c or "x" in c or "," in c for c in calls)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_signed_questions_write_their_numbers_into_the_call(split):
    for exchange in exchanges(signed_exchange, split):
        call = exchange.expression
        assert re.fullmatch(r"-?[\d.]+[-+*/](\(-[\d.]+\)|[\d.]+)", call), call
        a, b = re.fullmatch(r"(-?[\d.]+)[-+*/]\(?(-?[\d.]+)\)?", call).groups()
        assert a.startswith("-") or b.startswith("-") or "." in a + b
        question = exchange.question.replace(",", "").lower()
        assert sorted(NUMBER.findall(question)) == sorted(NUMBER.findall(call)), question
        for operand in (a, b):
            # "negative 1299" does not say "negative 1": the number ends where its digits do.
            magnitude = re.escape(operand.lstrip("-"))
            said_negative = re.search(rf"negative {magnitude}(?![\d.]*\d)", question) is not None
            if operand.startswith("-"):
                assert said_negative or operand in question, (operand, question)
            else:
                assert not said_negative, (operand, question)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_number_word_questions_name_both_operands(split):
    for exchange in exchanges(worded_exchange, split):
        a, op, b = re.fullmatch(r"(\d+)([-+*/])(\d+)", exchange.expression).groups()
        question = exchange.question.lower()
        for n in (int(a), int(b)):
            spellings = {str(n)} | {
                number_in_words(n, use_and=u, hyphen=h)
                for u in (True, False)
                for h in (True, False)
            }
            assert any(s in question for s in spellings), (n, question)
        if op == "/":
            assert int(a) % int(b) == 0  # "eighty-four divided by seven": a whole quotient


def test_most_number_word_questions_have_no_digits_at_all():
    questions = [e.question for e in exchanges(worded_exchange, "train", n=1000)]
    assert sum(not re.search(r"\d", q) for q in questions) > 600


@pytest.mark.parametrize("split", ["train", "eval"])
def test_percentage_calls_follow_the_question(split):
    forms = Counter()
    for exchange in exchanges(percent_exchange, split, n=900):
        call, question = exchange.expression, exchange.question.replace(",", "")
        # "When 400 counts as 100%, what percent is 382?" names the 100 the call multiplies by.
        numbers = NUMBER.findall(question.replace("counts as 100%", "counts as the whole"))
        if m := re.fullmatch(r"([\d.]+)\*([\d.]+)/100", call):  # p% of x
            assert [m[1], m[2]] == numbers and ("%" in question or "cent" in question)
            forms["of"] += 1
        elif m := re.fullmatch(r"([\d.]+)\*\(100([-+])([\d.]+)\)/100", call):  # x up or down p%
            assert sorted([m[1], m[3]]) == sorted(numbers)
            up = re.search(r"increased|plus|added|raised", question) is not None
            assert up == (m[2] == "+"), question
            forms["change"] += 1
        else:  # what percent of x is y
            m = re.fullmatch(r"(\d+)\*100/(\d+)", call)
            assert m and sorted([m[1], m[2]]) == sorted(numbers), (call, question)
            forms["share"] += 1
    assert min(forms.values()) > 100


@pytest.mark.parametrize("split", ["train", "eval"])
def test_an_average_divides_the_sum_of_the_numbers_asked_by_how_many_there_are(split):
    for exchange in exchanges(average_exchange, split):
        m = re.fullmatch(r"\(([\d.+]+)\)/(\d)", exchange.expression)
        numbers = m[1].split("+")
        assert int(m[2]) == len(numbers) >= 2
        assert NUMBER.findall(exchange.question) == numbers
        assert exchange.sentence == f"The average is {exchange.result}."


def test_the_issue_s_examples_are_the_kind_of_call_taught():
    # What users asked the first model, as the calls these generators write for them.
    for call, value in [("6*7*7", 294), ("(12+8)*3", 60), ("3+4*5", 23), ("15*80/100", 12.0),
                        ("(3+5+10)/3", 6.0), ("12*7", 84), ("-12.5+3.75", -8.75),
                        ("5*(-3)", -15)]:  # fmt: skip
        assert use_calculator(call) == value


def test_new_eval_kinds_are_drawn_from_these_generators():
    items = generate_eval_set(30, seed=2, kinds=["expression", "signed", "percent", "average"])
    assert {i.kind for i in items} == {"expression", "signed", "percent", "average"}
    assert all(use_calculator(i.expected_expression) is not None for i in items)
