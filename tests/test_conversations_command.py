"""`chatcli conversations` (list, show, rm, export) through the real CLI, conversations named by
a record of their own, and where the files live: XDG's data and state folders, CHATCLI_HOME
over all, and files an earlier chatcli kept beside the config moved once, with a notice."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatcli.chat.conversation_index import (
    check_name_free,
    list_conversations,
    resolve_conversation,
)
from chatcli.chat.conversation_reader import read_conversation
from chatcli.chat.conversation_store import ConversationFile, NewConversation
from chatcli.chat.user_dirs import (
    config_path,
    conversations_dir,
    data_dir,
    history_path,
    move_old_files,
    state_dir,
    user_dir,
)
from chatcli.cli.app import app
from chatcli.errors import ConversationFileError

runner = CliRunner()
CALC = [
    {"type": "text", "text": "It is "},
    {"type": "python", "text": "6*7"},
    {"type": "python_output", "text": "42"},
    {"type": "text", "text": "42."},
]


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    """CHATCLI_HOME in a temporary folder: conversations in its conversations/."""
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in ("CHATCLI_CONVERSATIONS_DIR", "CHATCLI_CONFIG", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "home" / "conversations"


def save(folder: Path, questions: list[str], name: str | None = None, when: int = 0) -> Path:
    """A conversation of `questions`, each answered; `when` orders the files' times."""
    now = datetime(2026, 11, 1 + when, 9, 30).astimezone()
    file = ConversationFile.create(folder, model="d20", now=now)
    file.append_system("Be brief.")
    for q in questions:
        file.append_message({"role": "user", "content": q})
        file.append_message({"role": "assistant", "content": CALC}, {"finish_reason": "stop"})
    if name is not None:
        file.append_name(name)
    stamp = now.timestamp()
    os.utime(file.path, (stamp, stamp))
    return file.path


def rows(output: str) -> list[list[str]]:
    """A table's rows, cells split on two or more spaces."""
    import re

    return [re.split(r"\s{2,}", line.strip()) for line in output.splitlines()[2:] if line.strip()]


# ---- list -------------------------------------------------------------------------------------


def test_the_list_shows_id_name_date_turns_and_first_question_newest_first(folder):
    old = save(folder, ["What is 6*7?", "And 7*6?"], when=0)
    named = save(folder, ["How many r in strawberry?"], name="berry count", when=2)
    (folder / "broken.jsonl").write_text("not json\n")
    os.utime(folder / "broken.jsonl", (0, 0))
    result = runner.invoke(app, ["conversations"])
    assert result.exit_code == 0, result.output
    assert result.stdout.split("\n")[0].split() == [
        "id",
        "name",
        "date",
        "turns",
        "first",
        "question",
    ]
    listed = rows(result.stdout)
    assert listed[0] == [
        named.stem,
        "berry count",
        "2026-11-03 09:30",
        "1",
        "How many r in strawberry?",
    ]
    assert listed[1] == [old.stem, "-", "2026-11-01 09:30", "2", "What is 6*7?"]
    assert listed[2][0] == "broken" and listed[2][-1].startswith("(unreadable:")


def test_an_empty_list_says_where_it_looked(folder):
    result = runner.invoke(app, ["conversations"])
    assert result.exit_code == 0
    assert result.stdout == ""
    assert result.stderr == f"No saved conversations in {folder}. A chat saves each as it goes.\n"


# ---- show, export, rm -------------------------------------------------------------------------


def test_show_finds_a_conversation_by_id_name_prefix_or_last(folder):
    first = save(folder, ["What is 6*7?"], when=0)
    last = save(folder, ["How many r in strawberry?"], name="Berry Count", when=1)
    for wanted, path in [
        (first.stem, first),
        (first.stem[:-3], first),  # a unique prefix of the id
        ("berry count", last),  # a name, in any case
        ("  Berry   Count ", last),
        (first.name, first),  # the file's name: the id and .jsonl
        ("last", last),
    ]:
        result = runner.invoke(app, ["conversations", "show", wanted])
        assert result.exit_code == 0, (wanted, result.output)
        assert result.stdout.startswith(f"{path.stem} ·"), wanted
    shown = runner.invoke(app, ["conversations", "show", first.stem]).stdout.splitlines()
    assert shown == [
        f"{first.stem} · 2026-11-01 09:30 · 1 turns · d20",
        "system: Be brief.",
        "> What is 6*7?",
        "It is [calc 6*7 = 42] 42.",
    ]


@pytest.mark.parametrize(
    ("wanted", "message"),
    [
        ("nope", "No conversation 'nope'"),
        ("2026", "matches 2 conversations"),
    ],
)
def test_show_of_no_conversation_or_of_several_is_one_line_and_exit_1(folder, wanted, message):
    save(folder, ["a"], when=0)
    save(folder, ["b"], when=1)
    result = runner.invoke(app, ["conversations", "show", wanted])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and message in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_two_conversations_of_one_name_ask_for_the_id(folder):
    a = save(folder, ["a"], name="notes", when=0)
    b = save(folder, ["b"], when=1)
    ConversationFile.open(b).append_name("Notes")  # written by hand: two of one name
    with pytest.raises(ConversationFileError, match="2 conversations are called 'notes'"):
        resolve_conversation(folder, "notes")
    assert resolve_conversation(folder, a.stem) == a


def test_export_writes_markdown_or_json_to_stdout_or_a_file(folder, tmp_path):
    path = save(folder, ["What is 6*7?"], name="calc")
    md = runner.invoke(app, ["conversations", "export", "calc"])
    assert md.exit_code == 0
    assert md.stdout == (
        "**System:**\n\nBe brief.\n\n**You:**\n\nWhat is 6*7?\n\n"
        "**Assistant:**\n\nIt is `calc 6*7 -> 42` 42.\n"
    )
    as_json = runner.invoke(app, ["conversations", "export", path.stem, "--format", "json"])
    assert json.loads(as_json.stdout)["messages"] == read_conversation(path).messages
    out = tmp_path / "out.md"
    to_file = runner.invoke(
        app, ["conversations", "export", "calc", "-f", "markdown", "-o", str(out)]
    )
    assert to_file.exit_code == 0 and to_file.stdout == ""
    assert out.read_text() == md.stdout
    assert to_file.stderr == f"Wrote 2 messages to {out}.\n"
    bad = runner.invoke(app, ["conversations", "export", "calc", "-o", str(tmp_path / "no" / "x")])
    assert bad.exit_code == 1 and "Pick another path" in bad.stderr


def test_rm_finds_every_one_first_and_removes_none_if_one_is_missing(folder):
    a = save(folder, ["a"], when=0)
    b = save(folder, ["b"], name="bee", when=1)
    c = save(folder, ["c"], when=2)
    missing = runner.invoke(app, ["conversations", "rm", a.stem, "nope"])
    assert missing.exit_code == 1
    assert a.exists() and b.exists()
    result = runner.invoke(app, ["conversations", "rm", a.stem, "bee", a.stem])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [f"Removed {a.stem} ({a}).", f"Removed {b.stem} ({b})."]
    assert not a.exists() and not b.exists() and c.exists()
    assert [s.path for s in list_conversations(folder)] == [c]


def test_rm_takes_a_whole_id_or_name_never_a_prefix(folder):
    # A prefix that names one conversation today is a guess: rm deletes nothing on it.
    only = save(folder, ["a"], when=0)
    result = runner.invoke(app, ["conversations", "rm", only.stem[:-3]])
    assert result.exit_code == 1
    assert "takes a whole id or name" in result.stderr and only.stem in result.stderr
    assert only.exists()
    assert runner.invoke(app, ["conversations", "rm", only.stem]).exit_code == 0
    assert not only.exists()


# ---- names --------------------------------------------------------------------------------------


def test_a_name_is_a_record_the_last_one_counts_and_the_id_stays(folder):
    path = save(folder, ["a"], name="first name")
    ConversationFile.open(path).append_name("  second\tname ")
    loaded = read_conversation(path)
    assert loaded.name == "second name"
    assert loaded.warnings == []
    assert [s.name for s in list_conversations(folder)] == ["second name"]
    assert path.stem.startswith("2026")  # its id, and the file, are the same


def test_a_name_given_before_the_first_message_is_written_with_it(folder):
    pending = NewConversation(folder, model="m", system="S")
    pending.append_name("early bird")
    assert not folder.exists()  # no file until there is a message
    pending.append_message({"role": "user", "content": "hi"})
    loaded = read_conversation(pending.path)
    assert (loaded.name, loaded.messages[0]) == ("early bird", {"role": "system", "content": "S"})


@pytest.mark.parametrize("bad", ["", "   ", "last", "LAST", "x" * 81, "tab\x07bell"])
def test_a_name_that_cannot_find_its_conversation_again_is_refused(folder, bad):
    path = save(folder, ["a"])
    with pytest.raises(ConversationFileError):
        ConversationFile.open(path).append_name(bad)
    assert read_conversation(path).name is None


def test_a_name_taken_by_another_conversation_by_name_or_id_is_refused(folder):
    a = save(folder, ["a"], name="notes", when=0)
    b = save(folder, ["b"], when=1)
    for taken in ("notes", "NOTES", a.stem):
        with pytest.raises(ConversationFileError, match="is called"):
            check_name_free(folder, taken, mine=b)
    check_name_free(folder, "notes", mine=a)  # its own name again: fine
    check_name_free(folder, "other", mine=b)


def test_a_bad_name_record_is_skipped_with_a_warning(folder):
    path = save(folder, ["a"], name="good")
    with path.open("a") as f:
        f.write(json.dumps({"type": "name", "name": 42}) + "\n")
    loaded = read_conversation(path)
    assert loaded.name == "good"
    assert loaded.warnings == ["line 6: a name must be a text; skipped"]


# ---- where the files live -----------------------------------------------------------------------


def test_xdg_base_directories_place_config_data_and_state(tmp_path):
    env = {
        "XDG_CONFIG_HOME": str(tmp_path / "c"),
        "XDG_DATA_HOME": str(tmp_path / "d"),
        "XDG_STATE_HOME": str(tmp_path / "s"),
    }
    assert config_path(env) == tmp_path / "c" / "chatcli" / "config.toml"
    assert conversations_dir(env) == tmp_path / "d" / "chatcli" / "conversations"
    assert history_path(env) == tmp_path / "s" / "chatcli" / "input_history"
    home = Path.home()
    assert data_dir({}) == home / ".local" / "share" / "chatcli"
    assert state_dir({}) == home / ".local" / "state" / "chatcli"
    assert user_dir({}) == home / ".config" / "chatcli"
    # Relative paths in these variables are invalid (the XDG spec): ignored.
    relative = {"XDG_DATA_HOME": "rel", "XDG_STATE_HOME": "rel"}
    assert data_dir(relative) == home / ".local" / "share" / "chatcli"
    assert state_dir(relative) == home / ".local" / "state" / "chatcli"
    # CHATCLI_HOME holds all three; CHATCLI_CONVERSATIONS_DIR the conversations alone.
    one = {**env, "CHATCLI_HOME": str(tmp_path / "h")}
    assert (config_path(one), conversations_dir(one), history_path(one)) == (
        tmp_path / "h" / "config.toml",
        tmp_path / "h" / "conversations",
        tmp_path / "h" / "input_history",
    )
    assert conversations_dir({**env, "CHATCLI_CONVERSATIONS_DIR": str(tmp_path / "x")}) == (
        tmp_path / "x"
    )


def xdg(tmp_path: Path) -> dict[str, str]:
    return {
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_STATE_HOME": str(tmp_path / "state"),
    }


def test_old_files_beside_the_config_are_moved_once_with_a_notice(tmp_path):
    env = xdg(tmp_path)
    old = tmp_path / "config" / "chatcli"
    a = save(old / "conversations", ["a"], when=0)
    b = save(old / "conversations", ["b"], name="bee", when=1)
    (old / "input_history").write_text("\n# 2026\n+hello\n")
    (old / "config.toml").write_text("temperature = 0.5\n")
    said = move_old_files(env)
    new = tmp_path / "data" / "chatcli" / "conversations"
    assert said == [
        f"Moved 2 saved conversations from {old / 'conversations'} to {new}.",
        f"Moved the input history from {old / 'input_history'} to "
        f"{tmp_path / 'state' / 'chatcli' / 'input_history'}.",
    ]
    assert sorted(p.name for p in new.iterdir()) == sorted([a.name, b.name])
    assert read_conversation(new / b.name).name == "bee"
    assert not (old / "conversations").exists()
    assert (old / "config.toml").exists()  # the config stays where it is
    assert (tmp_path / "state" / "chatcli" / "input_history").read_text() == "\n# 2026\n+hello\n"
    assert move_old_files(env) == []  # once


def test_a_moved_conversation_whose_name_is_taken_moves_under_another(tmp_path):
    env = xdg(tmp_path)
    old = tmp_path / "config" / "chatcli" / "conversations"
    new = tmp_path / "data" / "chatcli" / "conversations"
    new.mkdir(parents=True)
    (old).mkdir(parents=True)
    (old / "notes.jsonl").write_text("old\n")
    (new / "notes.jsonl").write_text("new\n")
    (new / "notes-2.jsonl").write_text("newer\n")
    (old / "keep.txt").write_text("a file of the person's own: moved too\n")
    said = move_old_files(env)
    assert said == [
        f"Moved 2 saved conversations from {old} to {new} "
        "(notes.jsonl as notes-3.jsonl: the name was taken)."
    ]
    assert (new / "notes-3.jsonl").read_text() == "old\n"
    assert (new / "notes.jsonl").read_text() == "new\n"


@pytest.mark.parametrize("override", ["CHATCLI_HOME", "CHATCLI_CONVERSATIONS_DIR"])
def test_nothing_moves_where_a_variable_says_where_the_files_are(tmp_path, override):
    env = {**xdg(tmp_path), override: str(tmp_path / "mine")}
    if override == "CHATCLI_HOME":
        old = tmp_path / "mine" / "conversations"  # already where they belong
    else:
        old = tmp_path / "config" / "chatcli" / "conversations"
    save(old, ["a"])
    said = move_old_files(env)
    if override == "CHATCLI_HOME":
        assert said == []
    else:  # the history would move, the conversations stay out of the way
        assert all("conversation" not in line for line in said)
    assert list(old.iterdir())


def test_a_chat_saves_where_xdg_says_and_the_list_finds_it(tmp_path, monkeypatch):
    for key, value in xdg(tmp_path).items():
        monkeypatch.setenv(key, value)
    for name in ("CHATCLI_HOME", "CHATCLI_CONVERSATIONS_DIR", "CHATCLI_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    old = tmp_path / "config" / "chatcli" / "conversations"
    moved = save(old, ["an old question"])
    chat = runner.invoke(app, ["chat", "-t", "0", "-n", "8"], input="What is 2+3?\n")
    assert chat.exit_code == 0, chat.output
    new = tmp_path / "data" / "chatcli" / "conversations"
    assert f"Moved 1 saved conversation from {old} to {new}." in chat.stderr
    listed = runner.invoke(app, ["conversations"])
    assert "Moved" not in listed.stderr  # once
    questions = [r[-1] for r in rows(listed.stdout)]
    assert questions == ["What is 2+3?", "an old question"]
    assert (new / moved.name).exists()
