"""The layers import only downward: the map in ARCHITECTURE.md, held by a test."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "chatcli"

# Lower ranks sit below higher ones; a module may import its own layer and any lower rank.
# Layers of the same rank (terminal, serve, training) are siblings and never import each other.
RANKS = {
    "errors": 0,
    "kernels": 1,
    "model": 2,
    "engine": 3,
    "chat": 4,
    "terminal": 5,
    "serve": 5,
    "training": 5,
    "bench": 6,
    "cli": 7,
}
TOP_LEVEL = {"__init__", "__main__"}


def layer_of(dotted: str) -> str | None:
    parts = dotted.split(".")
    if parts[0] != "chatcli" or len(parts) < 2:
        return None
    return parts[1]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "chatcli":
                found += [(node.lineno, f"chatcli.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def layered_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE or p.stem == "errors")


def test_every_module_lives_in_a_known_layer():
    strays = [
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.glob("*.py")
        if p.stem not in TOP_LEVEL and p.stem not in RANKS
    ]
    folders = [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()]
    assert strays == []
    assert sorted(set(folders) - set(RANKS)) == []


@pytest.mark.parametrize("path", layered_modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_a_module_imports_only_its_own_layer_or_lower_ones(path):
    own = path.stem if path.parent == PACKAGE else path.relative_to(PACKAGE).parts[0]
    wrong = []
    for line, module in imported_modules(path):
        other = layer_of(module)
        if other is None or other == own or other not in RANKS:
            continue
        if RANKS[other] >= RANKS[own]:
            wrong.append(f"line {line}: {module} ({other}) from the {own} layer")
    assert wrong == []


def test_the_layer_check_catches_an_upward_import(tmp_path):
    # The check itself must be able to fail: an engine module importing the terminal is caught.
    bad = tmp_path / "bad.py"
    bad.write_text("from chatcli.terminal.render import Renderer\nimport chatcli.serve.app\n")
    layers = [layer_of(m) for _, m in imported_modules(bad)]
    assert layers == ["terminal", "serve"]
    assert all(RANKS[layer] > RANKS["engine"] for layer in layers)


def test_the_public_names_stay_where_other_code_imports_them():
    import chatcli
    from chatcli.engine import Engine, GenerationStats, KVCache, RowState

    assert callable(chatcli.load_model)
    assert Engine.__module__ == "chatcli.engine.engine"
    assert KVCache.__module__ == "chatcli.model.kv_cache"
    assert {GenerationStats.__name__, RowState.__name__} == {"GenerationStats", "RowState"}
