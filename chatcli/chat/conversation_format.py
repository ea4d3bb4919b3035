"""The conversation file's format: its records, its limits, and what a valid message is.

Owns the format's constants (version, suffix, roles, part types), `LoadResult` (what reading a
file gives), `message_problem` (why a message is not one of nanochat's) and `snippet` (a
message shortened for a warning or a listing). The writer (conversation_store.py) and the
reader (conversation_reader.py) share them. Knows nothing about tokens, models or terminals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1
SUFFIX = ".jsonl"
LATEST = "last"  # --resume last: the newest conversation, so no file may be named so
ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", "python", "python_output")
PREVIEW_CHARS = 60  # of a message, in /history and in warnings
NAME_MAX = 80
MAX_WARNINGS = 5  # warnings of one kind listed one by one; more are summed up in one


@dataclass
class LoadResult:
    """A replayed conversation file.

    recovered_lines counts the lines read and applied (header included); every line that was
    skipped instead has one entry in warnings, naming its line number. A message dropped to
    keep questions and replies in turn (after a damaged line) has one too, and sets repaired:
    the file's records no longer replay to these messages, so whoever appends to it should
    first write them out again (ConversationFile.append_snapshot). Past MAX_WARNINGS lines
    (or messages), one entry counts them and names the first.
    """

    messages: list[dict[str, Any]]
    header: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    recovered_lines: int = 0
    repaired: bool = False
    # Each message's finish_reason as its record's meta gave it (a reply's: stop, length,
    # interrupted...), else None: whether a resumed reply can be continued.
    finishes: list[str | None] = field(default_factory=list)
    name: str | None = None  # what /save NAME called it


def message_problem(message: object) -> str | None:
    """Why `message` is not a valid nanochat message, or None when it is."""
    if not isinstance(message, dict):
        return "a message must be a JSON object"
    role = message.get("role")
    if role not in ROLES:
        return f"role must be one of {', '.join(ROLES)}, got {role!r}"
    content = message.get("content")
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return "content must be a string or a list of parts"
    if role != "assistant":
        return f"only assistant messages have a list of parts, not {role} messages"
    for part in content:
        if not (
            isinstance(part, dict)
            and part.get("type") in PART_TYPES
            and isinstance(part.get("text"), str)
        ):
            return f"each part must be {{'type': {'|'.join(PART_TYPES)}, 'text': str}}"
    return None


def require_valid(message: dict[str, Any]) -> None:
    # Our own code builds these messages, so a bad one is a bug, not a user error.
    problem = message_problem(message)
    if problem is not None:
        raise ValueError(f"invalid message: {problem}")


def snippet(message: dict[str, Any]) -> str:
    """A message's text on one line, shortened to PREVIEW_CHARS."""
    content = message["content"]
    if isinstance(content, list):  # an assistant's parts
        content = "".join(part["text"] for part in content)
    text = " ".join(str(content).split())
    return text[: PREVIEW_CHARS - 1] + "…" if len(text) > PREVIEW_CHARS else text
