"""Fuzzing the values chatcli reads that are not files of weights: calculator expressions, slash
commands (parsed, and run in a chat whose files must stay in their folder), CHATCLI_*
environment values and the config file. Each starts from valid input and damages it; each
case either works as it should or ends in one ChatcliError (tests/fuzzing.py's contract).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("hypothesis", reason="needs the dev extra: pip install -e '.[dev]'")

from fakes import SPECIAL_IDS, ByteTokenizer, ScriptedModel, reply
from fuzzing import (
    Untouched,
    budget,
    fuzz,
    hostile_values,
    loads_or_one_error,
    mutated,
    time_limit,
)
from hypothesis import given
from hypothesis import strategies as st

from chatcli.chat.command_parsing import COMMANDS, SHOW_SETTING, Command, parse_command
from chatcli.chat.conversation_store import NewConversation
from chatcli.chat.session import ChatSession
from chatcli.chat.settings import (
    DEFAULTS,
    SETTING_NAMES,
    Settings,
    env_name,
    format_setting,
    load_settings,
    read_config_file,
    unknown_env_warnings,
    validate_setting,
)
from chatcli.chat.turns import SamplingOptions
from chatcli.chat.user_dirs import config_path, conversations_dir, history_path
from chatcli.engine.calculator import MAX_ABS_VALUE, use_calculator
from chatcli.errors import ChatcliError
from chatcli.model.special_tokens import ASSISTANT_END
from chatcli.terminal.slash_commands import ChatCommands

pytestmark = fuzz

# ---- the calculator --------------------------------------------------------------------------

numbers = st.one_of(
    st.integers(0, 10**6).map(str),
    st.integers(1000, 10**7).map(lambda n: f"{n:,}"),  # commas inside numbers are allowed
    st.decimals(0, 10**4, places=3, allow_nan=False).map(str),
)


def expressions(depth: int = 4) -> st.SearchStrategy[str]:
    """Arithmetic the calculator takes: numbers, + - * /, unary signs, parentheses, spaces."""
    return st.recursive(
        numbers,
        lambda inner: st.one_of(
            st.tuples(inner, st.sampled_from(["+", "-", "*", "/", " + ", " * "]), inner).map(
                "".join
            ),
            inner.map(lambda e: f"({e})"),
            inner.map(lambda e: f"-{e}"),
        ),
        max_leaves=depth * 3,
    )


def _python_value(expr: str) -> int | float | None:
    """What Python makes of the same arithmetic (our own generated text: safe to evaluate),
    or None where the calculator must refuse: a division by zero, or any value on the way
    (every subexpression) past its bound."""
    tree = ast.parse(expr.replace(",", ""), mode="eval")
    value = None
    for node in ast.walk(tree.body):  # the whole first, then each part
        if not isinstance(node, ast.expr):
            continue
        try:
            part = eval(compile(ast.Expression(node), "<expr>", "eval"), {"__builtins__": {}})
        except (ZeroDivisionError, OverflowError):
            return None
        if not math.isfinite(part) or abs(part) > MAX_ABS_VALUE:
            return None
        value = part if value is None else value
    return value


@given(expressions())
@budget(300)
def test_the_calculator_agrees_with_python_on_arithmetic(expr):
    with time_limit(5):
        got = use_calculator(expr)
    want = _python_value(expr)
    if want is None:
        assert got is None, (expr, got)
    else:
        assert got is not None and type(got) is type(want), (expr, got, want)
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=0), (expr, got, want)


@given(st.one_of(st.text(max_size=200), expressions().flatmap(lambda e: mutated_text(e))))
@budget(400)
def test_any_text_the_calculator_is_given_is_a_number_or_refused(expr):
    with time_limit(5):
        got = use_calculator(expr)
    assert got is None or (type(got) in (int, float) and abs(got) <= MAX_ABS_VALUE), (expr, got)


def mutated_text(text: str) -> st.SearchStrategy[str]:
    """`text` with a piece cut, inserted or repeated: near-valid expressions."""
    pieces = st.sampled_from(
        [
            "(",
            ")",
            "**",
            "'",
            '"',
            "\\",
            ",",
            "_",
            ".count(",
            "a",
            "1e999",
            "\x00",
            "lambda",
            "*" * 50,
        ]
    )
    return st.tuples(st.integers(0, len(text)), pieces, st.integers(1, 40)).map(
        lambda t: text[: t[0]] + t[1] * (t[2] if len(t[1]) == 1 else 1) + text[t[0] :]
    )


# ---- slash commands: parsed --------------------------------------------------------------------

COMMAND_NAMES = sorted(COMMANDS)
SETTING_COMMANDS = [n for n, spec in COMMANDS.items() if spec.parse.__name__ == "_setting"]


def command_lines() -> st.SearchStrategy[str]:
    """A command, by name or in another case, with an argument: a valid one damaged, a setting's
    value, or any text."""
    arguments = st.one_of(
        st.text(max_size=30),
        st.sampled_from(["0", "-1", "2.5", "off", "on", "random", "latest", "md x.md", "1e400"]),
        st.sampled_from(["nan", "inf", "9" * 30, "../../x", "/etc/passwd", '"quoted name"']),
        hostile_values().map(str),
    )
    name = st.sampled_from(COMMAND_NAMES).flatmap(
        lambda n: st.sampled_from([n, n.upper(), n.replace("_", "-")])
    )
    return st.tuples(name, st.sampled_from([" ", "  ", "\t"]), arguments).map(
        lambda t: f"/{t[0]}{t[1]}{t[2]}"
    )


@given(command_lines())
@budget(400)
def test_a_slash_command_parses_to_a_valid_value_or_one_error(line):
    command = loads_or_one_error(lambda: parse_command(line))
    if isinstance(command, ChatcliError):
        return
    assert isinstance(command, Command) and command.name in COMMANDS
    if command.name in SETTING_COMMANDS and command.arg is not SHOW_SETTING:
        # A setting's value is one its rule takes, and reads back to itself when written out.
        again = validate_setting(command.name, format_setting(command.name, command.arg), "x")
        assert again == command.arg or (command.arg != command.arg and again != again), line


# ---- slash commands: run in a chat, its files in their folder -------------------------------


class Screen:
    """A screen that records only the errors; the rest is drawn nowhere."""

    markdown_mode = "auto"

    def __init__(self) -> None:
        self.errors: list[str] = []

    def error(self, message: str) -> None:
        self.errors.append(message)

    def ask(self, question: str) -> str | None:
        return "1"

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: View() if name == "renderer" else None


class View:
    def handle(self, event: object) -> None:
        pass

    def finish(self, finish_reason: str) -> None:
        pass


# An error that is not one of chatcli's reaches the screen as "TypeName: what" (one_line).
NOT_OURS = re.compile(r"^[A-Za-z_.]*(Error|Exception|Interrupt|Exit)\b")


@given(st.lists(st.one_of(command_lines(), st.sampled_from(["hello", "//x"])), max_size=8))
@budget(60)
def test_any_run_of_slash_commands_answers_each_and_writes_only_its_files(tmp_path_factory, lines):
    root = tmp_path_factory.mktemp("chat")
    saved, cwd = root / "conversations", root / "cwd"
    saved.mkdir()
    cwd.mkdir()
    untouched = Untouched(root, allowed=(saved, cwd))
    model = ScriptedModel(reply([*b"fine", SPECIAL_IDS[ASSISTANT_END]]), sequence_len=512)
    options = SamplingOptions(temperature=0.0, top_k=None, max_tokens=8)
    session = ChatSession(model, ByteTokenizer(), options)
    screen = Screen()
    chat = ChatCommands(
        session, screen, Settings(history=False), NewConversation(saved), saved, {"tag": "x"}
    )
    here = os.getcwd()
    os.chdir(cwd)  # /export PATH writes where it is told: here, relative paths
    try:
        for line in lines:
            with time_limit(10):
                if not chat.handle(line):
                    break
    finally:
        os.chdir(here)
    assert not [e for e in screen.errors if NOT_OURS.match(e)], screen.errors
    untouched.check()


# ---- environment values and the config file --------------------------------------------------

VALID_ENV = {
    env_name(name): format_setting(name, getattr(DEFAULTS, name)) for name in SETTING_NAMES
}
VALID_ENV["CHATCLI_NO_HISTORY"] = "1"


def env_text() -> st.SearchStrategy[str]:
    # What an environment holds: text without NUL, surrogate escapes of undecodable bytes
    # included (os.environ decodes them so).
    return st.one_of(
        st.text(st.characters(blacklist_characters="\x00"), max_size=20),
        st.sampled_from(["0", "-1", "1e400", "nan", "inf", " 40 ", "off", "\udcff", "random"]),
        hostile_values().map(lambda v: json.dumps(v)[:40]),
    ).filter(lambda s: "\x00" not in s)


@st.composite
def environments(draw: st.DrawFn, root: Path) -> dict[str, str]:
    env = {k: v for k, v in VALID_ENV.items() if draw(st.booleans())}
    for key in draw(st.lists(st.sampled_from(sorted(VALID_ENV)), max_size=4)):
        env[key] = draw(env_text())
    for _ in range(draw(st.integers(0, 2))):  # a variable chatcli does not read
        env["CHATCLI_" + draw(st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ_", max_size=14))] = "1"
    # Where chatcli's files go: in the case's folder, or somewhere odd in it.
    for key in ("CHATCLI_HOME", "CHATCLI_CONVERSATIONS_DIR", "XDG_CONFIG_HOME"):
        if draw(st.booleans()):
            env[key] = str(root / draw(st.sampled_from(["home", "", "a/../b", "x" * 300])))
    env.setdefault("CHATCLI_HOME", str(root / "home"))
    return env


@given(st.data())
@budget(300)
def test_any_chatcli_environment_gives_settings_or_one_error(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("env")
    env = data.draw(environments(root))
    untouched = Untouched(root)
    settings = loads_or_one_error(lambda: load_settings(env=env))
    assert isinstance(settings, Settings | ChatcliError)
    warnings = loads_or_one_error(lambda: unknown_env_warnings(env))
    assert isinstance(warnings, list)
    for where in (config_path, conversations_dir, history_path):
        path = loads_or_one_error(lambda where=where: where(env))
        assert isinstance(path, Path | ChatcliError)
    untouched.check()


def toml_value(value: object) -> str | None:
    """A JSON-like value as TOML, or None where TOML has no way to say it (null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return (
            "nan"
            if value != value
            else ("inf" if value > 0 else "-inf")
            if math.isinf(value)
            else repr(value)
        )
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        items = [toml_value(v) for v in value]
        return "[" + ", ".join(i for i in items if i is not None) + "]"
    assert isinstance(value, dict)
    items = [(json.dumps(str(k)), toml_value(v)) for k, v in value.items()]
    return "{" + ", ".join(f"{k} = {v}" for k, v in items if v is not None) + "}"


VALID_CONFIG = {
    name: value
    for name in SETTING_NAMES
    if (value := getattr(DEFAULTS, name)) is not None or name in ("seed", "step")
}
VALID_CONFIG.update(seed="random", step="latest", model="d20", system="Be brief.")


@given(mutated(VALID_CONFIG, max_changes=3), st.booleans())
@budget(300)
def test_any_config_file_gives_settings_or_one_error(tmp_path_factory, config, raw_damage):
    root = tmp_path_factory.mktemp("config")
    path = root / "config.toml"
    if isinstance(config, dict):
        lines = [
            f"{json.dumps(str(k))} = {v}" for k, raw in config.items() if (v := toml_value(raw))
        ]
        text = "\n".join(lines) + "\n"
    else:
        text = f"value = {toml_value(config)}\n"
    if raw_damage:
        text = text.replace("=", "", 1).replace("]", "", 1)
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    untouched = Untouched(root)
    table = loads_or_one_error(lambda: read_config_file(path))
    if not isinstance(table, ChatcliError):
        assert isinstance(table, dict)
        settings = loads_or_one_error(lambda: Settings(**table))
        assert isinstance(settings, Settings)
        loaded = loads_or_one_error(lambda: load_settings(env={}, config_file=path))
        assert loaded == settings
    untouched.check()
