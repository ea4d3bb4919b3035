"""A conversation exported for reading elsewhere: Markdown, or nanochat's JSON (/export).

Owns how each message reads in Markdown (calculator calls as `calc EXPR -> RESULT` code
spans) and the JSON form, and writing an export where nothing is yet (`write_export`: a file
there already is replaced only when asked). Knows nothing about the terminal or commands.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from chatcli.errors import ChatcliError


def _code_span(text: str) -> str:
    # A Markdown code span needs a backtick fence longer than any run of backticks inside.
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _assistant_markdown(content: str | list[dict[str, str]]) -> str:
    if isinstance(content, str):
        return content
    out: list[str] = []
    pending_call: str | None = None
    after_call = False  # the last thing written is a call's code span

    def call(expression: str, result: str) -> None:
        nonlocal after_call
        out.append(_code_span(f"calc {expression} -> {result}"))
        after_call = True

    for part in content:
        kind, text = part["type"], part["text"]
        if kind == "python_output":
            call(pending_call if pending_call is not None else "?", text.strip())
            pending_call = None
            continue
        if pending_call is not None:
            call(pending_call, "(no result)")
            pending_call = None
        if kind == "python":
            pending_call = text.strip()
        else:
            if after_call and text[:1].isalnum():
                out.append(" ")  # the model writes on straight after a call's result
            out.append(text)
            after_call = False
    if pending_call is not None:
        call(pending_call, "(no result)")
    return "".join(out)


def export_markdown(messages: list[dict[str, Any]]) -> str:
    """The conversation as readable Markdown, calculator calls as `calc EXPR -> RESULT`."""
    sections = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            sections.append(f"**System:**\n\n{content}")
        elif role == "user":
            sections.append(f"**You:**\n\n{content}")
        else:
            sections.append(f"**Assistant:**\n\n{_assistant_markdown(content)}")
    return "\n\n".join(sections) + "\n" if sections else ""


def export_json(messages: list[dict[str, Any]]) -> str:
    """The conversation as nanochat's JSON: {"messages": [...]}, indented."""
    return json.dumps({"messages": messages}, ensure_ascii=False, indent=2) + "\n"


def write_export(text: str, path: Path, force: bool, how_to_force: str) -> None:
    """Write `text` to `path`, a new file; one there already (or a link, even to nothing) is
    a ChatcliError unless `force`. `how_to_force` completes the refusal ("add --force")."""
    try:
        # "x": the check and the creation are one step, so no file appears in between.
        with path.open("w" if force else "x", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        if os.path.isdir(path):  # never raises, unlike Path.is_dir on a folder without access
            raise ChatcliError(f"{path} is a folder; give the path of a file to write.") from None
        if isinstance(e, FileExistsError):
            raise ChatcliError(
                f"{path} exists already; it is left as it was. Pick another path, or "
                f"{how_to_force} to replace it."
            ) from None
        raise ChatcliError(f"Cannot write {path} ({e}). Pick another path.") from None
