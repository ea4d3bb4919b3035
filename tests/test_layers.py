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


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """The dotted name of a module file under root (a package's __init__ is the package)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """Every module `path` imports, wherever the import stands (a function's body, an
    `if TYPE_CHECKING:` block): absolute, relative (resolved against the module's package),
    and `from package import name` as both the package and package.name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    inside = module_name(path, root).split(".") if path.is_relative_to(root) else ["chatcli", "x"]
    package = inside if path.name == "__init__.py" else inside[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("chatcli"):
                found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
            found.append((node.lineno, module))
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
            continue
        if RANKS[other] >= RANKS[own]:
            wrong.append(f"line {line}: {module} ({other}) from the {own} layer")
    assert wrong == []


def test_the_layer_check_catches_an_upward_import(tmp_path):
    # The check itself must be able to fail: an engine module importing the terminal is caught.
    bad = tmp_path / "bad.py"
    bad.write_text("from chatcli.terminal.render import Renderer\nimport chatcli.serve.app\n")
    layers = sorted({layer_of(m) for _, m in imported_modules(bad)})
    assert layers == ["serve", "terminal"]
    assert all(RANKS[layer] > RANKS["engine"] for layer in layers)


def test_the_public_names_stay_where_other_code_imports_them():
    import chatcli
    from chatcli.engine import Engine, GenerationStats, KVCache, RowState

    assert callable(chatcli.load_model)
    assert Engine.__module__ == "chatcli.engine.engine"
    assert KVCache.__module__ == "chatcli.model.kv_cache"
    assert {GenerationStats.__name__, RowState.__name__} == {"GenerationStats", "RowState"}


# ---- no import circles ------------------------------------------------------------------------


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each chatcli module's chatcli imports (any import counts: at the top, in a function,
    under TYPE_CHECKING), as edges between module names."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        graph[name] = {m for _, m in imported_modules(path, root) if m in paths and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back_through_others():
    # Within a folder too: a circle means neither module can be read, tested or moved alone.
    assert circles(import_graph()) == []


def test_the_circle_check_finds_a_deferred_import_and_a_type_checking_one(tmp_path):
    root = tmp_path / "chatcli"
    (root / "engine").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "a.py").write_text("def f():\n    from chatcli.engine.b import g\n")
    (root / "engine" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n"
    )
    (root / "engine" / "c.py").write_text("from chatcli.engine import a\n")  # no circle
    assert circles(import_graph(root)) == [["chatcli.engine.a", "chatcli.engine.b"]]


# ---- where the third-party libraries may be imported -------------------------------------------

# ARCHITECTURE.md's "Imports": each library only in these places (paths under chatcli/).
PLACES = {
    "rich": ("terminal/",),
    "prompt_toolkit": ("terminal/",),
    "typer": ("cli/",),
    "click": ("cli/",),
    "fastapi": ("serve/",),
    "starlette": ("serve/",),
    "uvicorn": ("serve/",),
    "httpx": ("serve/",),
    "ray": ("serve/ray_",),
    "transformers": ("model/hf_", "model/hub"),
    "safetensors": ("model/hf_", "model/hub"),
    "huggingface_hub": ("model/hf_", "model/hub"),
    "tokenizers": ("model/hf_", "model/hub"),
}


@pytest.mark.parametrize("library", sorted(PLACES))
def test_a_third_party_library_is_imported_only_where_it_belongs(library):
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where.startswith(PLACES[library]):
            continue
        for line, module in imported_modules(path):
            if module.split(".")[0] == library:
                wrong.append(f"{where}:{line} imports {module}")
    assert wrong == []


def test_the_placement_check_sees_an_import_in_a_function_and_under_type_checking(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rich.console import C\n"
        "def f():\n    import typer\n"
    )
    assert {m.split(".")[0] for _, m in imported_modules(bad)} >= {"rich", "typer"}
