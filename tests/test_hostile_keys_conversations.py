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
from fakes import SPECIAL_IDS, ByteTokenizer, ScriptedModel, reply
from serving import END, scripted_worker, text_tokens
from typer.testing import CliRunner

from chatcli.chat.conversation_reader import read_conversation
from chatcli.chat.conversation_store import ConversationFile, NewConversation
from chatcli.chat.session import ChatSession
from chatcli.chat.settings import Settings
from chatcli.chat.turns import SamplingOptions
from chatcli.cli.app import app
from chatcli.errors import ConfigError
from chatcli.serve.app import Limits, create_app
from chatcli.serve.keys import KEY_FILE_MAX_BYTES, read_key_file
from chatcli.serve.runner import BackgroundServer
from chatcli.terminal.slash_commands import ChatCommands

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


# ---- conversations: rm, show and export take an id, found in the folder only -----------------


def conversations_folder(tmp_path: Path) -> Path:
    return tmp_path / "home" / "conversations"


def save(folder: Path, question: str, name: str | None = None) -> Path:
    file = ConversationFile.create(folder, model="d20")
    file.append_message({"role": "user", "content": question})
    file.append_message({"role": "assistant", "content": "Fine."}, {"finish_reason": "stop"})
    if name is not None:
        file.append_name(name)
    return file.path


@pytest.mark.parametrize("command", ["rm", "show", "export"])
def test_a_path_is_never_a_conversation_and_nothing_outside_the_folder_is_touched(
    tmp_path, monkeypatch, command
):
    kept = save(conversations_folder(tmp_path), "hi")
    work = tmp_path / "work" / "deep"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    notes = work / "notes.txt"
    notes.write_text("my notes\n")
    above = tmp_path / "x.txt"
    above.write_text("above\n")
    for wanted in ("./notes.txt", str(notes), "../../x.txt", str(kept), "..", f"../{kept.name}"):
        result = runner.invoke(app, ["conversations", command, wanted])
        one_error_line(result, repr(wanted), "is a path", str(conversations_folder(tmp_path)))
    assert notes.read_text() == "my notes\n" and above.read_text() == "above\n"
    assert kept.exists()


def test_a_file_in_the_working_directory_named_like_a_conversation_is_not_it(tmp_path, monkeypatch):
    folder = conversations_folder(tmp_path)
    saved = save(folder, "hi")
    monkeypatch.chdir(tmp_path)
    decoy = tmp_path / saved.name
    decoy.write_text("not a conversation, and not chatcli's\n")
    shown = runner.invoke(app, ["conversations", "show", saved.name])
    assert shown.exit_code == 0 and "> hi" in shown.stdout
    removed = runner.invoke(app, ["conversations", "rm", saved.name])
    assert removed.exit_code == 0, removed.output
    assert not saved.exists()  # the conversation went ...
    assert decoy.read_text() == "not a conversation, and not chatcli's\n"  # ... the decoy stays


def test_rm_leaves_a_file_of_the_folder_that_is_no_conversation(tmp_path):
    folder = conversations_folder(tmp_path)
    keep = save(folder, "hi")
    stray = folder / "stray.jsonl"
    stray.write_text('{"some": "other jsonl"}\n')
    result = runner.invoke(app, ["conversations", "rm", keep.stem, "stray"])
    one_error_line(result, "stray.jsonl", "is not a readable chatcli conversation")
    assert stray.exists() and keep.exists()  # each is checked before any is removed


def test_a_file_where_the_conversations_folder_belongs_is_said(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    loop = tmp_path / "loop"
    loop.symlink_to(loop.name)
    for folder, why in [
        (afile, "is a file, not a folder"),
        (afile / "sub", "is a file, not a folder"),
        (loop, "leads back to itself"),
    ]:
        monkeypatch.setenv("CHATCLI_CONVERSATIONS_DIR", str(folder))
        for args in (["conversations"], ["conversations", "show", "last"]):
            line = one_error_line(runner.invoke(app, args), str(folder), why)
            assert "No saved conversations" not in line
    assert afile.read_text() == "x"


def test_a_conversations_folder_that_cannot_be_read_is_one_line_in_the_list(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads a folder of mode 000; the same line is checked with a loop above")
    folder = conversations_folder(tmp_path)
    save(folder, "hi")
    folder.chmod(0)
    try:
        one_error_line(runner.invoke(app, ["conversations"]), str(folder), "permission denied")
    finally:
        folder.chmod(0o700)


# ---- exports never replace a file unasked ----------------------------------------------------


def test_conversations_export_refuses_an_existing_file_without_force(tmp_path):
    saved = save(conversations_folder(tmp_path), "hi")
    out = tmp_path / "chat.md"
    out.write_text("precious\n")
    args = ["conversations", "export", saved.stem, "-o", str(out)]
    one_error_line(runner.invoke(app, args), str(out), "exists already", "add --force")
    assert out.read_text() == "precious\n"
    link = tmp_path / "link.md"
    link.symlink_to(tmp_path / "nowhere.md")  # a link to nothing is something there too
    args[-1] = str(link)
    one_error_line(runner.invoke(app, args), str(link), "exists already")
    assert not (tmp_path / "nowhere.md").exists()
    forced = runner.invoke(app, ["conversations", "export", saved.stem, "-o", str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    assert out.read_text().startswith("**You:**\n\nhi\n")


def chat_commands(tmp_path: Path) -> tuple[ChatCommands, ChatSession, list]:
    """ChatCommands over a real ChatSession whose scripted model answers "fine"."""
    model = ScriptedModel(reply([*b"fine", SPECIAL_IDS["<|assistant_end|>"]]), 256)
    session = ChatSession(model, ByteTokenizer(), SamplingOptions(temperature=0.0, seed=1))
    screen = RecordingScreen()
    folder = conversations_folder(tmp_path)
    conversation = NewConversation(folder, model="d4")
    commands = ChatCommands(session, screen, Settings(history=False), conversation, folder, {})
    return commands, session, screen.said


class RecordingScreen:
    """What a chat shows, as (kind, text); the reply's text itself is left out."""

    def __init__(self) -> None:
        self.said: list[tuple[str, str]] = []

    def renderer(self, raw: bool = False):
        return self

    def handle(self, event) -> None:
        pass

    def finish(self, finish_reason: str) -> None:
        pass

    def status(self, stats) -> None:
        pass

    def notice(self, message: str) -> None:
        self.said.append(("notice", message))

    def error(self, message: str) -> None:
        self.said.append(("error", message))


def test_slash_export_refuses_an_existing_file_unless_it_ends_in_force(tmp_path):
    commands, _, said = chat_commands(tmp_path)
    commands.handle("hello")
    out = tmp_path / "chat.md"
    out.write_text("precious\n")
    commands.handle(f"/export md {out}")
    assert said[-1] == (
        "error",
        f"{out} exists already; it is left as it was. Pick another path, or end the command "
        "with --force to replace it.",
    )
    assert out.read_text() == "precious\n"
    commands.handle(f"/export md {out} --force")
    assert said[-1] == ("notice", f"Wrote 2 messages to {out} as Markdown.")
    assert out.read_text().startswith("**You:**\n\nhello\n")


def test_a_chat_whose_file_was_removed_says_so_and_saves_it_anew_with_a_header(tmp_path):
    commands, session, said = chat_commands(tmp_path)
    commands.handle("one")
    first = commands.conversation.path
    first.unlink()  # chatcli conversations rm, from another terminal
    commands.handle("two")
    assert not first.exists()  # no headless fragment where the old file was
    anew = commands.conversation.path
    assert anew != first and anew.parent == first.parent
    assert said == [
        (
            "notice",
            f"{first} was removed while this chat ran; the conversation so far is saved anew "
            f"as {anew.stem} ({anew}).",
        )
    ]
    loaded = read_conversation(anew)
    assert loaded.warnings == [] and loaded.header["type"] == "header"
    assert loaded.messages == session.messages  # every message once, both turns
    assert [m["content"] for m in loaded.messages if m["role"] == "user"] == ["one", "two"]
    commands.handle("three")  # and it goes on in the new file
    assert len(read_conversation(anew).messages) == 6


# ---- request bodies -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hello():
    worker = scripted_worker(reply([*text_tokens("Hello!"), END]))
    server = BackgroundServer(create_app([worker], Limits(), "scripted")).start()
    yield server
    server.stop()


HI = '"messages": [{"role": "user", "content": "hi"}]'
NINES = "9" * 5000


@pytest.mark.parametrize(
    "body",
    [
        f'{{{HI}, "max_tokens": {NINES}}}',
        f'{{{HI}, "seed": -{NINES[:4301]}}}',
        f'{{"messages": [{{"role": "user", "content": {NINES}}}]}}',
        f'{{{HI}, "unknown": [{"7" * 100_000}]}}',
    ],
)
def test_a_number_past_pythons_digit_limit_is_a_400_in_openai_shape(hello, body):
    url, headers = f"{hello.url}/v1/chat/completions", {"Content-Type": "application/json"}
    response = httpx.post(url, content=body, headers=headers, timeout=30)
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "The body holds a number with thousands of digits; no field takes one.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    ordinary = httpx.post(url, content=f"{{{HI}}}", headers=headers, timeout=30)
    assert ordinary.status_code == 200  # the server goes on


# ---- standard output full or closed ---------------------------------------------------------


def cli_writing_to(stdout, args: list[str], **popen) -> tuple[int, str]:
    """(exit code, stderr) of chatcli in its own process, its stdout sent to `stdout`."""
    process = subprocess.Popen(
        [sys.executable, "-m", "chatcli", *args],
        cwd=ROOT,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )
    if stdout == subprocess.PIPE:
        process.stdout.close()  # the reader leaves before chatcli writes a line
    _, stderr = process.communicate(timeout=120)
    return process.returncode, stderr


def full_device():
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    return open("/dev/full", "w")


FULL = (
    "Error: Cannot write to standard output: the disk or device it goes to is full (No space "
    "left on device). The output is incomplete.\n"
)


@pytest.mark.parametrize("args", [["config", "path"], ["--help"]])
def test_stdout_full_is_one_line_and_exit_1(args):
    with full_device() as full:
        assert cli_writing_to(full, args) == (1, FULL)


def test_a_reply_to_a_full_stdout_is_one_line_and_exit_1(hello):
    with full_device() as full:
        assert cli_writing_to(full, ["once", "hi", "--url", hello.url]) == (1, FULL)


def test_stdout_closed_by_its_reader_is_one_line_and_exit_1():
    code, stderr = cli_writing_to(subprocess.PIPE, ["--help"])
    assert (code, stderr) == (
        1,
        "Error: Cannot write to standard output: its reader closed it before chatcli finished "
        "writing (Broken pipe). The output is incomplete.\n",
    )


def test_stdout_closed_before_the_start_is_one_line_and_exit_1():
    code, stderr = cli_writing_to(subprocess.DEVNULL, ["config", "path"], preexec_fn=_close_1)
    assert code == 1
    assert stderr == (
        "Error: Standard output is closed, and chatcli writes its replies and lists there. Run "
        "it with stdout open, or send it to /dev/null (> /dev/null) to drop them.\n"
    )


def _close_1() -> None:
    os.close(1)


# ---- beyond the list ----------------------------------------------------------------


def test_a_key_file_written_with_a_byte_order_mark_and_crlf_gives_its_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_bytes(b"\xef\xbb\xbfsk-one\r\n# note\r\nsk two words\r\n")
    assert read_key_file(path) == ["sk-one", "sk two words"]


def test_a_huge_file_among_the_conversations_is_listed_unread(tmp_path):
    from chatcli.chat.conversation_reader import CONVERSATION_MAX_BYTES

    folder = conversations_folder(tmp_path)
    kept = save(folder, "hi")
    huge = folder / "huge.jsonl"
    with huge.open("wb") as f:
        f.truncate(CONVERSATION_MAX_BYTES + 1)  # sparse: neither disk nor memory
    listed = runner.invoke(app, ["conversations"])
    assert listed.exit_code == 0, listed.output
    assert kept.stem in listed.stdout
    assert "huge" in listed.stdout and "(unreadable:" in listed.stdout
    one_error_line(runner.invoke(app, ["conversations", "show", "huge"]), "far more than")


def test_an_export_onto_a_folder_says_it_is_a_folder_forced_or_not(tmp_path):
    saved = save(conversations_folder(tmp_path), "hi")
    args = ["conversations", "export", saved.stem, "-o", str(tmp_path)]
    for extra in ([], ["--force"]):
        line = one_error_line(runner.invoke(app, [*args, *extra]), str(tmp_path))
        assert line.endswith("is a folder; give the path of a file to write.")
