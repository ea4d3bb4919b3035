"""The calculator tool: evaluate what a model wrote between <|python_start|> and <|python_end|>.

This module owns which expressions are allowed, how they are evaluated and how a result is
written back as text. It knows nothing about tokens, the engine or the model: it takes a string
and gives back a number or None.

nanochat's original calculator filtered characters and then called `eval` under a SIGALRM
timeout. Here nothing is ever executed: the expression is parsed with `ast.parse` and a small
interpreter walks the tree against an allow-list. Size, depth and magnitude limits are checked
as it goes, so evaluation is bounded in time and memory by construction, needs no signals and
is safe from any thread on any OS.

Accepted: int and decimal literals, + - * / (true division), unary + and -, parentheses, commas
inside numbers ("1,234"), and letter counting on a string literal (`"strawberry".count("r")`).
Everything else is refused with None.
"""

from __future__ import annotations

import ast
import math

MAX_EXPR_CHARS = 1000
MAX_STRING_CHARS = 10_000
MAX_NODES = 200
MAX_DEPTH = 50
# Any value, intermediate or final, past this is refused: it keeps every int product small
# (so `9*9*9*...` cannot build a million-digit number) and no sensible answer is that big.
MAX_ABS_VALUE = 10**30

_BINARY_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_UNARY_OPS = (ast.UAdd, ast.USub)


class _Refused(Exception):
    """Raised inside the walk when an expression is outside the allow-list or its limits."""


def use_calculator(expr: str) -> int | float | None:
    """Evaluate `expr` as calculator arithmetic; None when it is refused or fails.

    Ints stay ints (`1234*56` -> 69104) and `/` is true division (`10/2` -> 5.0), as in Python.
    """
    if len(expr) > MAX_EXPR_CHARS:
        return None
    source = _strip_number_commas(expr).strip()
    try:
        tree = ast.parse(source, mode="eval")
        # ast.walk is iterative, so counting cannot recurse however deep the tree is.
        if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
            return None
        return _evaluate(tree.body, depth=0)
    # A refusal is the answer, not an error: the engine injects nothing and generation goes on.
    # The parser itself raises the rest on malformed, null-byte, too-deep or oversized input.
    except (_Refused, SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        return None


def format_result(value: int | float) -> str:
    """The exact text the engine injects between <|output_start|> and <|output_end|>."""
    return str(value)


def _strip_number_commas(expr: str) -> str:
    """Drop commas between two digits outside string literals: "1,234" -> "1234".

    Unstripped, "1,234 * 5" would parse as the tuple (1, 1170) and be refused; a comma inside
    a quoted string ("a,b".count(",")) is text and must stay.
    """
    out = []
    quote = ""  # the delimiter of the string literal we are inside: ', ", ''' or """; "" if none
    i = 0
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                out.append(expr[i : i + 2])  # keep an escape whole so \" does not end the string
                i += 2
                continue
            if expr.startswith(quote, i):
                out.append(quote)
                i += len(quote)
                quote = ""
                continue
        elif c in "'\"":
            quote = c * 3 if expr.startswith(c * 3, i) else c
            out.append(quote)
            i += len(quote)
            continue
        elif c == "," and 0 < i < len(expr) - 1 and expr[i - 1].isdigit() and expr[i + 1].isdigit():
            i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _evaluate(node: ast.expr, depth: int) -> int | float:
    """Evaluate one allowed numeric node; raise _Refused for anything else."""
    if depth > MAX_DEPTH:
        raise _Refused("expression nested too deeply")
    if isinstance(node, ast.Constant):
        # `type(...) is` rather than isinstance: bool is a subclass of int and is refused.
        if type(node.value) not in (int, float):
            raise _Refused("only int and float literals are numbers")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, _UNARY_OPS):
        operand = _evaluate(node.operand, depth + 1)
        return _checked(-operand if isinstance(node.op, ast.USub) else +operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY_OPS):
        left = _evaluate(node.left, depth + 1)
        right = _evaluate(node.right, depth + 1)
        return _checked(_apply(node.op, left, right))
    if isinstance(node, ast.Call):
        return _count(node)
    raise _Refused(f"{type(node).__name__} is not allowed")


def _apply(op: ast.operator, left: int | float, right: int | float) -> int | float:
    if isinstance(op, ast.Add):
        return left + right
    if isinstance(op, ast.Sub):
        return left - right
    if isinstance(op, ast.Mult):
        return left * right
    if right == 0:
        raise _Refused("division by zero")
    return left / right


def _count(call: ast.Call) -> int:
    """`"strawberry".count("r")`: a string literal, the method count, one string literal."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "count"):
        raise _Refused("the only call allowed is <string literal>.count(<string literal>)")
    if call.keywords or len(call.args) != 1:
        raise _Refused("count takes exactly one positional argument")
    haystack = _string_literal(func.value)
    needle = _string_literal(call.args[0])
    return haystack.count(needle)


def _string_literal(node: ast.expr) -> str:
    # A plain Constant only: f-strings are JoinedStr nodes and bytes fail the type check.
    if not (isinstance(node, ast.Constant) and type(node.value) is str):
        raise _Refused("count needs string literals")
    if len(node.value) > MAX_STRING_CHARS:
        raise _Refused("string literal too long")
    return node.value


def _checked(value: int | float) -> int | float:
    """Refuse NaN, infinities and anything past MAX_ABS_VALUE."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _Refused("result is not a finite number")
    if abs(value) > MAX_ABS_VALUE:
        raise _Refused("result too large")
    return value
