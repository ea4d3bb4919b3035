"""ollama's /set and /show in a chat, beside chatcli's own commands, and /save NAME naming the
conversation. Parsed, completed, and through the real `chatcli chat`."""

from __future__ import annotations

import pytest
from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document
from typer.testing import CliRunner

from chatcli.chat.command_parsing import (
    SHOW_SETTING,
    Command,
    CommandError,
    parse_command,
)
from chatcli.chat.conversation_index import list_conversations
from chatcli.chat.conversation_reader import read_conversation
from chatcli.cli.app import app
from chatcli.terminal.repl import CommandCompleter

runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in ("CHATCLI_TEMPERATURE", "CHATCLI_MODEL", "CHATCLI_CONFIG", "CHATCLI_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("line", "command"),
    [
        ("/set temperature 0.7", Command("temperature", 0.7)),
        ("/set TEMPERATURE 1", Command("temperature", 1.0)),
        ("/set temp 0.2", Command("temperature", 0.2)),
        ("/set top_k 40", Command("top_k", 40)),
        ("/set top-k off", Command("top_k", 0)),
        ("/set top_p 0.9", Command("top_p", 0.9)),
        ("/set max_tokens 100", Command("max_tokens", 100)),
        ("/set num_predict 64", Command("max_tokens", 64)),  # ollama's name
        ("/set parameter temperature 0.5", Command("temperature", 0.5)),  # ollama's long form
        ("/set parameter num_predict 32", Command("max_tokens", 32)),
        ("/set seed 42", Command("seed", 42)),
        ("/set seed random", Command("seed", None)),
        ("/set system You are terse.", Command("system", "You are terse.")),
        ("/set system clear", Command("system", "clear")),
        ("/set system", Command("system", None)),
        ("/set tools off", Command("tools", False)),
        ("/set raw on", Command("raw", True)),
        ("/set markdown never", Command("markdown", "never")),
        ("/set temperature", Command("temperature", SHOW_SETTING)),
        ("/set", Command("help", "set")),
        ("/show", Command("show")),
        ("/show settings", Command("settings")),
        ("/show parameters", Command("settings")),
        ("/show info", Command("model")),
        ("/show model", Command("model")),
        ("/show System", Command("system")),
    ],
)
def test_set_and_show_stand_for_our_commands(line, command):
    assert parse_command(line) == command


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("/set temprature 1", "not 'temprature'. Did you mean /set temperature?"),
        ("/set colour blue", "/set changes temperature, top_k"),
        ("/set temperature hot", "/set temperature needs a number between 0 and 2"),
        ("/set top_k 5000", "/set top_k needs a whole number between 0 and 1000"),
        ("/set max_tokens 0", "/set max_tokens needs a whole number between 1 and 65536"),
        ("/set tools maybe", "/set tools needs on or off"),
        ("/show license", "/show takes settings, parameters, info, model, system"),
        ("/show modelfile", "not 'modelfile'"),
    ],
)
def test_a_bad_set_or_show_says_what_it_takes_in_the_words_typed(line, message):
    with pytest.raises(CommandError) as caught:
        parse_command(line)
    assert message in str(caught.value)


def completions(text: str, tmp_path) -> list[str]:
    completer = CommandCompleter(tmp_path)
    found = completer.get_completions(Document(text), CompleteEvent())
    return [c.text for c in found]


def test_tab_completes_what_set_and_show_take(tmp_path):
    assert completions("/set t", tmp_path) == ["temperature", "top_k", "top_p", "tools"]
    assert completions("/show ", tmp_path) == ["settings", "parameters", "info", "model", "system"]
    assert "set " in completions("/se", tmp_path)  # the command itself, ready for its setting


def chat(*lines: str, args: tuple[str, ...] = ()) -> tuple[int, str, str]:
    result = runner.invoke(app, ["chat", *args], input="".join(f"{line}\n" for line in lines))
    return result.exit_code, result.stdout, result.stderr


def test_set_and_show_in_a_real_chat_change_and_show_the_settings():
    code, out, err = chat(
        "/set temperature 0.3",
        "/set parameter num_predict 7",
        "/set system Answer in one word.",
        "/show",
        "/show system",
    )
    assert code == 0, err
    assert "temperature = 0.3" in err and "max_tokens = 7" in err
    assert "System prompt set: Answer in one word." in err
    table = {line.split()[0]: " ".join(line.split()[1:]) for line in out.splitlines() if line}
    assert table["temperature"] == "0.3" and table["max_tokens"] == "7"
    assert table["system"] == "Answer in one word."
    assert table["params"] == "3,637,394"  # the model's information follows the settings
    assert table["context_len"] == "1280"
    assert "System prompt: Answer in one word." in err


def test_a_bad_set_is_one_error_and_the_chat_goes_on():
    code, out, err = chat("/set temperature 7", "/set temperature 0.4", "/show settings")
    assert code == 1  # piped input: an error makes the exit code 1, as a script expects
    assert err.count("Error: ") == 1
    assert "Error: /set temperature needs a number between 0 and 2" in err
    assert "temperature = 0.4" in err
    assert [line.split() for line in out.splitlines() if line.startswith("temperature")] == [
        ["temperature", "0.4"]
    ]


def test_save_names_the_conversation_and_resume_finds_it_by_the_name(tmp_path):
    code, _, err = chat("What is 2+3?", "/save my sums", args=("-t", "0", "-n", "20"))
    assert code == 0, err
    (summary,) = list_conversations(tmp_path / "home" / "conversations")
    assert summary.name == "my sums" and summary.id[:4].isdigit()  # the id stays
    assert f'Named this conversation "my sums" ({summary.id})' in err
    assert f'Saved as {summary.id} ("my sums"); chatcli chat --resume "my sums"' in err

    code, _, err = chat("How many r in strawberry?", args=("--resume", "My Sums", "-n", "40"))
    assert code == 0, err
    assert f"Resumed {summary.id}.jsonl: 2 messages." in err
    (again,) = list_conversations(tmp_path / "home" / "conversations")  # still one
    assert again.turns == 2
    shown = runner.invoke(app, ["conversations", "show", "my sums"])
    assert "> How many r in strawberry?" in shown.stdout


def test_save_before_the_first_message_names_the_file_it_makes(tmp_path):
    code, _, err = chat("/save early", "hello", args=("-n", "8"))
    assert code == 0, err
    assert 'Named "early": saved from its first message' in err
    (path,) = (tmp_path / "home" / "conversations").glob("*.jsonl")
    assert read_conversation(path).name == "early"


def test_a_name_another_conversation_has_is_refused(tmp_path):
    assert chat("hi", "/save notes", args=("-n", "4"))[0] == 0
    code, _, err = chat("hello", "/save NOTES", args=("-n", "4"))
    assert code == 1
    assert "A conversation is called 'NOTES' already" in err
    names = sorted(str(s.name) for s in list_conversations(tmp_path / "home" / "conversations"))
    assert names == ["None", "notes"]
