"""Tests for chatcli.engine.calculator: what the model's calculator accepts, what it refuses."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from chatcli.engine import calculator
from chatcli.engine.calculator import format_result, use_calculator

ACCEPTED = [
    # integer arithmetic stays int
    ("1+2", 3),
    ("1234*56", 69104),
    ("100-250", -150),
    ("2*3+4", 10),
    ("2*(3+4)", 14),
    ("((((7))))", 7),
    ("(" * 60 + "1" + ")" * 60, 1),  # parentheses add no tree depth
    ("0", 0),
    ("-5", -5),
    ("+5", 5),
    ("--5", 5),
    ("-(2+3)*4", -20),
    ("  12 + 30  ", 42),
    ("1 +\t2", 3),
    # true division, as in Python
    ("10/4", 2.5),
    ("10/2", 5.0),
    ("1/3", 1 / 3),
    ("-7/2", -3.5),
    # decimals
    ("3.5*2", 7.0),
    ("0.1+0.2", 0.1 + 0.2),
    (".5+.5", 1.0),
    ("2.", 2.0),
    ("1e3", 1000.0),
    ("19.99*3", 19.99 * 3),
    # commas inside numbers
    ("1,234 * 5", 6170),
    ("1,234,567+1", 1234568),
    ("1,234.5*2", 2469.0),
    ("(1,000 + 2,000) / 3", 1000.0),
    # at the magnitude limit, not past it
    ("1000000000000000*1000000000000000", 10**30),
    ("-1000000000000000*1000000000000000", -(10**30)),
    # letter counting
    ('"strawberry".count("r")', 3),
    ("'strawberry'.count('r')", 3),
    ('"strawberry".count("z")', 0),
    ('"".count("a")', 0),
    ('"banana".count("an")', 2),
    ('"Mississippi".count("s")', 4),
    ('"a,b,c".count(",")', 2),
    ('"1,2".count(",")', 1),
    ('"abc".count("")', 4),
    ('"it\'s".count("\'")', 1),
    ('"""tri"ple""".count("t")', 1),
    ('"strawberry".count("r") + 1', 4),
    ('  "hello".count("l")  ', 2),
]

HOSTILE = [
    # code execution and introspection
    "__import__('os').system('ls')",
    "().__class__",
    '"a".__class__',
    "().__class__.__bases__[0].__subclasses__()",
    '"a".__class__.__mro__',
    "open('x')",
    "print(1)",
    "eval('1')",
    "exec('1')",
    "globals()",
    "import os",
    "lambda: 1",
    "(lambda: 1)()",
    "[x for x in range(10)]",
    "(x for x in range(10))",
    "{1: 2}",
    "{1, 2}",
    "[1,2][0]",
    "(1, 2)",
    "(1, 2)[0]",
    "x+1",
    "x",
    "True",
    "False+1",
    "None",
    "...",
    "1 if 1 else 2",
    "1 < 2",
    "1 and 2",
    "not 1",
    "~1",
    "(y := 1)",
    # operators outside the allow-list
    "2**10",
    "9**9**9",
    "7//2",
    "7%2",
    "1<<100",
    "6&3",
    "6|3",
    "6^3",
    "1@2",
    # strings used as anything but count
    '"a"*10**9',
    '"a"*3',
    '"a"+"b"',
    '"abc"',
    '"ab".upper()',
    '"ab".count(x)',
    '"ab".count(1)',
    '"ab".count("a", 1)',
    '"ab".count(sub="a")',
    '"ab".count(*"a")',
    '"ab".lower().count("a")',
    '"ab".count("a").bit_length()',
    '"ab".__len__()',
    'x.count("a")',
    'count("a")',
    '"ab"["a".count("a")]',
    'f"{1}".count("1")',
    "f\"{__import__('os')}\"",
    'b"ab".count(b"a")',
    '"ab".count(b"a")',
    "1j",
    "1+2j",
    # division by zero, non-finite and huge values
    "1/0",
    "1/(2-2)",
    "0/0",
    "1.0/0.0",
    "1e400",
    "-1e400",
    "1e308*10",
    "1e30*10",
    "1000000000000000*1000000000000001",
    "1" + "0" * 31,
    # malformed input
    "",
    "   ",
    "1+",
    "(1",
    "007",
    "1, 234",
    "1\x002",
    "1;2",
    "1\n2",
]

TOO_BIG = [
    "1+" * 500 + "1",  # past the 1000-character limit
    "1+" * 150 + "1",  # under it, but past the node and depth limits
    "(" * 500 + "1" + ")" * 500,
    "-" * 100 + "1",
    "-(" * 60 + "1" + ")" * 60,
    '"' + "a" * 999 + '"',
    '"' + "r" * 20_000 + '".count("r")',
]


@pytest.mark.parametrize(("expr", "expected"), ACCEPTED)
def test_accepted_expression_gives_exact_value_and_type(expr: str, expected: int | float) -> None:
    result = use_calculator(expr)
    assert result == expected
    assert type(result) is type(expected)


@pytest.mark.parametrize("expr", HOSTILE)
def test_refused_expression_gives_none(expr: str) -> None:
    assert use_calculator(expr) is None


@pytest.mark.parametrize("expr", TOO_BIG)
def test_oversized_or_deep_expression_gives_none(expr: str) -> None:
    assert use_calculator(expr) is None


def test_expression_at_length_limit_is_accepted_and_one_past_is_refused() -> None:
    at_limit = "1" + " " * (calculator.MAX_EXPR_CHARS - 3) + "+1"
    assert len(at_limit) == calculator.MAX_EXPR_CHARS
    assert use_calculator(at_limit) == 2
    assert use_calculator(at_limit + " ") is None


def test_depth_just_under_limit_is_accepted() -> None:
    assert use_calculator("-" * 40 + "1") == 1


def _balanced_sum(leaves: int) -> str:
    # A shallow tree with many nodes: ((1+1)+(1+1))+... has depth log2(leaves).
    if leaves == 1:
        return "1"
    half = leaves // 2
    return f"({_balanced_sum(half)}+{_balanced_sum(leaves - half)})"


def test_node_limit_refuses_shallow_but_wide_tree() -> None:
    assert use_calculator(_balanced_sum(32)) == 32  # 32 + 31 * 2 + 1 = 95 nodes
    wide = _balanced_sum(128)  # 128 + 127 * 2 + 1 = 383 nodes, depth 7
    assert len(wide) < calculator.MAX_EXPR_CHARS
    assert use_calculator(wide) is None


def test_string_literal_limit_holds_even_with_a_larger_expression_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(calculator, "MAX_EXPR_CHARS", 100_000)
    long_ok = '"' + "r" * calculator.MAX_STRING_CHARS + '".count("r")'
    assert use_calculator(long_ok) == calculator.MAX_STRING_CHARS
    too_long = '"' + "r" * (calculator.MAX_STRING_CHARS + 1) + '".count("r")'
    assert use_calculator(too_long) is None


@pytest.mark.parametrize(
    "expr",
    [
        "*".join(["999999999"] * 99),  # 891 digits if it were allowed to grow
        "*".join(["999999999"] * 5),  # few nodes, but past MAX_ABS_VALUE
        "*".join(["9" * 29] * 30),
        # the final value would fit, but the intermediate product does not
        "(" + "*".join(["999999"] * 6) + ")/1000000000000",
    ],
)
def test_huge_multiplication_chain_is_refused(expr: str) -> None:
    # No timeout is needed: node count and MAX_ABS_VALUE bound the work, so this just returns.
    assert use_calculator(expr) is None


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (69104, "69104"),
        (5.0, "5.0"),
        (2.5, "2.5"),
        (-150, "-150"),
        (3, "3"),
        (0.1 + 0.2, "0.30000000000000004"),
    ],
)
def test_format_result_is_python_str(value: int | float, text: str) -> None:
    assert format_result(value) == text


def test_accepted_results_round_trip_through_format_result() -> None:
    assert format_result(use_calculator("1,234 * 5")) == "6170"
    assert format_result(use_calculator("10/4")) == "2.5"
    assert format_result(use_calculator('"strawberry".count("r")')) == "3"


def test_module_never_calls_eval_exec_or_compile() -> None:
    source = Path(calculator.__file__).read_text(encoding="utf-8")
    assert not re.search(r"\b(eval|exec|compile)\s*\(", source)
    # The AST agrees with the grep: no call to any of those names, and no signals.
    tree = ast.parse(source)
    called = {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert not called & {"eval", "exec", "compile", "__import__"}
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert imported <= {"ast", "math"}


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        # what the training data writes for the arithmetic people ask
        ("6*7*7", 294),
        ("3+4*5", 23),  # "3 plus 4 times 5": the usual precedence
        ("(12+8)*3", 60),
        ("3*(4+5)", 27),
        ("(509*146)+(39+2134)", 76487),
        ("12-4-3", 5),  # left to right at one precedence
        ("100/10/5", 2.0),
        ("85-5/14", 85 - 5 / 14),
        ("-12.5+3.75", -8.75),
        ("5*(-3)", -15),
        ("5-(-3)", 8),
        ("-8/(-2)", 4.0),
        ("15*80/100", 12.0),  # 15% of 80
        ("7*33/100", 2.31),  # multiplying first keeps it exact
        ("804*(100+34)/100", 1077.36),  # 804 increased by 34%
        ("12*100/80", 15.0),  # what percent of 80 is 12
        ("(3+5+10)/3", 6.0),  # the average of 3, 5 and 10
    ],
)
def test_the_calculations_people_ask_follow_the_usual_rules(expr: str, expected: int | float):
    assert use_calculator(expr) == expected


@pytest.mark.parametrize(
    "expr",
    ["2^10", "2**10", "sqrt(144)", "math.sqrt(144)", "144**0.5", "10!", "sin(30)", "log(100)",
     "17%5", "7006652*tattoo", '7006652*"tattoo"'],
)  # fmt: skip
def test_powers_roots_functions_and_carried_words_stay_outside_the_grammar(expr: str):
    assert use_calculator(expr) is None
