"""ChatCommands (terminal/slash_commands.py) on its own: no prompt, no Rich. A fake screen
records what would be drawn and answers /samples' question from a script; a small fake
session stands in for ChatSession.

The full REPL, keys and drawing included, is driven end to end in test_repl.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from fakes import SPECIAL_IDS, ByteTokenizer, ScriptedModel
from fakes import reply as scripted

from chatcli.chat.conversation_store import ConversationFile, read_conversation
from chatcli.chat.session import ChatSession
from chatcli.chat.settings import Settings
from chatcli.chat.stream import StreamEvent, TextDelta
from chatcli.chat.turns import Reply, SamplingOptions, TurnNotice, TurnStats
from chatcli.terminal.slash_commands import ChatCommands


class FakeView:
    def __init__(self, screen: FakeScreen) -> None:
        self.screen = screen

    def handle(self, event: StreamEvent) -> None:
        assert isinstance(event, TextDelta)
        self.screen.drawn.append(("text", event.text))

    def finish(self, finish_reason: str) -> None:
        self.screen.drawn.append(("finish", finish_reason))


class FakeScreen:
    """Records each drawing call as (kind, value); `answers` are typed at /samples' question."""

    def __init__(self, *answers: str | None) -> None:
        self.answers = list(answers)
        self.markdown_mode = "auto"
        self.questions: list[str] = []
        self.drawn: list[tuple[str, object]] = []

    def renderer(self, raw: bool = False) -> FakeView:
        self.drawn.append(("renderer", "raw" if raw else "rendered"))
        return FakeView(self)

    def notice(self, message: str) -> None:
        self.drawn.append(("notice", message))

    def error(self, message: str) -> None:
        self.drawn.append(("error", message))

    def status(self, stats: Mapping[str, object]) -> None:
        self.drawn.append(("status", stats["tokens_out"]))

    def text(self, message: str) -> None:
        self.drawn.append(("text", message))

    def interrupted(self) -> None:
        self.drawn.append(("interrupted", None))

    def table(self, headers: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
        self.drawn.append(("table", dict(rows)))

    def replies(
        self, replies: Sequence[tuple[Sequence[Mapping[str, str]], str]], tools: bool = True
    ) -> None:
        self.drawn.append(("replies", [(parts[0]["text"], sub) for parts, sub in replies]))

    def ask(self, question: str) -> str | None:
        self.questions.append(question)
        return self.answers.pop(0)

    def recap(self, messages: Sequence[Mapping[str, object]]) -> None:
        self.drawn.append(("recap", len(messages)))


def reply(text: str) -> Reply:
    n = len(text.split())
    stats = TurnStats(tokens_in=3, tokens_out=n, finish_reason="stop", seed=7)
    return Reply([{"type": "text", "text": text}], list(range(n)), [1] * n, stats)


class FakeSession:
    """Each turn or sample takes the next scripted reply text."""

    can_sample_replies = True
    can_show_raw = False

    def __init__(self, *replies: str) -> None:
        self.replies = list(replies)
        self.options = SamplingOptions()
        self.system: str | None = None
        self.entries: list[dict] = []
        self.last_reply: Reply | None = None
        self.history_stats: list[TurnStats] = []
        self.context_len = 256

    @property
    def messages(self) -> list[dict]:
        return list(self.entries)

    @property
    def transcript(self) -> tuple[list[dict], list[str | None]]:
        return self.messages, [None] * len(self.messages)

    def send(self, text: str) -> Iterator[StreamEvent]:
        self.entries.append({"role": "user", "content": text})
        done = reply(self.replies.pop(0))
        yield TextDelta(done.text)
        self.accept_reply(done)

    def sample_replies(self, text: str, n: int) -> list[Reply]:
        self.entries.append({"role": "user", "content": text})
        return [reply(self.replies.pop(0)) for _ in range(n)]

    def accept_reply(self, reply: Reply) -> None:
        self.entries.append(reply.message)
        self.last_reply = reply
        self.history_stats.append(reply.stats)

    def undo(self) -> bool:
        users = [i for i, m in enumerate(self.entries) if m["role"] == "user"]
        if users:
            del self.entries[users[-1] :]
        return bool(users)

    def take_notices(self) -> list[TurnNotice]:
        return []


def commands(
    session: FakeSession, screen: FakeScreen, tmp_path: Path
) -> tuple[ChatCommands, ConversationFile]:
    conversation = ConversationFile.create(tmp_path, model="fake")
    model_info = {"tag": "d4", "params": 1234567}
    runner = ChatCommands(
        session, screen, Settings(history=False), conversation, tmp_path, model_info
    )
    return runner, conversation


def test_a_message_streams_to_the_screen_then_shows_status_and_is_saved(tmp_path):
    screen = FakeScreen()
    runner, conversation = commands(FakeSession("Hello there"), screen, tmp_path)
    assert runner.handle("hi") is True
    assert screen.drawn == [
        ("renderer", "rendered"),
        ("text", "Hello there"),
        ("finish", "stop"),
        ("status", 2),
    ]
    assert read_conversation(conversation.path).messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello there"}]},
    ]


def test_samples_asks_through_the_screen_until_the_answer_is_a_choice(tmp_path):
    screen = FakeScreen("7", "2")
    session = FakeSession("first one", "second one")
    runner, conversation = commands(session, screen, tmp_path)
    runner.handle("/samples 2")
    runner.handle("pick one")
    assert screen.questions == ["Keep which reply? [1-2, Enter=1, 0=none] "] * 2
    assert screen.drawn[1:] == [
        ("replies", [("first one", "2 tok · stop"), ("second one", "2 tok · stop")]),
        ("error", "Type a number from 0 to 2, or /exit to leave; got '7'."),
        ("notice", "Kept reply 2."),
        ("status", 2),
    ]
    assert read_conversation(conversation.path).messages[-1]["content"][0]["text"] == "second one"


def test_samples_declined_at_the_question_keeps_nothing(tmp_path):
    screen = FakeScreen(None)  # Ctrl-D at the question
    session = FakeSession("a", "b")
    runner, conversation = commands(session, screen, tmp_path)
    runner.handle("/samples 2")
    runner.handle("q")
    assert screen.drawn[-1] == ("notice", "Kept none; your message was dropped too.")
    assert session.entries == []
    assert read_conversation(conversation.path).messages == []


def test_a_bad_command_prints_one_error_and_exit_says_leave(tmp_path):
    screen = FakeScreen()
    runner, _ = commands(FakeSession(), screen, tmp_path)
    assert runner.handle("/undo now") is True
    assert screen.drawn == [
        ("error", "/undo takes no arguments, got 'now'. Usage: /undo"),
    ]
    assert runner.handle("/exit") is False


def test_a_lone_slash_is_not_sent_to_the_model(tmp_path):
    screen = FakeScreen()
    session = FakeSession("Hello")
    runner, _ = commands(session, screen, tmp_path)
    assert runner.handle(" / ") is True
    assert screen.drawn == [
        ("error", "/ alone is not a command: /help lists them (// sends a single /)."),
    ]
    assert session.entries == []
    runner.handle("//")  # the escape: a message of one slash
    assert session.entries[0] == {"role": "user", "content": "/"}


def test_model_table_formats_large_counts(tmp_path):
    screen = FakeScreen()
    runner, _ = commands(FakeSession(), screen, tmp_path)
    runner.handle("/model")
    assert screen.drawn == [("table", {"tag": "d4", "params": "1,234,567"})]


def test_raw_on_asks_for_a_raw_view_where_the_session_can_show_special_tokens(tmp_path):
    class RawSession(FakeSession):
        can_show_raw = True
        raw = False

    screen = FakeScreen()
    runner, _ = commands(RawSession("a", "b"), screen, tmp_path)
    runner.handle("/raw on")
    runner.handle("hi")
    runner.handle("/raw off")
    runner.handle("again")
    views = [value for kind, value in screen.drawn if kind == "renderer"]
    assert views == ["raw", "rendered"]


def test_samples_against_a_server_is_refused_when_typed_not_after_the_message(tmp_path):
    pytest.importorskip("httpx")
    from chatcli.serve.client import RemoteSession

    screen = FakeScreen()
    server = RemoteSession("http://127.0.0.1:9")  # never contacted: the refusal comes first
    runner, _ = commands(server, screen, tmp_path)
    assert runner.handle("/samples 3") is True
    assert screen.drawn == [
        ("error", "/samples is not supported against a server; it needs a local model.")
    ]
    assert runner.samples_next is None  # the next message is an ordinary turn


def real_session(
    tmp_path: Path, context: int
) -> tuple[ChatSession, FakeScreen, ChatCommands, ConversationFile]:
    """Commands over a real ChatSession whose scripted model answers "fine" in a context of
    `context` tokens: what it drops to make room, and when, is the session's own."""
    model = ScriptedModel(scripted([*b"fine", SPECIAL_IDS["<|assistant_end|>"]]), context)
    session = ChatSession(model, ByteTokenizer(), SamplingOptions(temperature=0.0, seed=1))
    screen = FakeScreen()
    runner, conversation = commands(session, screen, tmp_path)
    return session, screen, runner, conversation


def test_save_and_export_write_the_exchanges_the_context_dropped_too(tmp_path):
    # A 96-token context: each ~30-token exchange pushes older ones out of the model's view.
    session, screen, runner, conversation = real_session(tmp_path, context=96)
    for i in range(6):
        runner.handle(f"question number {i}")
    assert len(session.messages) < 12  # some were dropped from the model's view
    runner.handle(f"/export json {tmp_path / 'all.json'}")
    assert screen.drawn[-1] == ("notice", f"Wrote 12 messages to {tmp_path / 'all.json'} as JSON.")
    # /save NAME names the file that has held every exchange as it happened.
    runner.handle("/save copy")
    named = read_conversation(conversation.path)
    assert named.name == "copy" and len(named.messages) == 12
    # Where saving had stopped (a write failed), /save writes it all anew.
    runner.conversation = None
    runner.handle("/save again")
    (again,) = [p for p in tmp_path.glob("*.jsonl") if p != conversation.path]
    copy = read_conversation(again)
    assert copy.name == "again"
    assert copy.messages == named.messages
    assert copy.finishes[1::2] == ["stop"] * 6  # /continue knows each reply was finished


def test_save_alone_says_where_and_last_is_not_a_name(tmp_path):
    screen = FakeScreen()
    runner, conversation = commands(FakeSession("Hi"), screen, tmp_path)
    runner.handle("hello")
    runner.handle("/save")
    assert screen.drawn[-1][1].startswith(
        f"This conversation is saved already, as {conversation.id} ({conversation.path})"
    )
    for name in ("last", "LAST"):
        runner.handle(f"/save {name}")
        assert screen.drawn[-1] == (
            "error",
            f"{name!r} is taken: --resume last opens the newest conversation. Pick another name.",
        )
    assert not list(tmp_path.glob("[lL]ast*"))


def test_a_retry_that_cannot_fit_keeps_the_reply_it_would_have_replaced(tmp_path):
    session, screen, runner, conversation = real_session(tmp_path, context=128)
    runner.handle("q" * 60)
    before = session.messages
    runner.handle("/system " + "s" * 70)  # now the question alone leaves no room for a reply
    runner.handle("/retry")
    assert screen.drawn[-1][0] == "error"
    assert session.messages[1:] == before  # the question and its reply, as they were
    assert session.transcript[1][-1] == "stop"
    assert read_conversation(conversation.path).messages[-1] == before[-1]


def test_undo_after_drops_brings_the_dropped_exchanges_back_into_view(tmp_path):
    session, _, runner, conversation = real_session(tmp_path, context=96)
    for i in range(6):
        runner.handle(f"question number {i}")
    before_drop = len(session.messages)
    assert before_drop < 12
    runner.handle("/undo")
    # Everything but the last exchange is in the model's view again: the room was for it.
    assert len(session.messages) == 10
    assert session.messages == read_conversation(conversation.path).messages
    for _ in range(5):
        runner.handle("/undo")
    assert session.messages == read_conversation(conversation.path).messages == []
    assert session.transcript == ([], [])


def test_a_retry_that_cannot_fit_keeps_the_dropped_exchanges_too(tmp_path):
    session, screen, runner, conversation = real_session(tmp_path, context=128)
    for i in range(4):
        runner.handle(f"short {i}")
    runner.handle("q" * 60)  # older exchanges make room for this one
    before = session.transcript
    assert len(before[0]) > len(session.messages)
    runner.handle("/system " + "s" * 70)
    runner.handle("/retry")
    assert screen.drawn[-1][0] == "error"
    assert session.transcript[0][1:] == before[0]  # behind the new system prompt
    assert read_conversation(conversation.path).messages[1:] == before[0]


def test_ctrl_c_before_the_reply_began_drops_the_question_rather_than_leave_it_waiting(
    tmp_path,
):
    session, screen, runner, conversation = real_session(tmp_path, context=128)

    def interrupted_renderer(raw: bool):  # Ctrl-C lands while the screen gets ready
        raise KeyboardInterrupt

    real = screen.renderer
    screen.renderer = interrupted_renderer  # type: ignore[method-assign]
    runner.handle("hello")
    screen.renderer = real  # type: ignore[method-assign]
    assert session.messages == []
    assert screen.drawn[-1] == (
        "notice",
        "Stopped before the reply began: your message was dropped.",
    )
    runner.handle("hello again")  # the next message is taken: nothing waits for a reply
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert read_conversation(conversation.path).messages == session.messages
