from __future__ import annotations

import json
import os
import random
import re
from datetime import datetime, timezone
from pathlib import Path

import pytest

from chatcli.chat.conversation_export import export_json, export_markdown
from chatcli.chat.conversation_index import (
    latest_conversation,
    list_conversations,
    resolve_conversation,
)
from chatcli.chat.conversation_store import (
    SUFFIX,
    ConversationFile,
    NewConversation,
    read_conversation,
    sanitize_name,
)
from chatcli.errors import ConversationFileError

MODEL = {"path": "/ckpt/d20", "step": 650}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(content: object) -> dict:
    return {"role": "assistant", "content": content}


def new_file(tmp_path: Path, name: str | None = None) -> ConversationFile:
    return ConversationFile.create(tmp_path, name, model=MODEL)


def set_mtime(path: Path, seconds: float) -> None:
    os.utime(path, (seconds, seconds))


def test_create_writes_a_header_line(tmp_path: Path) -> None:
    now = datetime(2026, 11, 21, 5, 32, 0, tzinfo=timezone.utc)
    conv = ConversationFile.create(tmp_path / "convs", model=MODEL, now=now)
    assert re.fullmatch(r"20261121-053200-[0-9a-f]{4}", conv.id)
    assert conv.path == tmp_path / "convs" / f"{conv.id}.jsonl"
    lines = conv.path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == {
        "type": "header",
        "version": 1,
        "id": conv.id,
        "created": "2026-11-21T05:32:00+00:00",
        "model": MODEL,
    }


def test_create_with_name_sanitises_it(tmp_path: Path) -> None:
    conv = new_file(tmp_path, "my chat/about ../secrets")
    assert conv.id == "my-chat-about-..-secrets"
    assert conv.path.parent == tmp_path


def test_create_with_taken_name_is_an_error(tmp_path: Path) -> None:
    new_file(tmp_path, "ideas")
    with pytest.raises(ConversationFileError, match="already exists"):
        new_file(tmp_path, "ideas")


def test_create_with_unusable_name_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConversationFileError, match="cannot be used"):
        new_file(tmp_path, "///")


@pytest.mark.parametrize(
    ("name", "stem"),
    [
        ("plain", "plain"),
        ("with space", "with-space"),
        (".hidden", "hidden"),
        ("-flag", "flag"),
        ("notes.jsonl", "notes"),
        ("é ü", ""),
        ("a" * 200, "a" * 80),
    ],
)
def test_sanitize_name(name: str, stem: str) -> None:
    assert sanitize_name(name) == stem


def test_round_trip(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    conv.append_system("Be brief.")
    conv.append_message(user("What is 12*7?"))
    reply = assistant(
        [
            {"type": "text", "text": "Let me compute. "},
            {"type": "python", "text": "12*7"},
            {"type": "python_output", "text": "84"},
            {"type": "text", "text": "It is 84. ünïcödé ✓\nsecond line"},
        ]
    )
    conv.append_message(reply, meta={"finish_reason": "stop", "seed": 3})
    conv.append_message(user("thanks"))
    conv.append_message(assistant("You're welcome."))

    result = read_conversation(conv.path)
    assert result.messages == [
        {"role": "system", "content": "Be brief."},
        user("What is 12*7?"),
        reply,
        user("thanks"),
        assistant("You're welcome."),
    ]
    assert result.header["model"] == MODEL
    assert result.header["id"] == conv.id
    assert result.warnings == []
    assert result.recovered_lines == 6
    # One record per line, each ending in a newline.
    assert conv.path.read_bytes().count(b"\n") == 6
    meta_line = json.loads(conv.path.read_text(encoding="utf-8").splitlines()[3])
    assert meta_line["meta"] == {"finish_reason": "stop", "seed": 3}


def test_open_appends_to_an_existing_file(tmp_path: Path) -> None:
    first = new_file(tmp_path)
    first.append_message(user("one"))
    again = ConversationFile.open(first.path)
    assert again.id == first.id
    again.append_message(assistant("two"))
    assert read_conversation(first.path).messages == [user("one"), assistant("two")]


def test_undo_drops_the_last_exchange(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    conv.append_system("sys")
    for i in range(2):
        conv.append_message(user(f"q{i}"))
        conv.append_message(assistant(f"a{i}"))
    conv.append_undo()
    assert read_conversation(conv.path).messages == [
        {"role": "system", "content": "sys"},
        user("q0"),
        assistant("a0"),
    ]
    conv.append_undo()
    assert read_conversation(conv.path).messages == [{"role": "system", "content": "sys"}]


def test_undo_of_a_question_without_reply_drops_the_question(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    conv.append_message(user("q0"))
    conv.append_message(assistant("a0"))
    conv.append_message(user("q1"))
    conv.append_undo()
    assert read_conversation(conv.path).messages == [user("q0"), assistant("a0")]


def test_undo_with_nothing_to_undo_is_a_warning(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    conv.append_undo()
    result = read_conversation(conv.path)
    assert result.messages == []
    assert result.warnings == ["line 2: undo with no user message to drop; skipped"]


def test_a_clear_record_keeps_the_system_prompt(tmp_path: Path) -> None:
    # Earlier versions' /clear wrote this record; /clear now starts a new file.
    conv = new_file(tmp_path)
    conv.append_system("sys")
    conv.append_message(user("q"))
    conv.append_message(assistant("a"))
    with conv.path.open("a", encoding="utf-8") as f:
        f.write('{"type": "clear"}\n')
    conv.append_message(user("fresh"))
    assert read_conversation(conv.path).messages == [
        {"role": "system", "content": "sys"},
        user("fresh"),
    ]


def test_system_replaces_and_removes_the_system_prompt(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    conv.append_message(user("q"))
    conv.append_system("first")
    conv.append_system("second")
    assert read_conversation(conv.path).messages == [
        {"role": "system", "content": "second"},
        user("q"),
    ]
    conv.append_system(None)
    assert read_conversation(conv.path).messages == [user("q")]


def test_replace_last_replaces_the_assistant_reply(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    conv.append_message(user("q"))
    conv.append_message(assistant("partial"), meta={"finish_reason": "interrupted"})
    conv.replace_last(assistant("partial and finished"), meta={"finish_reason": "stop"})
    conv.replace_last(assistant("a retry"))
    assert read_conversation(conv.path).messages == [user("q"), assistant("a retry")]


def test_replace_last_after_a_lost_reply_appends(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    conv.append_message(user("q"))
    conv.replace_last(assistant("a"))
    assert read_conversation(conv.path).messages == [user("q"), assistant("a")]


@pytest.mark.parametrize(
    "message",
    [
        {"role": "robot", "content": "x"},
        {"role": "user", "content": 5},
        {"role": "user", "content": [{"type": "text", "text": "x"}]},
        assistant([{"type": "image", "text": "x"}]),
        assistant([{"type": "text"}]),
        {"content": "x"},
    ],
)
def test_invalid_messages_are_refused_when_writing(tmp_path: Path, message: dict) -> None:
    conv = new_file(tmp_path)
    with pytest.raises(ValueError, match="invalid message"):
        conv.append_message(message)


def test_system_messages_go_through_append_system(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    with pytest.raises(ValueError, match="append_system"):
        conv.append_message({"role": "system", "content": "x"})
    with pytest.raises(ValueError, match="assistant"):
        conv.replace_last(user("x"))


def cut_last_record(path: Path, rng: random.Random) -> int:
    """Truncate the file at a random byte inside its last record, as a kill mid-write would."""
    data = path.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    # Keep at least one byte of the record and drop at least its newline.
    cut = rng.randrange(start + 1, len(data) - 1)
    path.write_bytes(data[:cut])
    return cut


@pytest.mark.parametrize("seed", range(8))
def test_kill_mid_write_loses_only_the_record_in_flight(tmp_path: Path, seed: int) -> None:
    conv = new_file(tmp_path)
    conv.append_message(user("q0"))
    conv.append_message(assistant("a0 with ünïcödé so a cut can land inside a character"))
    conv.append_message(user("q1"))
    conv.append_message(assistant("a1, which was being written when the process died"))
    cut_last_record(conv.path, random.Random(seed))

    result = read_conversation(conv.path)
    assert result.messages == [
        user("q0"),
        assistant("a0 with ünïcödé so a cut can land inside a character"),
        user("q1"),
    ]
    assert result.recovered_lines == 4
    assert len(result.warnings) == 1
    assert result.warnings[0].startswith("line 5: incomplete last record skipped")

    # The next session appends after the damage; the new record starts on its own line.
    again = ConversationFile.open(conv.path)
    again.append_message(assistant("a1 regenerated"))
    again.append_message(user("q2"))
    result = read_conversation(conv.path)
    assert result.messages == [
        user("q0"),
        assistant("a0 with ünïcödé so a cut can land inside a character"),
        user("q1"),
        assistant("a1 regenerated"),
        user("q2"),
    ]
    assert len(result.warnings) == 1
    assert result.warnings[0].startswith("line 5: unreadable record skipped")


def test_complete_last_record_without_newline_is_kept(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    conv.append_message(user("q"))
    conv.path.write_bytes(conv.path.read_bytes().rstrip(b"\n"))
    result = read_conversation(conv.path)
    assert result.messages == [user("q")]
    assert result.warnings == []
    conv.append_message(assistant("a"))
    assert read_conversation(conv.path).messages == [user("q"), assistant("a")]


def test_corrupt_and_invalid_middle_lines_are_skipped_with_warnings(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    conv.append_message(user("q0"))
    with conv.path.open("ab") as f:
        f.write(b'{"type": "message", "mess\n')  # line 3: not JSON
        f.write(b"\xff\xfe garbage\n")  # line 4: not UTF-8
        f.write(b"[1, 2]\n")  # line 5: JSON but not an object
        f.write(b'{"type": "message", "message": {"role": "robot", "content": "x"}}\n')
        f.write(b'{"type": "teleport"}\n')  # line 7
        f.write(b"\n")  # line 8: blank lines are not errors
    conv.append_message(assistant("a0"))
    result = read_conversation(conv.path)
    assert result.messages == [user("q0"), assistant("a0")]
    assert [w.split(":")[0] for w in result.warnings] == [
        "line 3",
        "line 4",
        "line 5",
        "line 6",
        "line 7",
    ]
    assert "role must be one of" in result.warnings[3]
    assert "unknown record type 'teleport'" in result.warnings[4]
    assert result.recovered_lines == 3


def test_missing_file_is_an_error_with_a_fix(tmp_path: Path) -> None:
    with pytest.raises(ConversationFileError, match=r"No conversation file at .*/history"):
        read_conversation(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "it is empty"),
        (b"\n\n", "it is empty"),
        (b'{"type": "teleport"}\n{"type": "message", "message": "x"}\n', "not a header"),
        (b'{"type": "head', "line 1 is not JSON"),
        (b"hello world\n", "line 1 is not JSON"),
    ],
)
def test_file_without_a_readable_header_is_an_error(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConversationFileError) as info:
        read_conversation(path)
    assert why in str(info.value)
    assert "/history" in str(info.value)
    with pytest.raises(ConversationFileError):
        ConversationFile.open(path)


def test_newer_format_version_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "future.jsonl"
    path.write_text('{"type": "header", "version": 2, "id": "future"}\n', encoding="utf-8")
    with pytest.raises(ConversationFileError, match="Upgrade chatcli"):
        read_conversation(path)


def make_three(tmp_path: Path) -> list[ConversationFile]:
    convs = []
    for i, name in enumerate(["20260101-000000-aaaa", "20260102-000000-bbbb", "notes"]):
        conv = new_file(tmp_path, name)
        conv.append_message(user(f"question {i} " + "long " * 30))
        conv.append_message(assistant(f"answer {i}"))
        set_mtime(conv.path, 1_700_000_000 + i * 100)
        convs.append(conv)
    return convs


def test_list_conversations_newest_first(tmp_path: Path) -> None:
    make_three(tmp_path)
    empty = new_file(tmp_path, "empty")
    set_mtime(empty.path, 1_600_000_000)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("not json\n", encoding="utf-8")
    set_mtime(broken, 1_500_000_000)
    (tmp_path / "other.txt").write_text("ignored", encoding="utf-8")

    summaries = list_conversations(tmp_path)
    assert [s.id for s in summaries] == [
        "notes",
        "20260102-000000-bbbb",
        "20260101-000000-aaaa",
        "empty",
        "broken",
    ]
    notes = summaries[0]
    assert notes.path == tmp_path / "notes.jsonl"
    assert notes.messages == 2
    assert notes.preview.startswith("question 2 long long")
    assert len(notes.preview) == 60 and notes.preview.endswith("…")
    assert notes.modified.timestamp() == 1_700_000_200
    assert notes.problem is None
    assert summaries[3].messages == 0 and summaries[3].preview == ""
    assert summaries[4].problem is not None and "line 1 is not JSON" in summaries[4].problem


def test_list_conversations_of_missing_directory_is_empty(tmp_path: Path) -> None:
    assert list_conversations(tmp_path / "none") == []
    assert latest_conversation(tmp_path / "none") is None


def test_latest_conversation_skips_empty_and_broken_files(tmp_path: Path) -> None:
    make_three(tmp_path)
    empty = new_file(tmp_path, "left-at-once")
    set_mtime(empty.path, 1_800_000_000)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("", encoding="utf-8")
    set_mtime(broken, 1_900_000_000)
    assert latest_conversation(tmp_path) == tmp_path / "notes.jsonl"


@pytest.mark.parametrize(
    ("query", "stem"),
    [
        ("notes", "notes"),
        ("notes.jsonl", "notes"),
        ("no", "notes"),
        ("20260102", "20260102-000000-bbbb"),
        ("20260101-000000-aaaa", "20260101-000000-aaaa"),
        ("  notes  ", "notes"),
    ],
)
def test_resolve_conversation(tmp_path: Path, query: str, stem: str) -> None:
    make_three(tmp_path)
    assert resolve_conversation(tmp_path, query) == tmp_path / f"{stem}.jsonl"


def test_resolve_conversation_applies_the_save_sanitising(tmp_path: Path) -> None:
    new_file(tmp_path, "my chat")
    assert resolve_conversation(tmp_path, "my chat") == tmp_path / "my-chat.jsonl"


def test_resolve_conversation_accepts_a_path(tmp_path: Path) -> None:
    conv = new_file(tmp_path / "elsewhere", "x")
    assert resolve_conversation(tmp_path, str(conv.path)) == conv.path


def test_resolve_conversation_ambiguous_prefix(tmp_path: Path) -> None:
    make_three(tmp_path)
    with pytest.raises(ConversationFileError) as info:
        resolve_conversation(tmp_path, "2026")
    message = str(info.value)
    assert "matches 2 conversations" in message
    assert "20260101-000000-aaaa" in message and "20260102-000000-bbbb" in message


def test_resolve_conversation_no_match(tmp_path: Path) -> None:
    make_three(tmp_path)
    with pytest.raises(ConversationFileError, match=r"No conversation 'zzz' in .*/history"):
        resolve_conversation(tmp_path, "zzz")


EXPORT_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    user("What is 12*7?"),
    assistant(
        [
            {"type": "text", "text": "That is "},
            {"type": "python", "text": "12*7"},
            {"type": "python_output", "text": "84"},
            {"type": "text", "text": ", so 84."},
        ]
    ),
    user("And `1/0`?"),
    assistant(
        [
            {"type": "python", "text": "1/`0`"},
            {"type": "text", "text": "I could not finish."},
        ]
    ),
]


def test_export_markdown() -> None:
    assert export_markdown(EXPORT_MESSAGES) == (
        "**System:**\n\nBe brief.\n\n"
        "**You:**\n\nWhat is 12*7?\n\n"
        "**Assistant:**\n\nThat is `calc 12*7 -> 84`, so 84.\n\n"
        "**You:**\n\nAnd `1/0`?\n\n"
        "**Assistant:**\n\n``calc 1/`0` -> (no result)`` I could not finish.\n"
    )


def test_export_markdown_of_nothing_is_empty() -> None:
    assert export_markdown([]) == ""


def test_export_json_round_trips() -> None:
    text = export_json(EXPORT_MESSAGES)
    assert json.loads(text) == {"messages": EXPORT_MESSAGES}
    assert text.endswith("\n")
    assert "\n  " in text  # indented for people


def test_a_new_conversation_has_no_file_until_its_first_message(tmp_path: Path) -> None:
    conv = NewConversation(tmp_path / "convs", model=MODEL)
    conv.append_system("first")
    conv.append_system("sys")  # only the last one before the file counts
    conv.append_undo()  # nothing saved yet: nothing to undo
    assert conv.id is None and conv.path is None
    assert not (tmp_path / "convs").exists()
    with pytest.raises(ValueError):
        conv.append_message({"role": "user"})  # a bad message makes no file either
    assert not (tmp_path / "convs").exists()
    conv.append_message(user("q"))
    conv.append_message(assistant("a"))
    conv.replace_last(assistant("b"))
    assert conv.path == tmp_path / "convs" / f"{conv.id}.jsonl"
    result = read_conversation(conv.path)
    assert result.header["model"] == MODEL
    assert result.messages == [{"role": "system", "content": "sys"}, user("q"), assistant("b")]
    conv.append_system(None)  # after the file: recorded in it
    assert read_conversation(conv.path).messages == [user("q"), assistant("b")]


def test_replace_last_before_any_message_is_a_bug(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="before any message"):
        NewConversation(tmp_path).replace_last(assistant("a"))


def test_a_damaged_line_never_leaves_two_replies_or_two_questions_in_a_row(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    conv.append_system("sys")
    for question, answer in (("q1", "a1"), ("q2", "a2"), ("q3", "a3"), ("q4", "a4")):
        conv.append_message(user(question))
        conv.append_message(assistant(answer))
    conv.append_message(user("q5"))  # not answered yet: kept, for /retry
    lines = conv.path.read_text(encoding="utf-8").splitlines()
    # Damage q2 (line 5) and a3's (line 8): a reply without its question, then a question
    # without its reply.
    lines[4] = lines[4][:10]
    lines[7] = "{not json"
    conv.path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = read_conversation(conv.path)
    assert result.messages == [
        {"role": "system", "content": "sys"},
        user("q1"),
        assistant("a1"),
        user("q4"),
        assistant("a4"),
        user("q5"),
    ]
    assert result.warnings[2:] == [
        "a reply without its question dropped: 'a2'",
        "a question without its reply dropped: 'q3'",
    ]


def test_a_renamed_file_reopens_under_its_new_name(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    conv.append_message(user("q"))
    copy = tmp_path / f"mine{SUFFIX}"
    copy.write_bytes(conv.path.read_bytes())
    assert ConversationFile.open(copy).id == "mine"  # what --resume mine finds again


def test_export_markdown_spaces_text_written_straight_after_a_call() -> None:
    reply = {
        "role": "assistant",
        "content": [
            {"type": "python", "text": "1234*56"},
            {"type": "python_output", "text": "69104"},
            {"type": "text", "text": "The answer is 69104."},
        ],
    }
    assert export_markdown([reply]) == (
        "**Assistant:**\n\n`calc 1234*56 -> 69104` The answer is 69104.\n"
    )


def test_each_message_comes_back_with_the_finish_reason_its_record_kept(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    conv.append_system("sys")
    conv.append_message(user("q1"))
    conv.append_message(assistant("a1"), {"finish_reason": "length"})
    conv.replace_last(assistant("a1, continued"), {"finish_reason": "stop"})
    conv.append_message(user("q2"))
    conv.append_message(assistant("a2"))  # a file from before the meta: unknown
    result = read_conversation(conv.path)
    assert result.finishes == [None, None, "stop", None, None]


def test_a_snapshot_keeps_each_replys_finish_reason(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    messages = [{"role": "system", "content": "sys"}, user("q"), assistant("a")]
    conv.append_snapshot(messages, [None, None, "length"])
    result = read_conversation(conv.path)
    assert result.messages == messages
    assert result.finishes == [None, None, "length"]


def test_a_message_holding_bytes_that_were_not_utf8_is_saved_readable(tmp_path: Path) -> None:
    # A lone surrogate (b"\xff" read with surrogateescape) would fail the write of a turn
    # already shown: it is saved as U+FFFD instead.
    conv = ConversationFile.create(tmp_path, model="m")
    conv.append_message({"role": "user", "content": "hi\udcff"})
    assert read_conversation(conv.path).messages == [{"role": "user", "content": "hi\ufffd"}]


# ---- damage beyond a line or two -------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


def long_conversation(tmp_path: Path, turns: int) -> ConversationFile:
    conv = new_file(tmp_path, "long")
    for i in range(turns):
        conv.append_message(user(f"q{i}"))
        conv.append_message(assistant(f"a{i}"))
    return conv


@pytest.mark.parametrize(
    ("header", "warning"),
    [
        ('{"type": "header", "vers', "line 1: the header is damaged (Unterminated string"),
        (DEEP, "line 1: the header is damaged (nested too deeply to read"),
        ("\udcff garbage", "line 1: the header is damaged (not UTF-8 text"),
        ("[1, 2]", "line 1: the header is damaged (not a JSON object)"),
        ('{"type": "x"}', "line 1: the header is damaged (not a header: unknown record type"),
        ('{"type": "system", "text": "sys"}', "line 1: a record where the header belongs"),
    ],
    ids=["cut", "deep", "not-utf8", "array", "unknown", "a-record"],
)
def test_a_damaged_header_loses_only_its_own_line(tmp_path: Path, header: str, warning: str):
    conv = long_conversation(tmp_path, 75)
    lines = conv.path.read_bytes().split(b"\n")
    lines[0] = header.encode("utf-8", "surrogateescape")
    conv.path.write_bytes(b"\n".join(lines))
    result = read_conversation(conv.path)
    expected = [m for i in range(75) for m in (user(f"q{i}"), assistant(f"a{i}"))]
    if "sys" in header:  # the first line was a record: it is read
        expected = [{"role": "system", "content": "sys"}, *expected]
    assert result.messages == expected
    assert [w[: len(warning)] for w in result.warnings] == [warning]
    assert result.header["version"] == 1
    ConversationFile.open(conv.path).append_message(user("more"))  # and it goes on
    assert read_conversation(conv.path).messages[-1] == user("more")


def test_a_line_nested_too_deep_is_skipped_like_any_bad_line(tmp_path: Path) -> None:
    conv = long_conversation(tmp_path, 1)
    with conv.path.open("a") as f:
        f.write(DEEP + "\n" + '{"a":' * 100_000 + "\n")
    conv.append_message(user("after"))
    result = read_conversation(conv.path)
    assert result.messages == [user("q0"), assistant("a0"), user("after")]
    assert [w.split(" (")[0] for w in result.warnings] == [
        "line 4: unreadable record skipped",
        "line 5: unreadable record skipped",
    ]
    assert "nested too deeply to read" in result.warnings[0]


@pytest.mark.parametrize("count", [6, 400])
def test_many_stray_records_are_one_warning(tmp_path: Path, count: int) -> None:
    conv = long_conversation(tmp_path, 2)
    with conv.path.open("a") as f:
        for i in range(count):
            f.write(json.dumps({"type": "stray", "n": i}) + "\n")
    conv.append_message(user("q2"))
    result = read_conversation(conv.path)
    assert result.messages[-1] == user("q2") and len(result.messages) == 5
    assert result.warnings == [
        f"{count} lines skipped, damaged or not a conversation's records; the first: "
        "line 6: unknown record type 'stray'; skipped"
    ]


def test_many_dropped_messages_are_one_warning_too(tmp_path: Path) -> None:
    conv = new_file(tmp_path)
    for i in range(8):  # questions without replies: each but the last is dropped
        conv.append_message(user(f"q{i}"))
    result = read_conversation(conv.path)
    assert result.messages == [user("q7")]
    assert result.warnings == [
        "7 messages dropped to keep questions and replies in turn; the first: a question "
        "without its reply dropped: 'q0'"
    ]
    assert result.repaired


def test_a_conversation_that_is_a_folder_or_a_link_loop_is_named(tmp_path: Path) -> None:
    (tmp_path / "box.jsonl").mkdir()
    (tmp_path / "loop.jsonl").symlink_to("loop.jsonl")
    with pytest.raises(ConversationFileError, match=r"box\.jsonl is not a readable .*is a folder"):
        read_conversation(tmp_path / "box.jsonl")
    with pytest.raises(ConversationFileError, match="leads back to itself"):
        read_conversation(tmp_path / "loop.jsonl")


def test_a_conversations_folder_without_permission_is_said_not_empty(tmp_path, monkeypatch):
    # As root a mode does not stop a listing: the refusal is made where the folder is listed.
    from chatcli.model import data_files

    new_file(tmp_path).append_message(user("q"))

    def refuse(path="."):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(data_files.os, "scandir", refuse)
    with pytest.raises(ConversationFileError, match="cannot be read: permission denied"):
        list_conversations(tmp_path)
    with pytest.raises(ConversationFileError, match="cannot be read: permission denied"):
        latest_conversation(tmp_path)
