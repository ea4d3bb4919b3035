"""Tests go through public seams: few reaches into another object's private attributes.

A test that sets `step._rows_model = None` to pick a path breaks when the attribute is
renamed and says nothing of what the code promises; a constructor argument or a documented
method says it once (`DecodeStep(model, kernel=False)`). The ones left are mostly other
libraries' (tiktoken's ranks, os._exit), which have no public seam to use.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MOST_PRIVATE_ACCESSES = 15


def private_accesses(source: str) -> list[tuple[int, str]]:
    """(line, `obj._name`) of each private attribute read or written on anything but self or
    cls: a name with one leading underscore, dunders aside."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_count_finds_reaches_into_other_objects_only():
    example = (
        "class A:\n"
        "    def f(self, other):\n"
        "        self._mine = other._theirs\n"  # other's
        "        cls = type(self)\n"
        "        return cls._shared, other.__class__, other.public\n"
        "step._rows_model = None\n"  # written
        "engine.decode_step._rows_model.packed\n"  # through a chain
        "module._helper(x)\n"  # a module's function
        "Class._method\n"  # a class's
    )
    assert [line for line, _ in private_accesses(example)] == [3, 6, 7, 8, 9]
    assert private_accesses(example)[2] == (7, "engine.decode_step._rows_model")


def test_tests_reach_into_few_private_attributes():
    found = [
        f"{path.name}:{line}: {text}"
        for path in sorted(TESTS.glob("*.py"))
        for line, text in private_accesses(path.read_text(encoding="utf-8"))
    ]
    assert len(found) <= MOST_PRIVATE_ACCESSES, "\n".join(found)
