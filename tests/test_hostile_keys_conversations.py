"""Hostile and careless input to a server's keys, the saved conversations, request bodies and
the output streams: each ends as it should (one key stays one key, a file that is not a
conversation is never deleted, a 400 rather than a 500) or in one clear line on stderr and
exit code 1, never a traceback or a hang."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="needs the serve extra: pip install -e '.[serve]'")

import httpx
from fakes import reply
from serving import END, scripted_worker, text_tokens
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.errors import ConfigError
from chatcli.serve.app import Limits, create_app
from chatcli.serve.keys import KEY_FILE_MAX_BYTES, read_key_file
from chatcli.serve.runner import BackgroundServer

ROOT = Path(__file__).resolve().parent.parent
PHRASE = "correct horse battery staple"
runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in [k for k in os.environ if k.startswith("CHATCLI_") and k != "CHATCLI_HOME"]:
        if name != "CHATCLI_REFERENCE_FIXTURES":
            monkeypatch.delenv(name)


def one_error_line(result, *names: str, code: int = 1) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == code, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def run_real_cli(
    args: list[str], env: dict[str, str], timeout: float = 120, **kw
) -> subprocess.CompletedProcess:
    """The chatcli command in a process of its own: a hang is a timeout, not a stuck suite."""
    return subprocess.run(
        [sys.executable, "-m", "chatcli", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


# ---- server keys ----------------------------------------------------------------------------


def _serve_args(monkeypatch, *args: str) -> tuple[object, dict]:
    """`chatcli serve ARGS` with the server itself replaced: what it was handed."""
    import chatcli.serve.runner

    seen: dict = {}
    monkeypatch.setattr(chatcli.serve.runner, "serve", lambda model, **kw: seen.update(kw))
    return runner.invoke(app, ["serve", *args]), seen


def test_a_pass_phrase_in_the_environment_is_one_key_not_one_per_word(monkeypatch):
    monkeypatch.setenv("CHATCLI_API_KEY", f"  {PHRASE}\n")
    result, seen = _serve_args(monkeypatch)
    assert result.exit_code == 0, result.output
    assert seen["api_keys"] == (PHRASE,)
    result, seen = _serve_args(monkeypatch, "--api-key", "k-flag")
    assert seen["api_keys"] == ("k-flag",)  # the flag still wins over the variable


@pytest.mark.parametrize("blank", ["", "   ", "\t\n"])
def test_a_blank_key_in_the_environment_is_refused_at_start(monkeypatch, blank):
    monkeypatch.setenv("CHATCLI_API_KEY", blank)
    result, seen = _serve_args(monkeypatch, "--host", "0.0.0.0")
    one_error_line(result, "CHATCLI_API_KEY", "is blank")
    assert seen == {}  # no server, least of all one without a key


def test_a_server_with_a_pass_phrase_lets_in_the_whole_phrase_only():
    worker = scripted_worker(reply([*text_tokens("Hello!"), END]))
    server = BackgroundServer(create_app([worker], Limits(), "scripted", api_keys=(PHRASE,)))
    with server:
        url = f"{server.url}/v1/models"
        assert httpx.get(url, headers={"Authorization": f"Bearer {PHRASE}"}).status_code == 200
        for word in PHRASE.split():
            assert httpx.get(url, headers={"Authorization": f"Bearer {word}"}).status_code == 401
        # chatcli's own client sends the variable's phrase whole, as the server reads it.
        result = runner.invoke(
            app, ["once", "hi", "--url", server.url], env={"CHATCLI_API_KEY": PHRASE}
        )
        assert result.stdout == "Hello!\n", result.output


def test_a_key_file_line_with_spaces_is_one_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# team\n{PHRASE}\n  sk-second  \n")
    assert read_key_file(path) == [PHRASE, "sk-second"]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_key_file_others_may_read_starts_with_a_warning_like_ssh(monkeypatch, tmp_path, mode):
    path = tmp_path / "keys"
    path.write_text("sk-one\n")
    path.chmod(mode)
    result, seen = _serve_args(monkeypatch, "--api-key-file", str(path))
    assert result.exit_code == 0, result.output
    assert seen["api_keys"] == ("sk-one",)
    assert result.stderr.splitlines() == [
        f"Warning: --api-key-file {path} has permissions {mode:04o}: other users of this "
        f"machine can read (or change) its keys. Run chmod 600 {path}."
    ]
    path.chmod(0o600)
    result, seen = _serve_args(monkeypatch, "--api-key-file", str(path))
    assert result.stderr == ""


def _fifo(tmp_path: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes on this system")
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_a_key_file_that_never_ends_or_waits_for_a_writer_is_refused_at_once(tmp_path):
    # Each in a process of its own, under a timeout: the old reading hung on the FIFO and
    # filled memory from /dev/zero.
    big = tmp_path / "big"
    with big.open("wb") as f:
        f.truncate(KEY_FILE_MAX_BYTES + 1)  # sparse: costs no disk
    cases = [
        (_fifo(tmp_path), "is a named pipe (FIFO), not a file"),
        (big, "is more than 1,048,576"),
    ]
    if Path("/dev/zero").exists():
        cases.append((Path("/dev/zero"), "is a device, not a file"))
    for path, why in cases:
        done = run_real_cli(["serve", "--api-key-file", str(path), "--port", "1"], {}, 60)
        lines = done.stderr.splitlines()
        assert done.returncode == 1, done.stderr
        assert len(lines) == 1 and lines[0].startswith(f"Error: --api-key-file {path} {why}")
        assert lines[0].endswith("; it takes a file of one key a line.")


@pytest.mark.parametrize("key", ["clé-secrète", "tab\there"])
def test_a_client_key_no_header_can_carry_is_one_line(key):
    result = runner.invoke(app, ["once", "hi", "--url", "http://127.0.0.1:9", "--api-key", key])
    one_error_line(result, "--api-key (or CHATCLI_API_KEY)", "printable ASCII")


def test_read_key_file_refuses_what_is_not_a_file_before_reading(tmp_path):
    with pytest.raises(ConfigError, match="named pipe"):
        read_key_file(_fifo(tmp_path))
    assert stat.S_ISFIFO((tmp_path / "pipe").stat().st_mode)  # left as it was


# ---- the config file ------------------------------------------------------------------------


def test_a_config_file_that_never_ends_or_waits_for_a_writer_is_one_line(tmp_path):
    cases = [(_fifo(tmp_path), "is a named pipe (FIFO), not a file")]
    if Path("/dev/zero").exists():
        cases.append((Path("/dev/zero"), "is a device, not a file"))
    for path, why in cases:
        done = run_real_cli(["once", "hi"], {"CHATCLI_CONFIG": str(path)}, 60)
        assert done.returncode == 1, done.stderr
        assert done.stderr.splitlines() == [
            f"Error: config file {path}: {why}. Fix it or point CHATCLI_CONFIG at another file."
        ]


def test_dev_null_as_the_config_file_is_an_empty_one(tmp_path):
    if not Path(os.devnull).exists():
        pytest.skip("no null device")
    from chatcli.chat.settings import DEFAULTS, load_settings

    assert load_settings(env={"CHATCLI_CONFIG": os.devnull}) == DEFAULTS
