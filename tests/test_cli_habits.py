"""The flags other tools' users type first: --temp, the same short flags on every command, the
nearest option named for a misspelt one, and exit code 2 for a usage error, 1 for a command
that failed, on every command. Through the real CLI."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.cli.options import nearest_options

runner = CliRunner()

# The short flags, each the same option on every command that has it.
SHORT = {"-m": "model", "-t": "temperature", "-k": "top_k", "-n": "max_tokens", "-s": "system"}


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in ("CHATCLI_TEMPERATURE", "CHATCLI_MODEL", "CHATCLI_CONFIG", "CHATCLI_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("CHATCLI_API_KEY", raising=False)


def commands() -> dict[str, object]:
    """Every command's click object by its path (`chat`, `config path`, ...)."""
    root = typer.main.get_command(app)
    found = {}

    def walk(group, prefix):
        for name, command in group.commands.items():
            path = f"{prefix}{name}"
            if hasattr(command, "commands"):
                found[path] = command
                walk(command, path + " ")
            else:
                found[path] = command

    walk(root, "")
    return found


def test_short_flags_mean_the_same_option_on_every_command():
    seen: dict[str, set[str]] = {}
    for path, command in commands().items():
        shorts = []
        for param in command.params:
            for opt in [*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())]:
                if len(opt) == 2 and opt.startswith("-"):
                    shorts.append(opt)
                    seen.setdefault(opt, set()).add(param.name)
        assert len(shorts) == len(set(shorts)), (path, shorts)  # no clash within a command
    for flag, name in SHORT.items():
        assert seen[flag] == {name}, flag
    for path in ("chat", "once"):
        names = {p.name: p.opts for p in commands()[path].params}
        for flag, name in SHORT.items():
            assert flag in names[name], (path, flag)
        assert "--temp" in names["temperature"]
    assert "-m" in {o for p in commands()["serve"].params for o in p.opts}


@pytest.mark.parametrize(
    "flags",
    [
        ["--temperature", "0.3", "--top-k", "7", "--max-tokens", "9", "--system", "Be brief."],
        ["--temp", "0.3", "-k", "7", "-n", "9", "-s", "Be brief."],
        ["-t", "0.3", "-k7", "-n9", "-sBe brief."],
    ],
)
def test_long_short_and_alias_flags_set_the_same_settings(flags):
    result = runner.invoke(app, ["chat", *flags], input="/settings\n")
    assert result.exit_code == 0, result.output
    table = {
        line.split()[0]: " ".join(line.split()[1:])
        for line in result.stdout.splitlines()
        if line.split()
    }
    assert (table["temperature"], table["top_k"], table["max_tokens"]) == ("0.3", "7", "9")
    assert table["system"] == "Be brief."


def test_once_takes_the_short_flags_and_the_alias():
    long = ["once", "What is 1234*56?", "--temperature", "0", "--max-tokens", "6", "--json"]
    short = ["once", "What is 1234*56?", "--temp", "0", "-n", "6", "-k", "5", "--json"]
    a, b = runner.invoke(app, long), runner.invoke(app, short)
    assert a.exit_code == b.exit_code == 0, b.output
    assert json.loads(a.stdout)["usage"] == json.loads(b.stdout)["usage"]
    assert json.loads(b.stdout)["usage"]["completion_tokens"] <= 6
    assert json.loads(a.stdout)["text"] == json.loads(b.stdout)["text"]  # greedy: the same


def test_the_system_prompt_flag_reaches_a_server(tmp_path):
    pytest.importorskip("fastapi")
    from serving import END, scripted_worker, serve_workers

    worker = scripted_worker(lambda history: END)
    server = serve_workers([worker])
    try:
        result = runner.invoke(
            app, ["once", "hi", "--url", server.url, "-s", "Be brief.", "-n", "3"]
        )
    finally:
        server.stop()
    assert result.exit_code == 0, result.output
    prompt = worker.tokenizer.decode(worker.engine.model.histories[-1])
    assert "Be brief.\n\nhi" in prompt


# ---- an unknown option names the nearest -------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "wrong", "near"),
    [
        (["chat", "--temprature", "1"], "--temprature", "--temperature"),
        (["chat", "--max_tokens", "3"], "--max_tokens", "--max-tokens"),
        (["once", "hi", "--top_k", "3"], "--top_k", "--top-k"),
        (["once", "hi", "--max", "3"], "--max", "--max-tokens"),
        (["once", "hi", "--temperatur", "1"], "--temperatur", "--temperature"),
        (["once", "hi", "--systen", "x"], "--systen", "--system"),
        (["serve", "--api_key", "k"], "--api_key", "--api-key"),
        (["serve", "--prot", "80"], "--prot", "--port"),
        (["models", "--base_dir", "x"], "--base_dir", "--base-dir"),
        (["bench", "--synthetc", "d4"], "--synthetc", "--synthetic"),
        (["conversations", "export", "x", "--fromat", "md"], "--fromat", "--format"),
    ],
)
def test_an_unknown_option_names_the_nearest_one_and_exits_2(args, wrong, near):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    command = " ".join(a for a in args[:2] if not a.startswith("-") and a not in ("hi", "x"))
    assert result.stderr == (
        f"Error: No such option: {wrong}. Did you mean {near}? See chatcli {command} --help.\n"
    )


@pytest.mark.parametrize("args", [["once", "hi", "--zzz"], ["chat", "-x"], ["serve", "--q"]])
def test_an_option_near_none_names_none(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "Did you mean" not in result.stderr and "Possible options" not in result.stderr


def test_nearest_options_prefer_the_same_words_then_those_begun_then_the_closest():
    options = ["--temperature", "--top-k", "--top-p", "--max-tokens", "--help", "-h", "-t"]
    assert nearest_options("--max_tokens", options) == ["--max-tokens"]
    assert nearest_options("--TOP-K", options) == ["--top-k"]
    assert nearest_options("--tem", options) == ["--temperature"]
    assert nearest_options("--top", options) == ["--top-k", "--top-p"]  # begins both
    assert nearest_options("--temperture", options) == ["--temperature"]
    assert nearest_options("-x", options) == []
    assert nearest_options("--quux", options) == []


def test_an_option_that_begins_two_names_both():
    result = runner.invoke(app, ["once", "hi", "--top", "5"])
    assert result.exit_code == 2
    assert "Did you mean --top-k or --top-p?" in result.stderr


# ---- exit codes: 2 for the command line, 1 for a command that failed -------------------------


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["chta"], 2),
        (["--bogus"], 2),
        (["chat", "--max-tokens", "0"], 2),
        (["chat", "--top-p", "2"], 2),
        (["chat", "--url", "http://127.0.0.1:9", "--device", "cpu"], 2),
        (["chat", "--resume", "no-such-conversation"], 1),
        (["once", "hi", "-t", "9"], 2),
        (["once", "hi", "--seed", "-1"], 2),
        (["once", "hi", "--markdown", "sometimes"], 2),
        (["once", "hi", "--model", "/no/such/model"], 1),
        (["once", "hi", "--url", "http://127.0.0.1:9"], 1),
        (["models", "--base-dir", "/no/such/folder"], 2),
        (["serve", "--port", "70000"], 2),
        (["serve", "--workers", "0"], 2),
        (["serve", "--cache-slots", "0"], 2),
        (["serve", "--api-key", ""], 2),
        (["serve", "--api-key-file", "/no/such/keys"], 1),
        (["serve", "--model", "/no/such/model", "--port", "0"], 1),
        (["bench", "--synthetic", "d99"], 2),
        (["bench", "--quantize", "int3"], 2),
        (["bench", "--device", "tpu"], 2),
        (["bench", "--model", "/no/such/model"], 1),
        (["config", "path", "extra"], 2),
        (["config", "nope"], 2),
        (["conversations", "show", "nope"], 1),
        (["conversations", "rm", "nope"], 1),
        (["conversations", "show"], 2),
        (["conversations", "export", "nope", "--format", "xml"], 2),
        (["conversations", "export", "nope"], 1),
    ],
)
def test_every_command_exits_2_for_a_usage_error_and_1_for_a_failure(args, code):
    result = runner.invoke(app, args, input="hi\n")
    assert result.exit_code == code, result.output
    assert result.stderr.startswith("Error: ")
    assert "Traceback" not in result.output


def test_a_bad_value_in_the_config_file_or_the_environment_is_not_a_usage_error(
    tmp_path, monkeypatch
):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text("temperature = 9\n")
    assert runner.invoke(app, ["once", "hi"]).exit_code == 1
    (home / "config.toml").write_text("")
    monkeypatch.setenv("CHATCLI_TEMPERATURE", "9")
    assert runner.invoke(app, ["once", "hi"]).exit_code == 1
    # The flag is checked first: a usage error, whatever the other sources hold.
    assert runner.invoke(app, ["once", "hi", "-t", "7"]).exit_code == 2
