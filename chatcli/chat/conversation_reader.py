"""Reading a conversation file back: every record replayed, damage skipped and said.

Owns `read_conversation`: a damaged line (the header included) loses only that line; records
are replayed in order onto the messages (replace_last, system, name); questions and replies
are kept in turn; warnings of one kind past a few are summed up in one line. Knows nothing
about writing files (conversation_store.py) or about tokens, models and terminals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chatcli.chat.conversation_format import (
    FORMAT_VERSION,
    MAX_WARNINGS,
    LoadResult,
    message_problem,
    snippet,
)
from chatcli.errors import ConversationFileError
from chatcli.model.data_files import (
    UnreadableFileError,
    parse_json,
    read_bytes,
    shown,
)

# A long chat is a few megabytes; past this a .jsonl in the folder is something else (a log,
# a sparse file), which a listing would otherwise read whole into memory.
CONVERSATION_MAX_BYTES = 256 << 20


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
    if kind == "vote":  # an arena vote: chat/arena.py's, no change to the messages
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
        data = read_bytes(path, CONVERSATION_MAX_BYTES)
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
