"""Slash commands: the table of them, and turning a typed line into a validated Command.

This module owns the names, aliases, usage lines and descriptions (used by /help and Tab
completion) and the parsing of each command's argument into a typed value. It does not run
anything: the REPL decides what `Command("temperature", 0.3)` does. Setting-valued commands
are checked with settings.validate_setting, so every range lives in one place.

ollama's `/set NAME VALUE` and `/show [WHAT]` parse to the command of ours that does the
same (`/set temperature 0.7` is `/temperature 0.7`, `/show info` is `/model`): the REPL runs
one thing either way.

A line is a command when it starts with "/" followed by a letter or "?". Anything else,
including "/ x" and "//x", is a message; a REPL sends "//x" as "/x" (see unescape_message),
which is how a person sends a message that starts with a slash.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from chatcli.chat.settings import SETTING_RULES, validate_setting
from chatcli.errors import ChatcliError, ConfigError

SYSTEM_CLEAR = "clear"  # Command("system", SYSTEM_CLEAR) removes the system prompt
# The argument of a setting's command typed alone (/temperature): show the value, change
# nothing. Not None, which /seed's "random" parses to.
SHOW_SETTING = object()
EXPORT_FORMATS = ("md", "json")
EXPORT_FORCE = "--force"  # /export md chat.md --force: replace chat.md
SAMPLES_MIN, SAMPLES_MAX = 2, 8

_COMMAND_LINE = re.compile(r"/(?P<word>\S+)(?:\s+(?P<rest>.*))?\Z", re.DOTALL)


class CommandError(ChatcliError):
    """A slash command that is unknown, or has a missing, extra or bad argument."""


@dataclass(frozen=True)
class Command:
    """A parsed command. `arg` is the typed argument, or None when the command takes none
    (or it was left out, e.g. /system to show, /help for all, /save without a name); a
    setting's command typed alone has SHOW_SETTING."""

    name: str
    arg: object = None


@dataclass(frozen=True)
class CommandSpec:
    """One row of the table: how the command is written, what it does, how its argument parses."""

    name: str
    usage: str
    description: str
    parse: Callable[[CommandSpec, str], object]
    aliases: tuple[str, ...] = ()
    details: str = ""  # a line for /help CMD about the argument


def _no_argument(spec: CommandSpec, rest: str) -> None:
    if rest:
        raise CommandError(f"/{spec.name} takes no arguments, got {rest!r}. Usage: {spec.usage}")


def _setting(spec: CommandSpec, rest: str) -> object:
    # The command shares its name with the setting it changes.
    rule = SETTING_RULES[spec.name]
    needs = f"/{spec.name} needs {rule.expected}, e.g. /{spec.name} {rule.example}"
    if not rest:
        return SHOW_SETTING
    try:
        return validate_setting(spec.name, rest, f"/{spec.name}")
    except ConfigError:
        raise CommandError(f"{needs} (got {rest!r})") from None


def _system(spec: CommandSpec, rest: str) -> str | None:
    if rest.lower() == SYSTEM_CLEAR:
        return SYSTEM_CLEAR
    return rest or None


def _optional_text(spec: CommandSpec, rest: str) -> str | None:
    return rest or None


def _load(spec: CommandSpec, rest: str) -> str:
    if not rest:
        raise CommandError(
            "/load needs the name or id of a saved conversation, e.g. /load notes "
            "(/history lists them)"
        )
    return rest


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _export(spec: CommandSpec, rest: str) -> tuple[str, str, bool]:
    """(format, path, force): a last word --force replaces a file that is there already."""
    needs = "/export needs a format (md or json) and a path, e.g. /export md chat.md"
    force = rest == EXPORT_FORCE or rest.endswith(" " + EXPORT_FORCE)
    if force:
        rest = rest.removesuffix(EXPORT_FORCE).rstrip()
    parts = rest.split(maxsplit=1)
    if not parts:
        raise CommandError(needs)
    fmt = parts[0].lower()
    if fmt == "markdown":
        fmt = "md"
    if fmt not in EXPORT_FORMATS:
        raise CommandError(f"{needs} (got format {parts[0]!r})")
    path = _unquote(parts[1].strip()) if len(parts) == 2 else ""
    if not path:
        raise CommandError(f"{needs} (the path is missing)")
    return fmt, path, force


def _reply_format(spec: CommandSpec, rest: str) -> str | None:
    """text, json, a schema file's path, or None (show the format)."""
    if not rest:
        return None
    return rest.lower() if rest.lower() in ("text", "json") else _unquote(rest)


def _samples(spec: CommandSpec, rest: str) -> int:
    needs = (
        f"/samples needs a whole number between {SAMPLES_MIN} and {SAMPLES_MAX}, e.g. /samples 3"
    )
    try:
        value = int(rest)
    except ValueError:
        raise CommandError(f"{needs} (got {rest!r})" if rest else needs) from None
    if not SAMPLES_MIN <= value <= SAMPLES_MAX:
        raise CommandError(f"{needs} (got {rest!r})")
    return value


def _probs(spec: CommandSpec, rest: str) -> int | None:
    """None: the whole reply shaded; N: the alternatives at its token N (from 1)."""
    if not rest:
        return None
    needs = "/probs takes a token's position in the last reply (from 1), e.g. /probs 3"
    try:
        value = int(rest)
    except ValueError:
        raise CommandError(f"{needs} (got {rest!r})") from None
    if value < 1:
        raise CommandError(f"{needs} (got {rest!r})")
    return value


def _help(spec: CommandSpec, rest: str) -> str | None:
    if not rest:
        return None
    if len(rest.split()) > 1:
        raise CommandError(f"/help takes one command name, got {rest!r}. Usage: {spec.usage}")
    return find_command(rest).name


# What /set changes: each the command of the same name. ollama's parameter names too.
SET_NAMES = (
    "temperature",
    "top_k",
    "top_p",
    "max_tokens",
    "seed",
    "system",
    "tools",
    "raw",
    "markdown",
)
_SET_ALIASES = {"num_predict": "max_tokens", "temp": "temperature"}
# /show WHAT: the command that shows it. Alone, /show shows the settings and the model.
SHOW_WHAT = {
    "settings": "settings",
    "parameters": "settings",
    "info": "model",
    "model": "model",
    "system": "system",
}


def _set(spec: CommandSpec, rest: str) -> Command:
    """`/set NAME VALUE` as the command NAME (`/set parameter NAME VALUE`, ollama's longer
    form, too); `/set` alone is /help set."""
    words = rest.split(maxsplit=1)
    if words and words[0].lower() == "parameter":
        words = words[1].split(maxsplit=1) if len(words) > 1 else []
    if not words:
        return Command("help", "set")
    key = words[0].lower().replace("-", "_")
    name = _SET_ALIASES.get(key, key)
    if name not in SET_NAMES:
        close = difflib.get_close_matches(name, SET_NAMES, n=1, cutoff=0.6)
        hint = f" Did you mean /set {close[0]}?" if close else ""
        raise CommandError(
            f"/set changes {', '.join(SET_NAMES)}; not {words[0]!r}.{hint} "
            "E.g. /set temperature 0.7"
        )
    target = COMMANDS[name]
    value = words[1].strip() if len(words) > 1 else ""
    try:
        return Command(name, target.parse(target, value))
    except CommandError as e:  # its message, in the words typed: /set temperature needs...
        raise CommandError(str(e).replace(f"/{name} ", f"/set {name} ")) from None


def _show(spec: CommandSpec, rest: str) -> Command:
    """`/show WHAT` as the command that shows it; `/show` alone stays /show (all of it)."""
    if not rest:
        return Command("show")
    what = SHOW_WHAT.get(rest.lower())
    if what is None:
        raise CommandError(
            f"/show takes {', '.join(SHOW_WHAT)}, or nothing for the settings and the "
            f"model; not {rest!r}."
        )
    return Command(what)


def _setting_details(name: str) -> str:
    rule = SETTING_RULES[name]
    return f"Takes {rule.expected}, e.g. /{name} {rule.example}; alone, shows the value."


_SPECS = (
    CommandSpec(
        "help",
        "/help [CMD]",
        "Show the commands, or the details of one",
        _help,
        aliases=("?",),
    ),
    CommandSpec(
        "temperature",
        "/temperature X",
        "Set the sampling temperature (0 = always the likeliest token)",
        _setting,
        details=_setting_details("temperature"),
    ),
    CommandSpec(
        "top_k",
        "/top_k K",
        "Sample only among the K likeliest tokens (0 = off)",
        _setting,
        details=_setting_details("top_k"),
    ),
    CommandSpec(
        "top_p",
        "/top_p P",
        "Sample from the likeliest tokens whose chances add up to P (1 = off)",
        _setting,
        details=_setting_details("top_p"),
    ),
    CommandSpec(
        "max_tokens",
        "/max_tokens N",
        "Set the longest reply, in tokens",
        _setting,
        details=_setting_details("max_tokens"),
    ),
    CommandSpec(
        "seed",
        "/seed N|random",
        "Fix the sampling seed, or pick a new random one each turn",
        _setting,
        details=_setting_details("seed"),
    ),
    CommandSpec(
        "system",
        "/system [TEXT|clear]",
        "Show, set or clear the system prompt",
        _system,
        details="Without text it shows the system prompt; /system clear removes it.",
    ),
    CommandSpec("settings", "/settings", "Show the current settings", _no_argument),
    CommandSpec(
        "set",
        "/set SETTING VALUE",
        "Change a setting, as ollama's /set does (/set temperature 0.7)",
        _set,
        details=(
            f"SETTING is one of {', '.join(SET_NAMES)}; /set SETTING VALUE does what "
            "/SETTING VALUE does, and /set SETTING alone shows it. ollama's /set parameter "
            "SETTING VALUE and num_predict (max_tokens) work too."
        ),
    ),
    CommandSpec(
        "show",
        "/show [WHAT]",
        "Show the settings and the model, as ollama's /show does",
        _show,
        details=(
            "Alone, the settings and the model; /show settings (or parameters), /show info "
            "(or model) and /show system show one of them."
        ),
    ),
    CommandSpec("clear", "/clear", "Start a new conversation", _no_argument),
    CommandSpec(
        "undo", "/undo", "Drop the last exchange (your message and the reply)", _no_argument
    ),
    CommandSpec("retry", "/retry", "Regenerate the last reply with a new seed", _no_argument),
    CommandSpec("continue", "/continue", "Continue an interrupted or cut-off reply", _no_argument),
    CommandSpec(
        "save",
        "/save [NAME]",
        "Name the conversation (alone: where it is saved)",
        _optional_text,
        details=(
            "Every turn is saved as it happens; /save NAME names the conversation, so "
            "--resume NAME and /load NAME find it."
        ),
    ),
    CommandSpec(
        "load",
        "/load NAME",
        "Load a saved conversation by name, id or id prefix",
        _load,
        details="/history lists the saved conversations.",
    ),
    CommandSpec("history", "/history", "List the saved conversations", _no_argument),
    CommandSpec(
        "export",
        "/export md|json PATH [--force]",
        "Write the conversation to PATH as Markdown or JSON",
        _export,
        details="A file at PATH already is left alone; --force at the end replaces it.",
    ),
    CommandSpec("stats", "/stats", "Show timings and token counts for each turn", _no_argument),
    CommandSpec(
        "tools",
        "/tools on|off",
        "Let the model use its calculator, or not",
        _setting,
        details=_setting_details("tools"),
    ),
    CommandSpec(
        "raw",
        "/raw on|off",
        "Show the special tokens in replies, or not",
        _setting,
        details=_setting_details("raw"),
    ),
    CommandSpec(
        "markdown",
        "/markdown auto|always|never",
        "Draw replies as Markdown: auto (on a colour terminal), always or never",
        _setting,
        details=_setting_details("markdown"),
    ),
    CommandSpec(
        "format",
        "/format text|json|FILE",
        "Replies as free text, any JSON object, or JSON following the JSON Schema in FILE",
        _reply_format,
        details="JSON replies need the structured extra (pip install 'chatcli[structured]') "
        "and do not call the calculator.",
    ),
    CommandSpec(
        "samples",
        "/samples N",
        "Next reply only: N alternatives side by side",
        _samples,
        details=f"N is a whole number between {SAMPLES_MIN} and {SAMPLES_MAX}.",
    ),
    CommandSpec(
        "probs",
        "/probs [N]",
        "Shade the last reply's tokens by probability; N: the alternatives at token N",
        _probs,
        details=(
            "The model's own probabilities at temperature 1, whatever /temperature samples "
            "with; the summary names the least likely tokens' positions."
        ),
    ),
    CommandSpec("model", "/model", "Show the loaded model", _no_argument),
    CommandSpec(
        "exit",
        "/exit",
        "Leave chatcli; Ctrl-D does too",
        _no_argument,
        aliases=("quit", "bye"),
    ),
)

COMMANDS: Mapping[str, CommandSpec] = {spec.name: spec for spec in _SPECS}
_BY_WORD: Mapping[str, CommandSpec] = {
    word: spec for spec in _SPECS for word in (spec.name, *spec.aliases)
}


def is_command(line: str) -> bool:
    """True for "/" followed by a letter or "?"; "//x" and "/ x" are messages ("/" alone
    is neither: the chat refuses it, see ChatCommands.handle)."""
    return len(line) >= 2 and line[0] == "/" and (line[1].isalpha() or line[1] == "?")


def unescape_message(line: str) -> str:
    """The message a line stands for: "//etc/hosts?" is sent as "/etc/hosts?"."""
    return line[1:] if line.startswith("//") else line


def _unknown(word: str) -> CommandError:
    message = f"Unknown command /{word}. Type /help for the list."
    key = word.lower().replace("-", "_")
    # A cut-short name (/temp) means the commands it starts; a typo (/tempreture), the closest.
    starts = [name for name in _BY_WORD if key and name.startswith(key)]
    close = starts if len(starts) <= 3 else []
    close = close or difflib.get_close_matches(key, list(_BY_WORD), n=1, cutoff=0.6)
    if close:
        names = [f"/{name}" for name in close]
        either = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        message += f" Did you mean {either}?"
    if "/" in word or "." in word:
        message += " To send a message that starts with /, begin it with //."
    return CommandError(message)


def find_command(word: str) -> CommandSpec:
    """The command a name or alias stands for ("quit", "/Top-K"), or CommandError."""
    key = word.removeprefix("/").lower().replace("-", "_")
    spec = _BY_WORD.get(key)
    if spec is None:
        raise _unknown(word.removeprefix("/"))
    return spec


def parse_command(line: str) -> Command:
    """Parse a line that is_command() accepts into a Command with its typed argument."""
    match = _COMMAND_LINE.match(line.strip())
    if not is_command(line.strip()) or match is None:
        raise CommandError(f"{line!r} is not a command: commands start with / and a letter.")
    spec = find_command(match["word"])
    rest = (match["rest"] or "").strip()
    arg = spec.parse(spec, rest)
    # /set and /show stand for another command: that one is what runs.
    return arg if isinstance(arg, Command) else Command(spec.name, arg)


def help_text(name: str | None = None) -> str:
    """The /help text: every command with its description, or the details of one."""
    if name is not None:
        spec = find_command(name)
        lines = [spec.usage, f"  {spec.description}."]
        if spec.details:
            lines.append(f"  {spec.details}")
        if spec.aliases:
            lines.append("  Also: " + ", ".join(f"/{alias}" for alias in spec.aliases))
        return "\n".join(lines)
    width = max(len(spec.usage) for spec in _SPECS) + 2
    lines = ["Commands:"]
    for spec in _SPECS:
        also = f" (also {', '.join('/' + a for a in spec.aliases)})" if spec.aliases else ""
        lines.append(f"  {spec.usage:<{width}}{spec.description}{also}")
    lines += [
        "",
        'Enter sends; Alt+Enter (or Esc then Enter) adds a new line; """ starts and ends a',
        "multi-line block. Ctrl-C stops a reply; Ctrl-D leaves. Start a message with // to",
        "send one that begins with /. Type /help CMD for the details of one command.",
    ]
    return "\n".join(lines)
