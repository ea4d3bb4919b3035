"""The saved conversations in a folder: listing them (/history) and finding one by name.

Owns: ConversationSummary (one line of /history), list_conversations (newest first, an
unreadable file listed with its problem), latest_conversation (what --resume last picks) and
resolve_conversation (an id, a file name or a unique id prefix). The file format is
conversation_store.py's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from chatcli.chat.conversation_store import (
    LATEST,
    SUFFIX,
    read_conversation,
    sanitize_name,
    snippet,
)
from chatcli.errors import ConversationFileError


@dataclass(frozen=True)
class ConversationSummary:
    """One line of /history. `problem` is set (and messages is 0) for a file that cannot be read."""

    id: str
    path: Path
    modified: datetime
    messages: int
    preview: str
    problem: str | None = None


def _preview(messages: list[dict[str, Any]]) -> str:
    """The first question, shortened: what /history shows of a conversation."""
    return next((snippet(m) for m in messages if m["role"] == "user"), "")


def _conversation_files(directory: Path) -> list[Path]:
    """The *.jsonl files in `directory`, newest first (ties: by name, descending)."""
    if not directory.is_dir():
        return []
    files = [p for p in directory.glob("*" + SUFFIX) if p.is_file()]
    return sorted(files, key=lambda p: (p.stat().st_mtime, p.name), reverse=True)


def list_conversations(directory: Path) -> list[ConversationSummary]:
    """Every saved conversation, newest first. Unreadable files are listed with `problem` set."""
    summaries = []
    for path in _conversation_files(directory):
        modified = datetime.fromtimestamp(path.stat().st_mtime).astimezone()
        try:
            result = read_conversation(path)
        except ConversationFileError as e:
            summaries.append(ConversationSummary(path.stem, path, modified, 0, "", str(e)))
            continue
        count = sum(1 for m in result.messages if m["role"] != "system")
        summaries.append(
            ConversationSummary(path.stem, path, modified, count, _preview(result.messages))
        )
    return summaries


def latest_conversation(directory: Path) -> Path | None:
    """The newest conversation with at least one message (for --resume), or None.

    Files with no messages yet (a session left at once) and unreadable files are passed
    over, so they never shadow the conversation a person means to pick up.
    """
    for summary in list_conversations(directory):
        if summary.problem is None and summary.messages > 0:
            return summary.path
    return None


def resolve_conversation(directory: Path, name_or_id: str) -> Path:
    """Find a saved conversation by exact id, file name, or unique id prefix."""
    wanted = name_or_id.strip()
    as_path = Path(wanted).expanduser()
    if (os.sep in wanted or wanted.endswith(SUFFIX)) and as_path.is_file():
        return as_path
    stems = {p.stem: p for p in _conversation_files(directory)}
    # /save sanitised the name it was given, so "my chat" finds "my-chat".
    candidates = [wanted, sanitize_name(wanted)]
    for stem in candidates:
        if stem.endswith(SUFFIX):
            stem = stem[: -len(SUFFIX)]
        if stem in stems:
            return stems[stem]
    matches = sorted({s for s in stems for c in candidates if c and s.startswith(c)})
    if len(matches) == 1:
        return stems[matches[0]]
    if matches:
        shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise ConversationFileError(
            f"{name_or_id!r} matches {len(matches)} conversations ({shown}); type more of the id."
        )
    raise ConversationFileError(
        f"No conversation {name_or_id!r} in {directory}. /history (in a chat) lists the "
        f"saved ones; {LATEST!r} names the newest."
    )
