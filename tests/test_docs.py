"""The documentation holds together: every relative link resolves, to a file and to a heading
where it names one; the README stays a short front door with the set-up commands CI follows;
and the Python API page shows every parameter of the functions it documents."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300

# [text](target) or [text](target "title"); images (![alt](src)) are links too.
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~)")
_CODE_SPAN = re.compile(r"(`+).*?\1")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked out: a link or a
    heading shown as code is not one."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else _CODE_SPAN.sub("", line))
    return lines


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped (code marks
    included), spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match is None:
            continue
        base = slug(match[2])
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link in `path` whose file, or whose anchor in that file, is missing,
    named by its place under `root`."""
    broken = []
    for number, line in enumerate(prose_lines(path.read_text(encoding="utf-8")), start=1):
        for target in _LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # https:, mailto: and the like: not ours to check
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not linked.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{where} (no such heading)")
    return broken


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The `chatcli bench` flags\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md) [ok](other.md#the-chatcli-bench-flags) [ok](#page) "
        "[web](https://example.com/nowhere.md)\n\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere)\n\n"
        "`[in code](missing-too.md)`\n\n"
        "```\n[in a block](missing-three.md)\n```\n"
    )
    assert broken_links(page, root=tmp_path) == [
        "page.md:5: missing.md (no such file)",
        "page.md:5: other.md#nowhere (no such heading)",
    ]


def test_a_repeated_heading_gets_a_numbered_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A\n\n## Usage\n\n## Usage\n\n```\n# not a heading\n```\n")
    assert anchors(page) == {"a", "usage", "usage-1"}


def test_the_readme_is_a_short_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES


def test_the_readme_keeps_the_set_up_commands_ci_follows():
    # .ci/run installs and tests as these two lines do; change them together.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert (
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
        "pip install -e . && chatcli chat\n" in readme
    )
    assert '. .venv/bin/activate && pip install -e ".[dev]" && python -m pytest\n' in readme


def test_the_python_api_page_gives_every_parameter_of_load_model_and_engine_generate():
    from chatcli.engine import Engine
    from chatcli.model.checkpoint import load_model

    page = (ROOT / "docs" / "python-api.md").read_text(encoding="utf-8")
    for shown_as, function in (
        ("# load_model(", load_model),
        ("`Engine.generate(", Engine.generate),
    ):
        start = page.index(shown_as)
        shown = set(re.findall(r"\w+", page[start : page.index(")", start)]))
        missing = set(inspect.signature(function).parameters) - {"self"} - shown
        assert not missing, (shown_as, missing)
