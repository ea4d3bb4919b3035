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
    {"type": "vote", "vote": {...}}       an arena vote on the turn before it (chat/arena.py
                                          reads it; replaying the messages skips it)

Every record is one line, flushed and fsync'd before the call returns, so a killed process
loses at most the record it was writing. Reading never fails on a damaged line, the header
included: it is skipped and reported in LoadResult.warnings. Messages use nanochat's format: content is a string, or
for the assistant a list of parts {"type": "text"|"python"|"python_output", "text": str}.

This module writes; the format's shared pieces are conversation_format.py's, reading a file
back conversation_reader.py's, finding saved conversations conversation_index.py's, exporting
one conversation_export.py's. It knows nothing about tokens, models or terminals.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from chatcli.chat.conversation_format import (
    FORMAT_VERSION,
    LATEST,
    NAME_MAX,
    SUFFIX,
    require_valid,
)
from chatcli.chat.conversation_reader import read_conversation
from chatcli.chat.turns import readable_text
from chatcli.errors import ConversationFileError


def sanitize_name(name: str) -> str:
    """A user-given name as a safe file stem: "my chat/1" -> "my-chat-1"."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", name.strip())
    # Leading dots would hide the file; leading dashes look like flags in a shell.
    stem = stem.lstrip(".-")[:NAME_MAX].rstrip(".-")
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
    if len(clean) > NAME_MAX:
        raise ConversationFileError(
            f"A conversation's name is at most {NAME_MAX} characters; this one has {len(clean)}."
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


class ConversationFileRemoved(ConversationFileError):
    """The conversation's file is gone (removed while the chat ran): nothing was written."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} was removed while this chat ran.")
        self.path = path


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
        require_valid(message)
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

    def append_vote(self, vote: dict[str, Any]) -> None:
        """Record an arena vote (chat/arena.py's record); the messages stay as they are."""
        self._append({"type": "vote", "vote": vote})

    def replace_last(self, message: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        """Record a new version of the last assistant message (/retry, /continue)."""
        require_valid(message)
        if message["role"] != "assistant":
            raise ValueError("replace_last() takes an assistant message")
        record: dict[str, Any] = {"type": "replace_last", "message": message}
        if meta:
            record["meta"] = meta
        self._append(record)

    def _append(self, record: dict[str, Any]) -> None:
        data = _encode(record)
        try:
            # Never O_CREAT: a file removed meanwhile must not come back as a headless fragment.
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            raise ConversationFileRemoved(self.path) from None
        except OSError as e:
            raise self._cannot_save(e) from None
        try:
            with os.fdopen(fd, "r+b") as f:
                # A process killed mid-write leaves a last line without its newline: start
                # on a fresh line so the new record stays readable on its own.
                size = f.seek(0, os.SEEK_END)
                if size > 0:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        data = b"\n" + data
                f.write(data)  # O_APPEND: always at the end, whatever the position
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise self._cannot_save(e) from None

    def _cannot_save(self, error: OSError) -> ConversationFileError:
        return ConversationFileError(
            f"Cannot save to {self.path} ({error}). Check free space and permissions, "
            "or set CHATCLI_CONVERSATIONS_DIR."
        )


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
            require_valid(message)  # a bad message leaves no file either
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

    def append_vote(self, vote: dict[str, Any]) -> None:
        if self.file is None:
            raise ValueError("append_vote() before the turn it votes on was saved")
        self.file.append_vote(vote)


def _encode(record: dict[str, Any]) -> bytes:
    # json.dumps escapes newlines inside strings, so one record is always one line.
    # readable_text: a lone surrogate (a byte that was not UTF-8) would fail the encoding,
    # and with it the save of a turn already shown.
    return (readable_text(json.dumps(record, ensure_ascii=False)) + "\n").encode("utf-8")
