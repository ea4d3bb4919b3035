"""The saved conversations of a folder: listing them, finding one by id, name or id prefix,
and checking that a name is free.

Each conversation is one file (chatcli.chat.conversation_store); its id is the file's name
without .jsonl, and its name, where /save gave it one, a record inside the file. A listing
reads every file: fine for the hundreds a person keeps.

Knows nothing about tokens, models or terminals.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from chatcli.chat.conversation_format import LATEST, SUFFIX, snippet
from chatcli.chat.conversation_reader import read_conversation
from chatcli.chat.conversation_store import sanitize_name
from chatcli.chat.user_dirs import ENV_CONVERSATIONS_DIR
from chatcli.errors import ConversationFileError
from chatcli.model.data_files import UnreadableFileError, described, list_folder


@dataclass(frozen=True)
class ConversationSummary:
    """One line of a listing. `problem` is set (and messages is 0) for a file that cannot be
    read. turns: the questions asked; created: the header's time, None where it has none."""

    id: str
    path: Path
    modified: datetime
    messages: int
    preview: str
    problem: str | None = None
    name: str | None = None
    turns: int = 0
    created: datetime | None = None


def _conversation_files(directory: Path) -> list[Path]:
    """The *.jsonl files in `directory`, newest first (ties: by name, descending); none when
    the folder is not there yet. A file, a link loop or a folder that cannot be listed where
    the folder belongs is a ConversationFileError that says so: it would look empty else."""
    try:
        entries = list_folder(directory)
    except UnreadableFileError as e:  # glob would make a folder without permission look empty
        if e.missing:
            return []  # no conversation saved yet: the first chat creates the folder
        raise ConversationFileError(
            f"The conversations folder {e}. Point {ENV_CONVERSATIONS_DIR} (or CHATCLI_HOME) "
            "at a folder you may read, or fix this one."
        ) from None
    try:
        files = [
            p for p in entries if p.suffix == SUFFIX and not p.name.startswith(".") and p.is_file()
        ]
        return sorted(files, key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
    except OSError as e:
        raise ConversationFileError(f"The conversations folder: {described(e)}.") from None


def _created(value: object) -> datetime | None:
    try:
        return datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None


def summarize(path: Path) -> ConversationSummary:
    """One conversation file as a listing shows it; never raises for a bad file."""
    modified = datetime.fromtimestamp(path.stat().st_mtime).astimezone()
    try:
        result = read_conversation(path)
    except ConversationFileError as e:
        return ConversationSummary(path.stem, path, modified, 0, "", str(e))
    rest = [m for m in result.messages if m["role"] != "system"]
    return ConversationSummary(
        path.stem,
        path,
        modified,
        len(rest),
        next((snippet(m) for m in rest if m["role"] == "user"), ""),
        name=result.name,
        turns=sum(1 for m in rest if m["role"] == "user"),
        created=_created(result.header.get("created")),
    )


def list_conversations(directory: Path) -> list[ConversationSummary]:
    """Every saved conversation, newest first. Unreadable files are listed with `problem` set."""
    return [summarize(path) for path in _conversation_files(directory)]


def latest_conversation(directory: Path) -> Path | None:
    """The newest conversation with at least one message (for --resume), or None.

    Files with no messages yet (a session left at once) and unreadable files are passed
    over, so they never shadow the conversation a person means to pick up.
    """
    for summary in list_conversations(directory):
        if summary.problem is None and summary.messages > 0:
            return summary.path
    return None


def _same_name(a: str, b: str) -> bool:
    return " ".join(a.split()).casefold() == " ".join(b.split()).casefold()


def named(directory: Path, name: str) -> list[ConversationSummary]:
    """The conversations whose name is `name` (in any case, spaces as one)."""
    return [
        s for s in list_conversations(directory) if s.name is not None and _same_name(s.name, name)
    ]


def check_name_free(directory: Path, name: str, mine: Path | None = None) -> None:
    """Raise ConversationFileError when another conversation than `mine` already answers to
    `name`, by its name or its id: --resume NAME must find one."""
    stem = sanitize_name(name)
    for s in list_conversations(directory):
        if s.path == mine:
            continue
        if (s.name is not None and _same_name(s.name, name)) or s.id in (name, stem):
            raise ConversationFileError(
                f"A conversation is called {name!r} already ({s.id}); pick another name, "
                "or /load it."
            )


def resolve_conversation(directory: Path, name_or_id: str) -> Path:
    """Find a saved conversation by its path, its id (the file's name), its name, or a
    unique prefix of its id, in that order."""
    wanted = name_or_id.strip()
    as_path = Path(wanted).expanduser()
    if (os.sep in wanted or wanted.endswith(SUFFIX)) and as_path.is_file():
        return as_path
    return _resolve_in(directory, name_or_id)


def saved_conversation(directory: Path, name_or_id: str, *, prefix: bool = True) -> Path:
    """The saved conversation `name_or_id` names (an id, a name, a unique id prefix unless
    `prefix` is off, or `last`), found inside `directory` only and read as a conversation before it is returned:
    what may be deleted or exported. A path (./notes.txt, ../x.jsonl), or a file of the
    folder that is no conversation, is a ConversationFileError; nothing outside the folder,
    the working directory included, is ever looked at."""
    wanted = name_or_id.strip()
    if any(sep in wanted for sep in {"/", os.sep, os.altsep} - {None}) or wanted in (".", ".."):
        raise ConversationFileError(
            f"{name_or_id!r} is a path; this takes a saved conversation's id, name or "
            f"{LATEST!r}, found in {directory} only. chatcli conversations lists them."
        )
    if wanted.lower() == LATEST:
        path = latest_conversation(directory)
        if path is None:
            raise ConversationFileError(f"No saved conversation in {directory}.")
    else:
        path = _resolve_in(directory, wanted, prefix=prefix)
    read_conversation(path)  # a .jsonl of the folder that is not a conversation raises here
    return path


def _resolve_in(directory: Path, name_or_id: str, *, prefix: bool = True) -> Path:
    """A conversation of `directory` by its id, its name, or (where `prefix`) a unique
    prefix of its id."""
    wanted = name_or_id.strip()
    stems = {p.stem: p for p in _conversation_files(directory)}
    if wanted.removesuffix(SUFFIX) in stems:
        return stems[wanted.removesuffix(SUFFIX)]
    by_name = named(directory, wanted) if wanted else []
    if len(by_name) == 1:
        return by_name[0].path
    if by_name:
        ids = ", ".join(s.id for s in by_name)
        raise ConversationFileError(
            f"{len(by_name)} conversations are called {wanted!r} ({ids}); give the id."
        )
    # An earlier /save NAME wrote NAME's file, its name made safe: "my chat" finds "my-chat".
    candidates = [wanted, sanitize_name(wanted)]
    for stem in candidates[1:]:
        if stem in stems:
            return stems[stem]
    matches = sorted({s for s in stems for c in candidates if c and s.startswith(c)})
    if matches and not prefix:  # what deletes takes no guess: `rm 2026` is not the only 2026...
        shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise ConversationFileError(
            f"No conversation is called {name_or_id!r}; this takes a whole id or name "
            f"(ids that start so: {shown})."
        )
    if len(matches) == 1:
        return stems[matches[0]]
    if matches:
        shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise ConversationFileError(
            f"{name_or_id!r} matches {len(matches)} conversations ({shown}); type more of the id."
        )
    raise ConversationFileError(
        f"No conversation {name_or_id!r} in {directory}. /history in a chat, or chatcli "
        f"conversations, lists the saved ones; {LATEST!r} names the newest."
    )
