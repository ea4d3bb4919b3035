from __future__ import annotations

import re

import pytest

from chatcli.chat.command_parsing import (
    COMMANDS,
    SHOW_SETTING,
    SYSTEM_CLEAR,
    Command,
    CommandError,
    find_command,
    help_text,
    is_command,
    parse_command,
    unescape_message,
)
from chatcli.errors import ChatcliError

# Every command chat-ux.md asks for.
SPEC_COMMANDS = [
    "help",
    "temperature",
    "top_k",
    "top_p",
    "max_tokens",
    "seed",
    "system",
    "settings",
    "set",
    "show",
    "clear",
    "undo",
    "retry",
    "continue",
    "save",
    "load",
    "history",
    "export",
    "stats",
    "tools",
    "raw",
    "markdown",
    "format",
    "samples",
    "probs",
    "model",
    "exit",
]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("/help", Command("help")),
        ("/?", Command("help")),
        ("/help temperature", Command("help", "temperature")),
        ("/help /quit", Command("help", "exit")),
        ("/? top-k", Command("help", "top_k")),
        ("/temperature 0.3", Command("temperature", 0.3)),
        ("/temperature 0", Command("temperature", 0.0)),
        ("/temperature 2", Command("temperature", 2.0)),
        ("  /temperature   1.5  ", Command("temperature", 1.5)),
        ("/TEMPERATURE 1", Command("temperature", 1.0)),
        ("/top_k 40", Command("top_k", 40)),
        ("/top_k 0", Command("top_k", 0)),
        ("/top_k off", Command("top_k", 0)),
        ("/top-k 5", Command("top_k", 5)),
        ("/top_p 0.9", Command("top_p", 0.9)),
        ("/top_p 1", Command("top_p", 1.0)),
        ("/max_tokens 256", Command("max_tokens", 256)),
        ("/max-tokens 1", Command("max_tokens", 1)),
        ("/seed 42", Command("seed", 42)),
        ("/seed 0", Command("seed", 0)),
        ("/seed random", Command("seed", None)),
        ("/system", Command("system", None)),
        ("/system clear", Command("system", SYSTEM_CLEAR)),
        ("/system CLEAR", Command("system", "clear")),
        ("/system You are terse.", Command("system", "You are terse.")),
        ("/system Line one\nline two", Command("system", "Line one\nline two")),
        ("/settings", Command("settings")),
        ("/clear", Command("clear")),
        ("/undo", Command("undo")),
        ("/retry", Command("retry")),
        ("/continue", Command("continue")),
        ("/save", Command("save", None)),
        ("/save my notes", Command("save", "my notes")),
        ("/load 20261121", Command("load", "20261121")),
        ("/history", Command("history")),
        ("/export md chat.md", Command("export", ("md", "chat.md", False))),
        ("/export JSON out/chat.json", Command("export", ("json", "out/chat.json", False))),
        ("/export markdown my chat.md", Command("export", ("md", "my chat.md", False))),
        ('/export md "~/my chat.md"', Command("export", ("md", "~/my chat.md", False))),
        ("/export md chat.md --force", Command("export", ("md", "chat.md", True))),
        ('/export md "my chat.md" --force', Command("export", ("md", "my chat.md", True))),
        ("/stats", Command("stats")),
        ("/tools on", Command("tools", True)),
        ("/tools off", Command("tools", False)),
        ("/raw on", Command("raw", True)),
        ("/raw OFF", Command("raw", False)),
        ("/samples 2", Command("samples", 2)),
        ("/samples 8", Command("samples", 8)),
        ("/model", Command("model")),
        ("/exit", Command("exit")),
        ("/quit", Command("exit")),
        ("/bye", Command("exit")),
    ],
)
def test_parse_good_lines(line: str, expected: Command) -> None:
    parsed = parse_command(line)
    assert parsed == expected
    assert type(parsed.arg) is type(expected.arg)


@pytest.mark.parametrize(
    "name", ["temperature", "top_k", "top_p", "max_tokens", "seed", "tools", "raw"]
)
def test_a_setting_command_alone_asks_to_show_the_value(name: str) -> None:
    assert parse_command(f"/{name}") == Command(name, SHOW_SETTING)
    assert parse_command(f"/{name}   ") == Command(name, SHOW_SETTING)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("/foo", "Unknown command /foo. Type /help for the list."),
        ("/tempreature 0.5", "Did you mean /temperature?"),
        ("/exti", "Did you mean /exit?"),
        ("/temp 0.5", "Unknown command /temp. Type /help for the list. Did you mean /temperature?"),
        ("/top 5", "Did you mean /top_k or /top_p?"),
        ("/sample 3", "Did you mean /samples?"),
        ("/usr/bin/env is what?", "begin it with //"),
        ("/help nothing", "Unknown command /nothing"),
        ("/help top_k top_p", "/help takes one command name"),
        (
            "/temperature hot",
            "/temperature needs a number between 0 and 2, e.g. /temperature 0.7 (got 'hot')",
        ),
        ("/temperature 3", "/temperature needs a number between 0 and 2"),
        ("/temperature -1", "/temperature needs a number between 0 and 2"),
        ("/temperature 0.3 0.4", "(got '0.3 0.4')"),
        ("/top_k -1", "/top_k needs a whole number between 0 and 1000"),
        ("/top_k 2.5", "/top_k needs a whole number between 0 and 1000"),
        ("/top_p 0", "/top_p needs a number above 0 and at most 1"),
        ("/top_p 2", "/top_p needs a number above 0 and at most 1"),
        ("/max_tokens 0", "/max_tokens needs a whole number between 1 and 65536"),
        ("/max_tokens lots", "/max_tokens needs a whole number between 1 and 65536"),
        ("/seed -5", "/seed needs"),
        ("/seed sometimes", "/seed needs"),
        ("/tools maybe", "/tools needs on or off"),
        ("/raw yes please", "/raw needs on or off"),
        ("/samples", "/samples needs a whole number between 2 and 8, e.g. /samples 3"),
        ("/samples 1", "/samples needs a whole number between 2 and 8"),
        ("/samples 9", "(got '9')"),
        ("/samples two", "/samples needs"),
        ("/load", "/load needs the name or id of a saved conversation"),
        ("/export", "/export needs a format (md or json) and a path"),
        ("/export pdf chat.pdf", "(got format 'pdf')"),
        ("/export md", "(the path is missing)"),
        ('/export md ""', "(the path is missing)"),
        ("/export md --force", "(the path is missing)"),
        ("/clear everything", "/clear takes no arguments, got 'everything'. Usage: /clear"),
        ("/exit now", "/exit takes no arguments"),
        ("/settings all", "/settings takes no arguments"),
        ("/undo 2", "/undo takes no arguments"),
        ("/stats x", "/stats takes no arguments"),
        ("/model d20", "/model takes no arguments"),
    ],
)
def test_parse_bad_lines(line: str, message: str) -> None:
    with pytest.raises(CommandError) as info:
        parse_command(line)
    assert message in str(info.value)


def test_command_error_is_a_chatcli_error() -> None:
    assert issubclass(CommandError, ChatcliError)


def test_unknown_command_without_close_match_has_no_suggestion() -> None:
    with pytest.raises(CommandError) as info:
        parse_command("/xyzzy")
    assert str(info.value) == "Unknown command /xyzzy. Type /help for the list."


def test_parse_refuses_a_line_that_is_not_a_command() -> None:
    with pytest.raises(CommandError, match="is not a command"):
        parse_command("hello")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("/help", True),
        ("/?", True),
        ("/x", True),
        ("/Temperature 1", True),
        ("/", False),
        ("/ help", False),
        ("//help", False),
        ("/1 is a number", False),
        ("hello /help", False),
        (" /help", False),
        ("", False),
    ],
)
def test_is_command(line: str, expected: bool) -> None:
    assert is_command(line) is expected


def test_unescape_message() -> None:
    assert unescape_message("//etc/hosts?") == "/etc/hosts?"
    assert unescape_message("plain") == "plain"
    assert unescape_message("/ x") == "/ x"


def test_table_covers_every_command_in_the_spec() -> None:
    assert list(COMMANDS) == SPEC_COMMANDS
    for name, spec in COMMANDS.items():
        assert spec.name == name
        assert spec.usage.startswith(f"/{name}")
        assert spec.description and "\n" not in spec.description
    assert COMMANDS["help"].aliases == ("?",)
    assert set(COMMANDS["exit"].aliases) == {"quit", "bye"}


def test_no_alias_shadows_another_command() -> None:
    words = [w for spec in COMMANDS.values() for w in (spec.name, *spec.aliases)]
    assert len(words) == len(set(words))


@pytest.mark.parametrize("name", SPEC_COMMANDS)
def test_every_command_parses_its_usage_example(name: str) -> None:
    # Substituting a plausible value for the usage's placeholders must give a valid command.
    examples = {
        "X": "0.7",
        "K": "40",
        "P": "0.9",
        "N|random": "random",
        "N": "3" if name == "samples" else "100",
        "[CMD]": "",
        "[TEXT|clear]": "",
        "[NAME]": "",
        "NAME": "notes",
        "md|json": "md",
        "PATH": "out.md",
        "on|off": "on",
        "auto|always|never": "never",
        "text|json|FILE": "json",
        "SETTING": "temperature",
        "VALUE": "0.7",
        "[WHAT]": "",
        "[--force]": "--force",
        "[N]": "3",
    }
    words = COMMANDS[name].usage.split()
    line = " ".join([words[0], *(examples[w] for w in words[1:])])
    # /set stands for the command of the setting it names.
    assert parse_command(line).name == {"set": "temperature"}.get(name, name)


def test_find_command_by_alias_and_spelling() -> None:
    assert find_command("quit").name == "exit"
    assert find_command("/Top-P").name == "top_p"
    with pytest.raises(CommandError, match="Unknown command /nope"):
        find_command("nope")


def test_help_text_lists_every_command_with_its_description() -> None:
    text = help_text()
    for spec in COMMANDS.values():
        line = next(line for line in text.splitlines() if line.strip().startswith(spec.usage))
        assert spec.description in line
    assert "(also /quit, /bye)" in text
    assert "(also /?)" in text


def test_help_text_for_one_command() -> None:
    assert help_text("temperature") == (
        "/temperature X\n"
        "  Set the sampling temperature (0 = always the likeliest token).\n"
        "  Takes a number between 0 and 2, e.g. /temperature 0.7; alone, shows the value."
    )
    assert help_text("/quit").splitlines()[-1] == "  Also: /quit, /bye"


def test_help_text_for_unknown_command() -> None:
    with pytest.raises(CommandError, match="Did you mean /temperature"):
        help_text("temprature")


def test_help_usage_lines_line_up() -> None:
    rows = [line for line in help_text().splitlines() if line.startswith("  /")]
    starts = {re.search(r"\S+\s{2,}", line[2:]).end() for line in rows}  # type: ignore[union-attr]
    assert len(starts) == 1
