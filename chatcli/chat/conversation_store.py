"""Conversations on disk: one append-only JSONL file per conversation, written as it happens.

A file is a header line followed by events; replaying the events gives the messages:

    {"type": "header", "version": 1, "id": ..., "created": ..., "model": ...}
    {"type": "message", "message": {"role": ..., "content": ...}, "meta": {...}}
    {"type": "undo"}                      drop the last user message and the replies after it
    {"type": "clear"}                     drop every message but the system prompt (written
                                          by earlier versions' /clear, which now starts a file)
    {"type": "system", "text": str|null}  set (or remove) the system prompt
    {"type": "replace_last", "message": {...}, "meta": {...}}   /retry and /continue
    {"type": "name", "name": str}         /save NAME: what the conversation is called (the
                                          last one given counts; its id stays)

Every record is one line, flushed and fsync'd before the call returns, so a killed process
loses at most the record it was writing. Reading never fails on a damaged line, the header
included: it is skipped and reported in LoadResult.warnings. Messages use nanochat's format: content is a string, or
for the assistant a list of parts {"type": "text"|"python"|"python_output", "text": str}.

This module knows nothing about tokens, models or terminals; finding saved conversations is
conversation_index.py's, exporting one conversation_export.py's.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from chatcli.chat.turns import readable_text
from chatcli.errors import ConversationFileError
from chatcli.model.data_files import (
    UnreadableFileError,
    parse_json,
    read_bytes,
    shown,
)

FORMAT_VERSION = 1
SUFFIX = ".jsonl"
LATEST = "last"  # --resume last: the newest conversation, so no file may be named so
ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", "python", "python_output")
PREVIEW_CHARS = 60  # of a message, in /history and in warnings
_NAME_MAX = 80
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


def _require_valid(message: dict[str, Any]) -> None:
    # Our own code builds these messages, so a bad one is a bug, not a user error.
    problem = message_problem(message)
    if problem is not None:
        raise ValueError(f"invalid message: {problem}")


def sanitize_name(name: str) -> str:
    """A user-given name as a safe file stem: "my chat/1" -> "my-chat-1"."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", name.strip())
    # Leading dots would hide the file; leading dashes look like flags in a shell.
    stem = stem.lstrip(".-")[:_NAME_MAX].rstrip(".-")
    if stem.lower().endswith(SUFFIX):
        stem = stem[: -len(SUFFIX)]
    return stem


def clean_name(name: str) -> str:
    """A name for /save NAME as it is kept: one line, its spaces as one; ConversationFileError
    for one that is empty, too long, or `last` (which --resume reads as the newest)."""
    clean = " ".join(readable_text(name).split())
    if not clean or any(not c.isprintable() for c in clean):
        raise ConversationFileError(
            f"{name!r} cannot name a conversation: give it letters, digits or punctuation."
        )
    if len(clean) > _NAME_MAX:
        raise ConversationFileError(
            f"A conversation's name is at most {_NAME_MAX} characters; this one has {len(clean)}."
        )
    if clean.lower() == LATEST:
        raise ConversationFileError(
            f"{name!r} is taken: --resume {LATEST} opens the newest conversation. Pick another "
            "name."
        )
    return clean


def _timestamp_id(now: datetime) -> str:
    return f"{now:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def _fsync_directory(directory: Path) -> None:
    # Makes the new file's directory entry durable too; POSIX only (Windows cannot open dirs).
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems (FUSE, network mounts) cannot sync a directory; the file itself is
        # already synced, so only the entry's durability is lost there, not the data.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


class ConversationFile:
    """An open conversation file that events are appended to."""

    def __init__(self, path: Path, conversation_id: str) -> None:
        self.path = path
        self.id = conversation_id

    @classmethod
    def create(
        cls,
        directory: Path,
        name: str | None = None,
        *,
        model: object = None,
        now: datetime | None = None,
    ) -> ConversationFile:
        """Start a new file in `directory` and write its header.

        The id is `name` made safe for a file name, or a timestamp like 20261121-053200-ab12.
        `model` is any JSON value describing the loaded model (path, tag, step...).
        """
        now = now or datetime.now().astimezone()
        if name is not None:
            conversation_id = sanitize_name(name)
            if not conversation_id:
                raise ConversationFileError(
                    f"{name!r} cannot be used as a conversation name; "
                    "use letters, digits, '.', '_' or '-'."
                )
            if conversation_id.lower() == LATEST:
                raise ConversationFileError(
                    f"{name!r} is taken: --resume {LATEST} opens the newest conversation. "
                    "Pick another name."
                )
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConversationFileError(
                f"Cannot create the conversations directory {directory} ({e}). "
                "Fix its permissions or set CHATCLI_CONVERSATIONS_DIR."
            ) from None
        # Four random hex digits make a clash within one second unlikely; retry if it happens.
        for _ in range(10):
            if name is None:
                conversation_id = _timestamp_id(now)
            path = directory / (conversation_id + SUFFIX)
            header = {
                "type": "header",
                "version": FORMAT_VERSION,
                "id": conversation_id,
                "created": now.isoformat(timespec="seconds"),
                "model": model,
            }
            try:
                # "x": never overwrite an existing conversation.
                with path.open("xb") as f:
                    f.write(_encode(header))
                    f.flush()
                    os.fsync(f.fileno())
                _fsync_directory(directory)
            except FileExistsError:
                if name is not None:
                    raise ConversationFileError(
                        f"A conversation named {conversation_id!r} already exists in "
                        f"{directory}; pick another name, or /load it."
                    ) from None
                continue
            except OSError as e:
                raise ConversationFileError(
                    f"Cannot write {path} ({e}). Check free space and permissions, "
                    "or set CHATCLI_CONVERSATIONS_DIR."
                ) from None
            return cls(path, conversation_id)
        raise ConversationFileError(f"Could not pick a free conversation id in {directory}.")

    @classmethod
    def open(cls, path: Path) -> ConversationFile:
        """Reopen an existing file to append to it (after --resume or /load)."""
        read_conversation(path)  # a file that is not a conversation raises here
        # Its name, not the header's id: a copied or renamed file is resumed by its name.
        return cls(path, path.stem)

    def append_message(self, message: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        """Record a user or assistant message; `meta` holds e.g. finish_reason, seed, stats."""
        _require_valid(message)
        if message["role"] == "system":
            raise ValueError("set the system prompt with append_system(), not as a message")
        record: dict[str, Any] = {"type": "message", "message": message}
        if meta:
            record["meta"] = meta
        self._append(record)

    def append_undo(self) -> None:
        """Record /undo: the last user message and the reply after it are dropped."""
        self._append({"type": "undo"})

    def append_name(self, name: str) -> None:
        """Record what the conversation is called (/save NAME): clean_name's."""
        self._append({"type": "name", "name": clean_name(name)})

    def append_snapshot(
        self, messages: list[dict[str, Any]], finishes: list[str | None] | None = None
    ) -> None:
        """Record the whole conversation anew (a clear, the system prompt, each message with
        its finish_reason from `finishes`, LoadResult's): from here on the file replays to
        `messages`, whatever came before (a repaired load)."""
        self._append({"type": "clear"})
        self.append_all(messages, finishes)

    def append_all(
        self, messages: list[dict[str, Any]], finishes: list[str | None] | None = None
    ) -> None:
        """Record a conversation's system prompt and its messages, each with its
        finish_reason from `finishes` where known (so /continue knows a finished reply)."""
        system = next((m["content"] for m in messages if m["role"] == "system"), None)
        if system is not None:
            self.append_system(system)
        for message, reason in zip(messages, finishes or [None] * len(messages), strict=True):
            if message["role"] != "system":
                self.append_message(message, {"finish_reason": reason} if reason else None)

    def append_system(self, text: str | None) -> None:
        """Record a new system prompt, or its removal when `text` is None."""
        self._append({"type": "system", "text": text})

    def replace_last(self, message: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        """Record a new version of the last assistant message (/retry, /continue)."""
        _require_valid(message)
        if message["role"] != "assistant":
            raise ValueError("replace_last() takes an assistant message")
        record: dict[str, Any] = {"type": "replace_last", "message": message}
        if meta:
            record["meta"] = meta
        self._append(record)

    def _append(self, record: dict[str, Any]) -> None:
        data = _encode(record)
        try:
            with self.path.open("a+b") as f:
                # A process killed mid-write leaves a last line without its newline: start
                # on a fresh line so the new record stays readable on its own.
                size = f.seek(0, os.SEEK_END)
                if size > 0:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        data = b"\n" + data
                f.write(data)  # "a" mode: always at the end, whatever the position
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise ConversationFileError(
                f"Cannot save to {self.path} ({e}). Check free space and permissions, "
                "or set CHATCLI_CONVERSATIONS_DIR."
            ) from None


class ConversationSink(Protocol):
    """Where a chat records its events: an open ConversationFile, or a NewConversation
    that makes its file at the first message."""

    @property
    def id(self) -> str | None: ...

    @property
    def path(self) -> Path | None: ...

    def append_message(
        self, message: dict[str, Any], meta: dict[str, Any] | None = None
    ) -> None: ...

    def append_system(self, text: str | None) -> None: ...

    def append_undo(self) -> None: ...

    def append_name(self, name: str) -> None: ...

    def replace_last(self, message: dict[str, Any], meta: dict[str, Any] | None = None) -> None: ...


class NewConversation:
    """A conversation whose file does not exist yet: it is created (ConversationFile.create)
    at the first message, with the system prompt set before it. A session that says nothing
    leaves no empty file behind, and /clear starts another conversation without touching the
    one before it. Once created, every call goes to the file."""

    def __init__(self, directory: Path, *, model: object = None, system: str | None = None) -> None:
        self.directory = directory
        self.model = model
        self.system = system
        self.name: str | None = None  # /save NAME before the first message: written with it
        self.file: ConversationFile | None = None

    @property
    def id(self) -> str | None:
        return self.file.id if self.file else None

    @property
    def path(self) -> Path | None:
        return self.file.path if self.file else None

    def append_message(self, message: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        if self.file is None:
            _require_valid(message)  # a bad message leaves no file either
            created = ConversationFile.create(self.directory, model=self.model)
            if self.name:
                created.append_name(self.name)
            if self.system:
                created.append_system(self.system)
            self.file = created
        self.file.append_message(message, meta)

    def append_system(self, text: str | None) -> None:
        if self.file is None:
            self.system = text
        else:
            self.file.append_system(text)

    def append_undo(self) -> None:
        if self.file is not None:  # before the file, nothing was saved to undo
            self.file.append_undo()

    def append_name(self, name: str) -> None:
        if self.file is None:
            self.name = clean_name(name)
        else:
            self.file.append_name(name)

    def replace_last(self, message: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        if self.file is None:
            raise ValueError("replace_last() before any message was saved")
        self.file.replace_last(message, meta)


def _encode(record: dict[str, Any]) -> bytes:
    # json.dumps escapes newlines inside strings, so one record is always one line.
    # readable_text: a lone surrogate (a byte that was not UTF-8) would fail the encoding,
    # and with it the save of a turn already shown.
    return (readable_text(json.dumps(record, ensure_ascii=False)) + "\n").encode("utf-8")


def _set_system(messages: list[dict[str, Any]], text: str | None) -> None:
    if messages and messages[0]["role"] == "system":
        del messages[0]
    if text is not None:
        messages.insert(0, {"role": "system", "content": text})


def _apply(record: dict[str, Any], messages: list[dict[str, Any]]) -> str | None:
    """Apply one event to `messages`; returns why it was skipped, or None."""
    kind = record.get("type")
    if kind == "message" or kind == "replace_last":
        message = record.get("message")
        problem = message_problem(message)
        if problem is not None:
            return f"invalid message ({problem})"
        assert isinstance(message, dict)
        if kind == "message":
            if message["role"] == "system":
                _set_system(messages, message["content"])  # tolerated, written by hand
            else:
                messages.append(message)
            return None
        if message["role"] != "assistant":
            return "replace_last needs an assistant message"
        if messages and messages[-1]["role"] == "assistant":
            messages[-1] = message
        else:
            # The first reply was never saved (killed mid-turn): the replacement is the reply.
            messages.append(message)
        return None
    if kind == "undo":
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            return "undo with no user message to drop"
        del messages[users[-1] :]
        return None
    if kind == "clear":
        messages[:] = [m for m in messages[:1] if m["role"] == "system"]
        return None
    if kind == "system":
        text = record.get("text")
        if text is not None and not isinstance(text, str):
            return "system text must be a string or null"
        _set_system(messages, text)
        return None
    return f"unknown record type {kind!r}"


def _not_a_conversation(path: Path, why: str) -> ConversationFileError:
    return ConversationFileError(
        f"{path} is not a readable chatcli conversation ({why}). "
        "Pick another one with /history, or start a new conversation."
    )


def read_conversation(path: Path) -> LoadResult:
    """Replay a conversation file. Damaged lines are skipped and reported, never raised, the
    header line included (the messages after it are kept); only a missing file, one that
    cannot be opened, or one in which no line is a conversation's record raises
    ConversationFileError."""
    try:
        data = read_bytes(path)
    except UnreadableFileError as e:
        if e.missing:
            raise ConversationFileError(
                f"No conversation file at {path}. /history (in a chat) lists the saved "
                "conversations."
            ) from None
        raise _not_a_conversation(path, e.why) from None

    lines = data.split(b"\n")
    # A file that ends in "\n" splits into a last empty piece; anything else is a last line
    # cut off before its newline.
    last_is_cut = lines[-1] != b""
    if not last_is_cut:
        lines.pop()

    header: dict[str, Any] | None = None
    name: str | None = None
    first = next((n for n, line in enumerate(lines, start=1) if line.strip()), 0)
    no_header: str | None = None  # why, when the first line is no header
    messages: list[dict[str, Any]] = []
    skipped: list[str] = []  # "line N: why", one per line not applied
    # (message, finish_reason) of every record that had one; the list keeps the messages
    # alive, so their ids stay theirs until the end.
    finished: list[tuple[dict[str, Any], str]] = []
    recovered = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = parse_json(raw)  # not UTF-8, or too deep, is a ValueError there
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if number == first:
                no_header = f"line {number} is not JSON"
                skipped.append(f"line {number}: the header is damaged ({e}); skipped")
            elif last_is_cut and number == len(lines):
                skipped.append(
                    f"line {number}: incomplete last record skipped "
                    "(chatcli was probably stopped while saving)"
                )
            else:
                skipped.append(f"line {number}: unreadable record skipped ({e})")
            continue
        if number == first:
            if record.get("type") == "header":
                version = record.get("version")
                if not isinstance(version, int) or version > FORMAT_VERSION:
                    raise ConversationFileError(
                        f"{path} has format version {shown(version)}; this chatcli reads "
                        f"version {FORMAT_VERSION}. Upgrade chatcli to open it."
                    )
                header = record
                recovered += 1
                continue
            no_header = "the first line is not a header"
        if record.get("type") == "name":  # what the conversation is called: the last one
            if isinstance(record.get("name"), str) and record["name"].strip():
                name, recovered = " ".join(record["name"].split()), recovered + 1
            else:
                skipped.append(f"line {number}: a name must be a text; skipped")
            continue
        problem = _apply(record, messages)
        if problem is None:
            recovered += 1
            meta, message = record.get("meta"), record.get("message")
            if isinstance(meta, dict) and isinstance(meta.get("finish_reason"), str):
                finished.append((message, meta["finish_reason"]))
            if number == first:
                skipped.append(f"line {number}: a record where the header belongs; read on")
        elif number == first:
            skipped.append(f"line {number}: the header is damaged (not a header: {problem})")
        else:
            skipped.append(f"line {number}: {problem}; skipped")
    if header is None:
        if no_header is None:
            raise _not_a_conversation(path, "it is empty")
        if recovered == 0:  # not one record: some other file that ends in .jsonl
            raise _not_a_conversation(path, f"{no_header}, and no line is a record")
        header = {"type": "header", "version": FORMAT_VERSION, "id": path.stem}
    dropped: list[str] = []
    kept = _alternating(messages, dropped)
    finish_of = {id(message): reason for message, reason in finished}
    return LoadResult(
        kept,
        header,
        _summarized(skipped, "lines skipped, damaged or not a conversation's records")
        + _summarized(dropped, "messages dropped to keep questions and replies in turn"),
        recovered,
        repaired=bool(dropped),
        finishes=[finish_of.get(id(m)) for m in kept],
        name=name,
    )


def _summarized(warnings: list[str], what: str) -> list[str]:
    """The warnings, or past MAX_WARNINGS of them one line that counts them and gives the
    first: 400 stray records are one thing to tell, not 400."""
    if len(warnings) <= MAX_WARNINGS:
        return warnings
    return [f"{len(warnings)} {what}; the first: {warnings[0]}"]


def _alternating(messages: list[dict[str, Any]], warnings: list[str]) -> list[dict[str, Any]]:
    """The messages with user and assistant alternating, as nanochat's format and every
    server need: a damaged line can leave a reply without its question (dropped) or a
    question without its reply before the next one (the earlier dropped). Each drop adds a
    warning. The system prompt stays first; a last question without a reply stays (/retry
    answers it)."""
    head = [m for m in messages[:1] if m["role"] == "system"]
    kept: list[dict[str, Any]] = []
    for message in messages[len(head) :]:
        expected = "user" if not kept or kept[-1]["role"] == "assistant" else "assistant"
        if message["role"] == expected:
            kept.append(message)
        elif message["role"] == "assistant":
            warnings.append(f"a reply without its question dropped: {snippet(message)!r}")
        else:
            dropped = kept.pop()
            warnings.append(f"a question without its reply dropped: {snippet(dropped)!r}")
            kept.append(message)
    return head + kept


def snippet(message: dict[str, Any]) -> str:
    """A message's text on one line, shortened to PREVIEW_CHARS."""
    content = message["content"]
    if isinstance(content, list):  # an assistant's parts
        content = "".join(part["text"] for part in content)
    text = " ".join(str(content).split())
    return text[: PREVIEW_CHARS - 1] + "…" if len(text) > PREVIEW_CHARS else text
