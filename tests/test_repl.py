"""The REPL, driven through a pipe input like a person at the keyboard, on a scripted session.

`FakeSession` has ChatSession's interface but no model: each turn streams the next scripted
reply as chatcli.chat.stream events. Output is read back from a plain Rich console.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

import pytest
from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document
from prompt_toolkit.input import PipeInput, create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from chatcli.chat.conversation_store import ConversationFile, NewConversation, read_conversation
from chatcli.chat.settings import Settings
from chatcli.chat.stream import (
    SpecialToken,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    ToolCallStart,
    ToolResult,
)
from chatcli.chat.turns import Reply, SamplingOptions, TurnNotice, TurnStats
from chatcli.errors import ChatcliError
from chatcli.model.special_tokens import (
    ASSISTANT_END,
    OUTPUT_END,
    OUTPUT_START,
    PYTHON_END,
    PYTHON_START,
)
from chatcli.terminal.render import CHAT_THEME
from chatcli.terminal.repl import (
    LEAVE_HINT,
    CommandCompleter,
    block_is_open,
    message_from_input,
    run_repl,
)

ENTER = "\r"
ALT_ENTER = "\x1b\r"
CTRL_C = "\x03"
CTRL_D = "\x04"
# Speeds are left out: a few tokens measure nothing (render.MIN_RATE_TOKENS).
STATUS = "ttft 0.10s · 10 in / {out} out · ctx {ctx}/256 · {reason}"


def status(out: int, reason: str = "stop") -> str:
    return STATUS.format(out=out, ctx=10 + out, reason=reason)


@dataclass
class Scripted:
    """One reply: its events, and optionally an exception raised before event `fail_at`."""

    events: list[StreamEvent]
    fail_at: int | None = None
    error: BaseException | None = None


def words(text: str) -> Scripted:
    return Scripted([TextDelta(w) for w in text.split(" ") if w for w in (w, " ")][:-1])


def parts_of(events: list[StreamEvent]) -> list[dict[str, str]]:
    parts: list[dict[str, str]] = []
    for e in events:
        if isinstance(e, TextDelta):
            if parts and parts[-1]["type"] == "text":
                parts[-1]["text"] += e.text
            else:
                parts.append({"type": "text", "text": e.text})
        elif isinstance(e, ToolResult):
            parts.append({"type": "python", "text": e.expression})
            if e.output is not None:
                parts.append({"type": "python_output", "text": e.output})
    return parts


class FakeStream:
    """The iterator send() returns: ends the turn on exhaustion, error or close(), as the
    real session's generator does in its finally block."""

    def __init__(self, session: FakeSession, script: Scripted, prefix: list[StreamEvent]) -> None:
        self.session, self.script, self.prefix = session, script, prefix
        self.seen: list[StreamEvent] = []
        self.closed = False
        self.done = False

    def __iter__(self) -> FakeStream:
        return self

    def __next__(self) -> StreamEvent:
        if self.done:
            raise StopIteration
        i = len(self.seen)
        if self.script.fail_at == i and self.script.error is not None:
            if not isinstance(self.script.error, KeyboardInterrupt):
                self._end("error")
            # A KeyboardInterrupt stands for Ctrl-C landing in the REPL between two events:
            # the stream stays open until the REPL closes it.
            raise self.script.error
        if i >= len(self.script.events):
            self._end("stop")
            raise StopIteration
        event = self.script.events[i]
        self.seen.append(event)
        return event

    def close(self) -> None:
        self.closed = True
        if not self.done:
            self._end("interrupted")

    def _end(self, reason: str) -> None:
        self.done = True
        self.session.finish_turn(self.prefix + self.seen, reason)


class FakeSession:
    can_sample_replies = True
    can_show_raw = True

    def __init__(self, *replies: Scripted | str, context_len: int = 256) -> None:
        self.script = deque(words(r) if isinstance(r, str) else r for r in replies)
        self.options = SamplingOptions()
        self.system: str | None = None
        self.entries: list[dict] = []
        self.last_reply: Reply | None = None
        self.history_stats: list[TurnStats] = []
        self.notices: list[TurnNotice] = []
        self.streams: list[FakeStream] = []
        self.seeds: list[int] = []
        self.context_len = context_len
        self.raw = False

    @property
    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + list(self.entries)

    @property
    def transcript(self) -> tuple[list[dict], list[str | None]]:
        return self.messages, [None] * len(self.messages)

    def _next_stream(self, prefix: list[StreamEvent] | None = None) -> FakeStream:
        stream = FakeStream(self, self.script.popleft(), list(prefix or []))
        self.streams.append(stream)
        return stream

    def send(self, text: str) -> FakeStream:
        self.entries.append({"role": "user", "content": text})
        return self._next_stream()

    def regenerate(self) -> FakeStream:
        if not self.entries or self.entries[-1]["role"] != "user":
            raise ChatcliError("There is no user message to reply to.")
        return self._next_stream()

    def continue_reply(self) -> FakeStream:
        if not self.entries or self.entries[-1]["role"] != "assistant":
            raise ChatcliError("There is no reply to continue.")
        last = self.entries.pop()
        return self._next_stream([TextDelta(p["text"]) for p in last["content"]])

    def _stats(self, out: int, reason: str) -> TurnStats:
        seed = self.options.seed if self.options.seed is not None else 7
        self.seeds.append(seed)
        return TurnStats(
            ttft_s=0.1,
            prefill_tokens=10,
            prefill_tps=100.0,
            decode_tps=50.0,
            tokens_in=10,
            tokens_out=out,
            context_used=10 + out,
            context_len=self.context_len,
            finish_reason=reason,
            seed=seed,
        )

    def finish_turn(self, events: list[StreamEvent], reason: str) -> None:
        out = len(events)
        reply = Reply(parts_of(events), list(range(out)), [1] * out, self._stats(out, reason))
        self.entries.append(reply.message)
        self.last_reply = reply
        self.history_stats.append(reply.stats)

    def sample_replies(self, text: str, n: int) -> list[Reply]:
        self.entries.append({"role": "user", "content": text})
        replies = []
        for _ in range(n):
            events = self.script.popleft().events
            stats = self._stats(len(events), "stop")
            replies.append(Reply(parts_of(events), [0] * len(events), [1] * len(events), stats))
        return replies

    def accept_reply(self, reply: Reply) -> None:
        self.entries.append(reply.message)
        self.last_reply = reply
        self.history_stats.append(reply.stats)

    def undo(self) -> bool:
        for i in range(len(self.entries) - 1, -1, -1):
            if self.entries[i]["role"] == "user":
                del self.entries[i:]
                return True
        return False

    def pop_last_reply(self) -> dict | None:
        if self.entries and self.entries[-1]["role"] == "assistant":
            return self.entries.pop()
        return None

    def clear(self) -> None:
        self.entries = []
        self.last_reply = None

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    def load_messages(self, messages: list[dict], finishes=None) -> None:
        self.system = None
        self.entries = []
        for m in messages:
            if m["role"] == "system":
                self.system = m["content"]
            else:
                self.entries.append(m)

    def take_notices(self) -> list[TurnNotice]:
        notices, self.notices = self.notices, []
        return notices


@dataclass
class Run:
    code: int
    out: str
    conversation: ConversationFile
    folder: Path
    notes: str = ""  # piped input: the notices, status lines and errors (stderr's)

    @property
    def all_lines(self) -> list[str]:
        return [line.rstrip() for line in self.out.splitlines()]

    @property
    def lines(self) -> list[str]:
        """The output without the goodbye line printed on leaving."""
        lines = self.all_lines
        return lines[:-1] if lines and lines[-1].startswith("Saved as ") else lines

    def saved(self) -> list[dict]:
        return read_conversation(self.conversation.path).messages


def type_slowly(pipe: PipeInput, chunks: list[str]) -> None:
    for chunk in chunks:
        time.sleep(0.3)
        pipe.send_text(chunk)


def chat(
    session: FakeSession,
    tmp_path: Path,
    *lines: str,
    settings: Settings | None = None,
    width: int = 100,
    keys: str | None = None,
    chunks: list[str] | None = None,
    piped: str | None = None,
    notes_apart: bool = False,
) -> Run:
    """Types each line and Enter, then Ctrl-D; or exactly `keys` when given; or each of
    `chunks` a moment apart; or, with `piped`, reads that text as a piped stdin."""
    console = Console(
        file=StringIO(), width=width, color_system=None, theme=CHAT_THEME, highlight=False
    )
    folder = tmp_path / "conversations"
    conversation = ConversationFile.create(folder, model="fake")
    if piped is not None:
        # One console for both unless asked: most tests read the whole chat in order.
        notes = (
            Console(file=StringIO(), width=width, color_system=None, theme=CHAT_THEME)
            if notes_apart
            else console
        )
        code = run_repl(
            session,
            settings=settings or Settings(history=False),
            console=console,
            conversation=conversation,
            conversations_dir=folder,
            lines=StringIO(piped),
            notes=notes,
        )
        apart = notes.file.getvalue() if notes_apart else ""
        return Run(code, console.file.getvalue(), conversation, folder, apart)
    typed = keys if keys is not None else "".join(line + ENTER for line in lines) + CTRL_D
    with create_pipe_input() as pipe:
        if chunks is None:
            pipe.send_text(typed)
        else:
            typist = threading.Thread(target=type_slowly, args=(pipe, chunks), daemon=True)
            typist.start()
        code = run_repl(
            session,
            settings=settings or Settings(history=False),
            console=console,
            conversation=conversation,
            conversations_dir=folder,
            model_info={"path": "/models/fake", "tag": "d4", "params": 1234567, "load_s": 0.25},
            input=pipe,
            output=DummyOutput(),
        )
    return Run(code, console.file.getvalue(), conversation, folder)


def test_a_turn_streams_the_reply_then_the_status_line(tmp_path):
    run = chat(FakeSession("Hello there, friend!"), tmp_path, "hi")
    assert run.code == 0
    assert run.lines == ["Hello there, friend!", status(5)]


def test_a_calculator_call_shows_as_a_badge(tmp_path):
    events = [
        TextDelta("It is "),
        ToolCallStart(),
        ToolCallDelta("12*7"),
        ToolResult("12*7", "84"),
        TextDelta("."),
    ]
    run = chat(FakeSession(Scripted(events)), tmp_path, "What is 12*7?")
    assert run.lines[0] == "It is [calc 12*7 = 84]."


def test_ctrl_d_on_an_empty_line_exits_with_0(tmp_path):
    session = FakeSession()
    run = chat(session, tmp_path, keys=CTRL_D)
    assert run.code == 0
    assert run.out == ""
    assert session.entries == []


def test_slash_exit_and_quit_leave(tmp_path):
    assert chat(FakeSession(), tmp_path, keys="/exit" + ENTER).code == 0
    assert chat(FakeSession(), tmp_path / "b", keys="/quit" + ENTER).code == 0


def test_ctrl_c_at_an_empty_prompt_hints_how_to_leave(tmp_path):
    run = chat(FakeSession(), tmp_path, keys=CTRL_C + CTRL_D)
    assert run.lines == [LEAVE_HINT]
    assert LEAVE_HINT == "(Press Ctrl-D or type /exit to leave)"


def test_ctrl_c_clears_a_typed_line_without_sending_it(tmp_path):
    session = FakeSession("answer")
    run = chat(session, tmp_path, keys="never mind" + CTRL_C + "real question" + ENTER + CTRL_D)
    assert run.lines == ["answer", status(1)]  # no hint: the line was not empty
    assert session.entries[0] == {"role": "user", "content": "real question"}


def test_temperature_echoes_and_changes_the_options(tmp_path):
    session = FakeSession()
    run = chat(session, tmp_path, "/temperature 0.3")
    assert run.lines == ["temperature = 0.3"]
    assert session.options.temperature == 0.3


def test_sampling_commands_map_off_values_to_none(tmp_path):
    session = FakeSession()
    run = chat(
        session,
        tmp_path,
        "/top_k 0",
        "/top_p 1",
        "/max_tokens 400",
        "/seed 42",
        "/tools off",
    )
    assert run.lines == [
        "top_k = off",
        "top_p = off",
        "max_tokens = 400",
        "seed = 42",
        "tools = off",
    ]
    options = session.options
    assert (options.top_k, options.top_p, options.max_tokens, options.seed, options.tools) == (
        None,
        None,
        400,
        42,
        False,
    )
    run = chat(session, tmp_path / "b", "/top_k 40", "/top_p 0.9", "/seed random")
    assert run.lines == ["top_k = 40", "top_p = 0.9", "seed = random"]
    assert (options.top_k, options.top_p, options.seed) == (40, 0.9, None)


def test_a_bad_value_prints_one_error_line_and_the_loop_goes_on(tmp_path):
    session = FakeSession("still here")
    run = chat(session, tmp_path, "/temperature hot", "hello")
    assert run.lines == [
        "Error: /temperature needs a number between 0 and 2, e.g. /temperature 0.7 (got 'hot')",
        "still here",
        status(3),
    ]
    assert session.options.temperature == 0.6


def test_an_unknown_command_suggests_the_closest(tmp_path):
    run = chat(FakeSession(), tmp_path, "/temprature 0.3", "/temp 0.5")
    assert run.lines == [
        "Error: Unknown command /temprature. Type /help for the list. Did you mean /temperature?",
        "Error: Unknown command /temp. Type /help for the list. Did you mean /temperature?",
    ]


def test_a_double_slash_sends_a_message_starting_with_a_slash(tmp_path):
    session = FakeSession("ok")
    chat(session, tmp_path, "//etc/hosts is a file")
    assert session.entries[0]["content"] == "/etc/hosts is a file"


def test_undo_drops_the_last_exchange_and_says_what(tmp_path):
    session = FakeSession("Four.")
    run = chat(session, tmp_path, "What is 2+2?", "/undo", "/undo")
    assert run.lines[2:] == ['Undone: "What is 2+2?" and its reply.', "Nothing to undo."]
    assert session.entries == []
    assert run.saved() == []


def test_retry_regenerates_with_a_new_seed_shown(tmp_path, monkeypatch):
    monkeypatch.setattr("chatcli.terminal.slash_commands.random_seed", lambda: 1234)
    session = FakeSession("first answer", "second answer")
    run = chat(session, tmp_path, "question", "/retry")
    assert run.lines == [
        "first answer",
        status(3),
        "retry with seed 1234",
        "second answer",
        status(3),
    ]
    assert session.seeds == [7, 1234]
    assert session.options.seed is None  # still a fresh seed each turn afterwards
    assert run.saved() == [
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": [{"type": "text", "text": "second answer"}]},
    ]


def test_retry_with_a_fixed_seed_uses_the_next_seed_each_time(tmp_path):
    session = FakeSession("a", "b", "c", "d", "e")
    run = chat(session, tmp_path, "/seed 5", "q", "/retry", "/retry", "next", "/retry")
    notices = [line for line in run.lines if line.startswith("retry")]
    assert notices == [
        "retry with seed 6 (the fixed seed 5 + 1)",
        "retry with seed 7 (the fixed seed 5 + 2)",
        "retry with seed 6 (the fixed seed 5 + 1)",  # a new message starts counting again
    ]
    assert session.seeds == [5, 6, 7, 5, 6]
    assert session.options.seed == 5  # the fixed seed itself is kept for the next turn


def test_retry_with_nothing_to_retry_is_an_error(tmp_path):
    run = chat(FakeSession(), tmp_path, "/retry")
    assert run.lines == ["Error: There is no user message to reply to."]


def test_continue_extends_the_last_reply(tmp_path):
    session = FakeSession(words("Once upon"), Scripted([TextDelta(" a time")]))
    run = chat(session, tmp_path, "story", "/continue")
    assert run.lines[2] == " a time"
    assert run.saved()[-1]["content"] == [{"type": "text", "text": "Once upon a time"}]


def test_clear_starts_a_new_conversation_and_keeps_the_old_one_whole(tmp_path):
    session = FakeSession("hi", "hey")
    run = chat(session, tmp_path, "/system Be brief.", "hello", "/clear", "again")
    old = run.conversation.id
    assert f"New conversation. The last one is saved as {old}." in run.lines
    # The conversation before /clear stays as it was, for --resume.
    assert run.saved() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
    ]
    (new,) = [p for p in run.folder.iterdir() if p.stem != old]
    assert read_conversation(new).messages == [
        {"role": "system", "content": "Be brief."},  # the system prompt outlives /clear
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": [{"type": "text", "text": "hey"}]},
    ]
    assert (
        run.all_lines[-1] == f"Saved as {new.stem}; chatcli chat --resume {new.stem} picks it up."
    )


def test_clear_then_nothing_leaves_no_empty_file(tmp_path):
    run = chat(FakeSession("hi"), tmp_path, "hello", "/clear", "/settings")
    assert [p.stem for p in run.folder.iterdir()] == [run.conversation.id]
    assert any("(saved from its first message)" in line for line in run.lines)


def test_a_new_conversation_makes_its_file_at_the_first_message(tmp_path):
    folder = tmp_path / "conversations"
    conversation = NewConversation(folder, model="fake", system="sys")
    piped_chat(FakeSession(), conversation, folder, "/temperature 0.3\n/settings\n")
    assert not folder.exists()  # settings alone save nothing
    piped_chat(FakeSession("hi"), conversation, folder, "hello\n")
    assert conversation.path is not None and conversation.path.parent == folder
    assert read_conversation(conversation.path).messages[:2] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hello"},
    ]


def test_system_shows_sets_and_clears_the_system_prompt(tmp_path):
    session = FakeSession()
    run = chat(session, tmp_path, "/system", "/system Be brief.", "/system", "/system clear")
    assert run.lines == [
        "No system prompt. /system TEXT sets one.",
        "System prompt set: Be brief.",
        "System prompt: Be brief.",
        "System prompt removed.",
    ]
    assert session.system is None
    assert run.saved() == []
    records = [json.loads(line) for line in run.conversation.path.read_text().splitlines()]
    assert records[1:] == [
        {"type": "system", "text": "Be brief."},
        {"type": "system", "text": None},
    ]


def test_settings_shows_the_current_values(tmp_path):
    session = FakeSession()
    run = chat(session, tmp_path, "/temperature 0.2", "/top_k 0", "/settings")
    table = {line.split()[0]: line.split()[1:] for line in run.lines[3:] if line.strip()}
    assert table["model"] == ["d4"]
    assert table["temperature"] == ["0.2"]
    assert table["top_k"] == ["off"]
    assert table["top_p"] == ["off"]
    assert table["seed"] == ["random"]
    assert table["tools"] == ["on"]
    assert table["context"] == ["256", "tokens"]


def test_help_lists_every_command_and_details_one(tmp_path):
    run = chat(FakeSession(), tmp_path, "/help", "/help top_k")
    assert run.lines[0] == "Commands:"
    assert any(line.startswith("  /temperature X") for line in run.lines)
    assert any(line.startswith("  /samples N") for line in run.lines)
    assert run.lines[-3:] == [
        "/top_k K",
        "  Sample only among the K likeliest tokens (0 = off).",
        "  Takes a whole number between 0 and 1000 (0 or off turns it off), e.g. /top_k 50;"
        " alone, shows the value.",
    ]


def test_a_triple_quote_block_is_one_message_with_newlines(tmp_path):
    session = FakeSession("ok")
    keys = '"""' + ENTER + "line one" + ENTER + "  line two" + ENTER + '"""' + ENTER + CTRL_D
    chat(session, tmp_path, keys=keys)
    assert session.entries[0] == {"role": "user", "content": "line one\n  line two"}


def test_alt_enter_inserts_a_newline_and_a_paste_stays_one_message(tmp_path):
    session = FakeSession("one", "two")
    paste = "\x1b[200~pasted a\npasted b\x1b[201~"
    keys = "first" + ALT_ENTER + "second" + ENTER + paste + ENTER + CTRL_D
    chat(session, tmp_path, keys=keys)
    users = [m["content"] for m in session.entries if m["role"] == "user"]
    assert users == ["first\nsecond", "pasted a\npasted b"]


def test_block_quotes_open_and_close_on_lines_of_their_own():
    assert block_is_open('"""')
    assert block_is_open('"""\nsome text')
    assert block_is_open('  """  \nsome text\n')
    assert not block_is_open('"""\nsome text\n"""')
    assert not block_is_open("plain")
    assert message_from_input('"""\n  a\nb\n"""') == "  a\nb"
    assert message_from_input('"""\n\na\n\n"""') == "\na\n"  # what lies between, as typed
    assert message_from_input("  hi \n") == "hi"


def test_quotes_inside_a_line_are_text_not_a_block():
    typed = '"""Hi""" is a Python string, right?'
    assert not block_is_open(typed)
    assert message_from_input(typed) == typed
    pasted = '"""Module docstring."""\nimport os\nprint(os.getcwd())'
    assert not block_is_open(pasted)
    assert message_from_input(pasted) == pasted
    assert not block_is_open('"""one line"""')
    assert message_from_input('"""one line"""') == '"""one line"""'
    # A pasted block holding an indented docstring: that is text, the block goes on.
    code = '"""\ndef f():\n    """\n    Doc.\n    """\n    return 1\n"""'
    assert block_is_open(code[: -len('\n"""')])
    assert message_from_input(code) == 'def f():\n    """\n    Doc.\n    """\n    return 1'
    # Text after a block's closing line is never dropped: the whole paste is sent.
    assert message_from_input('"""\nfoo\n"""\nbar') == '"""\nfoo\n"""\nbar'


def test_text_may_follow_the_opening_quotes_and_precede_the_closing_ones():
    # ollama's habit: """Hello opens a block, a line ending in """ closes it.
    assert block_is_open('"""Hello there')
    assert block_is_open('"""Hello there\nmore')
    assert not block_is_open('"""Hello there\nlast line"""')
    assert message_from_input('"""Hello there\nlast line"""') == "Hello there\nlast line"
    assert message_from_input('"""Hello\n  b\n"""') == "Hello\n  b"
    # Pasted code keeps its own quotes: a docstring's pair, or an indented closing line.
    code = '"""Look:\ndef f():\n    """Doc."""\n    return 1  # """\nok?"""'
    assert block_is_open(code[: -len('\nok?"""')])
    assert message_from_input(code) == 'Look:\ndef f():\n    """Doc."""\n    return 1  # """\nok?'


def test_a_block_opened_with_text_is_sent_as_one_message(tmp_path):
    session = FakeSession()
    chat(session, tmp_path, keys='"""Hello there' + ENTER + 'second"""' + ENTER + CTRL_D)
    users = [m["content"] for m in session.entries if m["role"] == "user"]
    assert users == ["Hello there\nsecond"]


def test_enter_on_a_picked_command_without_arguments_runs_it(tmp_path):
    # Tab completes /sta to /stats; one Enter then runs it (a command that takes an
    # argument completes with a space and waits for it).
    session = FakeSession()
    chunks = ["/sta", "\t", ENTER, "/tem", "\t", ENTER, "0.5" + ENTER, CTRL_D]
    run = chat(session, tmp_path, chunks=chunks)
    assert run.lines == ["No turns yet.", "temperature = 0.5"]


def test_the_conversation_file_holds_every_turn(tmp_path):
    session = FakeSession("Hi!", "Fine.", "Bye.")
    run = chat(session, tmp_path, "hello", "how are you?", "bye", "/undo")
    assert run.saved() == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": "how are you?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Fine."}]},
    ]
    records = [json.loads(line) for line in run.conversation.path.read_text().splitlines()]
    reply = records[2]
    assert reply["meta"]["finish_reason"] == "stop"
    assert reply["meta"]["seed"] == 7
    assert reply["meta"]["stats"]["tokens_out"] == 1
    cid = run.conversation.id
    assert run.all_lines[-1] == f"Saved as {cid}; chatcli chat --resume {cid} picks it up."


def test_samples_shows_the_replies_and_keeps_the_chosen_one(tmp_path):
    session = FakeSession("the first one", "the second one")
    run = chat(session, tmp_path, "/samples 2", "pick one", "2")
    assert run.lines[0] == "Your next message gets 2 replies side by side; you keep one."
    row = next(line for line in run.lines if "the first one" in line)
    assert "the second one" in row  # side by side on a 100-column console
    assert run.lines[-2:] == ["Kept reply 2.", status(5)]
    assert session.entries[-1]["content"] == [{"type": "text", "text": "the second one"}]
    assert run.saved() == [
        {"role": "user", "content": "pick one"},
        {"role": "assistant", "content": [{"type": "text", "text": "the second one"}]},
    ]


def test_exit_at_the_samples_question_keeps_none_and_leaves(tmp_path):
    session = FakeSession("left", "right", "never")
    typed = ENTER.join(["/samples 2", "q", "/quit", "not read", ""]) + CTRL_D + CTRL_D
    run = chat(session, tmp_path, keys=typed)
    assert run.code == 0
    assert run.lines[-1] == "Kept none; your message was dropped too."
    assert not [line for line in run.lines if line.startswith("Error")]
    assert session.entries == []
    assert len(session.script) == 1  # the line after /quit was never read


def test_samples_stack_on_a_narrow_console_and_zero_keeps_none(tmp_path):
    session = FakeSession("left", "right", "after")
    run = chat(session, tmp_path, "/samples 2", "q", "0", "next", width=60)
    first = next(i for i, line in enumerate(run.lines) if "left" in line)
    second = next(i for i, line in enumerate(run.lines) if "right" in line)
    assert second > first
    assert "Kept none; your message was dropped too." in run.lines
    assert session.entries == [
        {"role": "user", "content": "next"},
        {"role": "assistant", "content": [{"type": "text", "text": "after"}]},
    ]


def test_an_error_mid_turn_prints_one_line_and_the_next_turn_works(tmp_path):
    broken = Scripted([TextDelta("partial")], fail_at=1, error=RuntimeError("device lost"))
    session = FakeSession(broken, "works again")
    run = chat(session, tmp_path, "first", "second")
    assert run.lines == ["partial", "Error: RuntimeError: device lost", "works again", status(3)]


def test_a_project_error_before_the_turn_is_not_saved(tmp_path):
    class Overflowing(FakeSession):
        def send(self, text: str) -> FakeStream:
            raise ChatcliError("This message alone needs more than the model's 256-token context.")

    run = chat(Overflowing(), tmp_path, "x" * 50)
    assert run.lines == ["Error: This message alone needs more than the model's 256-token context."]
    assert run.saved() == []


def test_ctrl_c_mid_reply_closes_the_stream_and_keeps_the_partial_reply(tmp_path):
    stopped = Scripted(
        [TextDelta("Once"), TextDelta(" upon")], fail_at=2, error=KeyboardInterrupt()
    )
    session = FakeSession(stopped, "next answer")
    run = chat(session, tmp_path, "tell a story", "and then?")
    assert session.streams[0].closed
    assert run.lines == [
        "Once upon [interrupted]",
        status(2, "interrupted"),
        "next answer",
        status(3),
    ]
    saved = run.saved()
    assert saved[1] == {"role": "assistant", "content": [{"type": "text", "text": "Once upon"}]}
    records = [json.loads(line) for line in run.conversation.path.read_text().splitlines()]
    assert records[2]["meta"]["finish_reason"] == "interrupted"


def test_notices_come_before_the_reply(tmp_path):
    session = FakeSession("ok")
    session.notices.append(TurnNotice("Context 210/256 tokens: older exchanges will be dropped."))
    run = chat(session, tmp_path, "hi")
    assert run.lines[0] == "Context 210/256 tokens: older exchanges will be dropped."


def test_save_and_load_a_named_conversation(tmp_path):
    session = FakeSession("Hi!")
    run = chat(session, tmp_path, "hello", "/save notes")
    path = run.conversation.path  # named, not copied: one file, one entry in the list
    assert run.lines[2] == (
        f'Named this conversation "notes" ({run.conversation.id}); chatcli chat --resume "notes".'
    )
    assert [p.name for p in run.folder.iterdir()] == [path.name]
    assert read_conversation(path).messages == session.entries
    assert read_conversation(path).name == "notes"
    assert run.all_lines[-1] == (
        f'Saved as {run.conversation.id} ("notes"); chatcli chat --resume "notes" picks it up.'
    )

    loaded = FakeSession("Bye.")
    run = chat(loaded, tmp_path, "/load notes", "bye")
    assert run.lines[0] == f"Loaded 2 messages from {path.stem}."
    assert loaded.entries[:2] == session.entries
    assert [m["content"] for m in read_conversation(path).messages[2:]] == [
        "bye",
        [{"type": "text", "text": "Bye."}],
    ]


def test_history_lists_the_saved_conversations(tmp_path):
    run = chat(FakeSession("Hi!"), tmp_path, "hello there", "/history")
    header = next(line for line in run.lines if line.startswith("id"))
    assert header.split() == ["id", "name", "modified", "messages", "preview"]
    row = next(line for line in run.lines if line.startswith("* "))
    assert run.conversation.id in row
    assert row.split()[-3:] == ["2", "hello", "there"]


def test_export_writes_markdown_and_json(tmp_path):
    md, js = tmp_path / "chat.md", tmp_path / "chat.json"
    run = chat(FakeSession("Hi!"), tmp_path, "hello", f"/export md {md}", f"/export json {js}")
    assert run.lines[2:4] == [
        f"Wrote 2 messages to {md} as Markdown.",
        f"Wrote 2 messages to {js} as JSON.",
    ]
    assert md.read_text() == "**You:**\n\nhello\n\n**Assistant:**\n\nHi!\n"
    assert json.loads(js.read_text())["messages"][0] == {"role": "user", "content": "hello"}


def test_export_counts_messages_as_save_does_and_refuses_an_empty_conversation(tmp_path):
    md = tmp_path / "chat.md"
    run = chat(FakeSession("Hi!"), tmp_path, f"/export md {md}", "/system Be brief.", "hello",
               f"/export md {md}")  # fmt: skip
    assert run.lines[0] == "Error: Nothing to export yet: the conversation has no messages."
    assert f"Wrote 2 messages to {md} as Markdown." in run.lines  # the system prompt aside


def test_stats_tabulates_every_turn(tmp_path):
    run = chat(FakeSession("a", "b c"), tmp_path, "one", "two", "/stats")
    rows = [line.split() for line in run.lines if line.split()[:1] in (["1"], ["2"])]
    assert rows == [
        ["1", "0.10s", "100", "50", "10", "1", "stop"],
        ["2", "0.10s", "100", "50", "10", "3", "stop"],
    ]


def test_stats_shows_a_dash_for_what_a_turn_did_not_measure(tmp_path):
    session = FakeSession("a")
    run = chat(session, tmp_path, "one")
    session.history_stats.append(TurnStats(tokens_in=12, finish_reason="interrupted"))
    commands_run = chat(session, tmp_path / "b", "/stats")
    rows = [line.split() for line in commands_run.lines if line.split()[:1] == ["2"]]
    assert rows == [["2", "-", "-", "-", "12", "0", "interrupted"]]
    assert run.code == 0


def test_model_shows_the_model_info(tmp_path):
    run = chat(FakeSession(), tmp_path, "/model")
    table = {line.split()[0]: line.split()[1] for line in run.lines if line.strip()}
    assert table == {"path": "/models/fake", "tag": "d4", "params": "1,234,567", "load_s": "0.25"}


def test_raw_sets_the_session_flag(tmp_path):
    session = FakeSession()
    run = chat(session, tmp_path, "/raw on")
    assert run.lines == ["raw = on"]
    assert session.raw is True


def test_raw_replies_show_the_exact_token_text_even_in_markdown_mode(tmp_path):
    events = [
        TextDelta("It is "),
        SpecialToken(PYTHON_START),
        TextDelta("2*2*2"),
        SpecialToken(PYTHON_END),
        SpecialToken(OUTPUT_START),
        TextDelta("8"),
        SpecialToken(OUTPUT_END),
        TextDelta(" *eight* `x`"),
        SpecialToken(ASSISTANT_END),
    ]
    session = FakeSession(Scripted(events), "**bold** again")
    run = chat(
        session,
        tmp_path,
        "/raw on",
        "q",
        "/raw off",
        "q2",
        settings=Settings(history=False, markdown="always"),
    )
    assert run.lines[:3] == [
        "raw = on",
        "It is <|python_start|>2*2*2<|python_end|><|output_start|>8<|output_end|> *eight* `x`"
        "<|assistant_end|>",
        status(len(events)),
    ]
    assert run.lines[4] == "bold again"  # raw off: Markdown again


def test_input_history_is_written_to_the_history_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    chat(FakeSession(), tmp_path, "/temperature 0.3", settings=Settings(history=True))
    assert "/temperature 0.3" in (tmp_path / "home" / "input_history").read_text()


@pytest.mark.parametrize("kind", ["folder", "loop"])
def test_a_history_file_that_is_no_file_turns_history_off_and_says_why(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    path = tmp_path / "home" / "input_history"
    path.parent.mkdir()
    if kind == "folder":
        path.mkdir()
    else:
        path.symlink_to(path.name)
    run = chat(FakeSession("Hi!"), tmp_path, "hello", settings=Settings(history=True))
    assert run.code == 0 and "Hi!" in run.out
    why = "is a folder, not a file" if kind == "folder" else "is a symbolic link that leads back"
    assert f"Input history is off: {path} {why}" in run.out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/te", ["temperature "]),
        ("/ex", ["export ", "exit"]),
        ("/help sy", ["system"]),
        ("/tools o", ["on", "off"]),
        ("hello /te", []),
    ],
)
def test_tab_completes_commands_and_their_arguments(tmp_path, text, expected):
    completer = CommandCompleter(tmp_path)
    found = list(
        completer.get_completions(Document(text), CompleteEvent(completion_requested=True))
    )
    assert [c.text for c in found] == expected


def test_command_completions_carry_their_description(tmp_path):
    (found,) = CommandCompleter(tmp_path).get_completions(Document("/undo"), CompleteEvent())
    assert found.display_meta_text == "Drop the last exchange (your message and the reply)"


def test_up_arrow_and_ctrl_r_recall_earlier_lines(tmp_path):
    up, ctrl_r = "\x1b[A", "\x12"
    # The prompt loads its history in the background: keys already waiting would beat it.
    chunks = [
        "/temperature 0.3" + ENTER + "/top_k 7" + ENTER,
        up + up + ENTER,
        ctrl_r + "top" + ENTER + ENTER,
        CTRL_D,
    ]
    run = chat(FakeSession(), tmp_path, chunks=chunks)
    assert run.lines == ["temperature = 0.3", "top_k = 7", "temperature = 0.3", "top_k = 7"]


# ---- stdin that is not a terminal -----------------------------------------------------------


def test_piped_input_is_one_message_a_line_with_plain_output_and_no_prompt(tmp_path):
    session = FakeSession("Hello there!", "Four.")
    # The last line has no newline: it is answered all the same.
    run = chat(session, tmp_path, piped="hi\n\n/temperature 0.3\nWhat is 2+2?")
    assert run.code == 0
    assert run.lines == ["Hello there!", status(3), "temperature = 0.3", "Four.", status(1)]
    assert [m["content"] for m in session.entries if m["role"] == "user"] == [
        "hi",
        "What is 2+2?",
    ]
    assert ">>>" not in run.out and "\r" not in run.out
    assert session.options.temperature == 0.3


def test_piped_input_keeps_notices_status_and_errors_off_stdout_and_exits_1_on_an_error(
    tmp_path,
):
    session = FakeSession("Four.")
    run = chat(session, tmp_path, piped="What is 2+2?\n/nosuch\n", notes_apart=True)
    assert run.all_lines == ["Four."]  # stdout: the reply alone
    notes = [line.rstrip() for line in run.notes.splitlines()]
    assert notes[0] == status(1)
    assert notes[1].startswith("Error: Unknown command /nosuch")
    assert notes[-1].startswith("Saved as ")
    assert run.code == 1
    assert chat(FakeSession("ok"), tmp_path / "b", piped="hi\n", notes_apart=True).code == 0


def test_piped_input_keeps_a_triple_quote_block_and_answers_samples_questions(tmp_path):
    session = FakeSession("one", "left", "right")
    run = chat(session, tmp_path, piped='"""\nfirst line\nsecond line\n"""\n/samples 2\nq\n2\n')
    assert session.entries[0] == {"role": "user", "content": "first line\nsecond line"}
    assert "Kept reply 2." in run.lines
    assert session.entries[-1]["content"] == [{"type": "text", "text": "right"}]


def test_piped_bytes_that_are_not_utf8_are_sent_and_saved_as_replacement_characters(tmp_path):
    # b"hi\xff" read with surrogateescape: a lone surrogate that the conversation file
    # could not encode, so the turn failed halfway before.
    session = FakeSession("Hello!")
    run = chat(session, tmp_path, piped="hi\udcff\n")
    assert session.entries[0] == {"role": "user", "content": "hi\ufffd"}
    assert [m["content"] for m in run.saved()][:1] == ["hi\ufffd"]


def test_piped_input_that_ends_at_the_samples_question_keeps_its_default(tmp_path):
    session = FakeSession("left", "right")
    run = chat(session, tmp_path, piped="/samples 2\nq\n")
    assert "Kept reply 1." in run.lines
    assert session.entries[-1]["content"] == [{"type": "text", "text": "left"}]


def test_piped_input_sends_a_block_left_open_at_the_end(tmp_path):
    session = FakeSession("ok")
    chat(session, tmp_path, piped='"""\nunfinished\nblock')
    assert session.entries[0] == {"role": "user", "content": "unfinished\nblock"}


def test_a_setting_command_alone_shows_the_value_and_changes_nothing(tmp_path):
    session = FakeSession()
    run = chat(session, tmp_path, "/temperature 0.2", "/temperature", "/top_k 0", "/top_k", "/seed")
    assert run.lines == [
        "temperature = 0.2",
        "temperature = 0.2 (/temperature X changes it)",
        "top_k = off",
        "top_k = off (/top_k K changes it)",
        "seed = random (/seed N|random changes it)",
    ]
    assert session.options.temperature == 0.2


def piped_chat(session, conversation, folder: Path, text: str) -> list[str]:
    """run_repl over piped lines; the console's lines (notices and errors too, in order)."""
    console = Console(file=StringIO(), width=200, color_system=None, theme=CHAT_THEME)
    run_repl(
        session,
        settings=Settings(history=False),
        console=console,
        conversation=conversation,
        conversations_dir=folder,
        lines=StringIO(text),
        notes=console,
    )
    return [line.rstrip() for line in console.file.getvalue().splitlines()]


def test_a_conversation_that_cannot_be_saved_says_so_once_and_the_chat_goes_on(tmp_path):
    (tmp_path / "a-file").write_text("")
    folder = tmp_path / "a-file" / "conversations"  # under a file: no folder can be made
    session = FakeSession("hi", "hey")
    lines = piped_chat(session, NewConversation(folder), folder, "hello\nagain\n")
    errors = [line for line in lines if line.startswith("Error:")]
    assert len(errors) == 1
    assert errors[0].endswith("This conversation is not saved from here on.")
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["hello", "again"]
    assert not any(line.startswith("Saved as") for line in lines)  # no "Saved as None"


def test_a_message_the_server_refuses_leaves_the_file_as_the_conversation(tmp_path):
    pytest.importorskip("fastapi")
    from serving import END, scripted_worker, serve_workers, text_tokens

    from chatcli.serve.client import RemoteSession

    sentence = text_tokens(" ok.")

    def script(history: list[int]) -> int:
        return sentence[len(history)] if len(history) < len(sentence) else END

    server = serve_workers([scripted_worker(script)])
    folder = tmp_path / "conversations"
    try:
        session = RemoteSession(server.url, options=SamplingOptions(temperature=0.5))
        conversation = NewConversation(folder, model="remote")
        # The server takes top_k up to 200: the second message is refused once sent. (The
        # same words as the first: the file must still lose only the refused one.)
        lines = piped_chat(session, conversation, folder, "hello\n/top_k 500\nhello\n")
    finally:
        server.stop()
    assert any("refused the request (400)" in line for line in lines)
    assert session.messages == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "text", "text": " ok."}]},
    ]
    assert read_conversation(conversation.path).messages == session.messages


def test_samples_at_temperature_0_says_the_replies_will_be_the_same(tmp_path):
    run = chat(FakeSession(), tmp_path, "/temperature 0", "/samples 3")
    assert run.lines[-1] == (
        "Your next message gets 3 replies side by side; you keep one. At temperature 0 they "
        "are all the same reply: /temperature 0.8 varies them."
    )


def damaged_file(folder: Path) -> Path:
    """A saved conversation whose second question's line is damaged: its reply, left
    without a question, is dropped on load."""
    conv = ConversationFile.create(folder, model="fake")
    for question, answer in (("q1", "a1"), ("q2", "a2")):
        conv.append_message({"role": "user", "content": question})
        conv.append_message({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    lines = conv.path.read_text(encoding="utf-8").splitlines()
    lines[3] = "{damaged"
    conv.path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return conv.path


def test_turns_after_loading_a_repaired_file_replay_as_the_session_has_them(tmp_path):
    folder = tmp_path / "conversations"
    path = damaged_file(folder)
    session = FakeSession("a1 again", "b1")
    # /retry first: replayed onto the damaged records, it would replace a2, the reply that
    # lost its question, and the load would then drop the new reply with it.
    lines = piped_chat(session, None, folder, f"/load {path.stem}\n/retry\nnext\n")
    assert "a reply without its question dropped: 'a2'" in " ".join(lines)
    assert read_conversation(path).messages == session.messages
    assert session.messages[1]["content"] == [{"type": "text", "text": "a1 again"}]
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2


def test_a_file_that_ends_in_a_question_asks_for_retry_or_undo_first(tmp_path):
    folder = tmp_path / "conversations"
    conv = ConversationFile.create(folder, model="fake")
    conv.append_message({"role": "user", "content": "stopped mid-turn"})
    session = FakeSession("the reply")
    lines = piped_chat(session, None, folder, f"/load {conv.id}\nanother\n/retry\n")
    hint = "The last question has no reply yet: /retry answers it, /undo drops it."
    # Said at once after the recap, and again for a message sent before it is answered.
    assert lines.index(hint) < lines.index(f"Error: {hint}")
    assert "Answering the last question." in lines  # its first answer, not a retry
    assert not any(line.startswith("retry with seed") for line in lines)
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["stopped mid-turn"]
    assert session.messages[-1]["role"] == "assistant"
    saved = read_conversation(conv.path).messages
    assert [m["role"] for m in saved] == ["user", "assistant"]


def test_a_conversation_loaded_from_elsewhere_is_resumed_by_its_path(tmp_path):
    elsewhere = ConversationFile.create(tmp_path / "elsewhere", model="fake")
    elsewhere.append_message({"role": "user", "content": "q"})
    elsewhere.append_message({"role": "assistant", "content": [{"type": "text", "text": "a"}]})
    folder = tmp_path / "conversations"
    lines = piped_chat(FakeSession("b"), None, folder, f"/load {elsewhere.path}\nnext\n")
    assert lines[-1] == (
        f"Saved as {elsewhere.id}; chatcli chat --resume {elsewhere.path} picks it up."
    )


def test_load_shows_where_the_conversation_left_off(tmp_path):
    folder = tmp_path / "conversations"
    conv = ConversationFile.create(folder, model="fake")
    for question, answer in (("q1", "a1"), ("q2", "a2")):
        conv.append_message({"role": "user", "content": question})
        conv.append_message({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    lines = piped_chat(FakeSession(), None, folder, f"/load {conv.id}\n")
    start = lines.index(f"Loaded 4 messages from {conv.id}.")
    assert lines[start + 1 : start + 4] == ["… 2 earlier messages", "> q2", "a2"]


def test_markdown_switches_how_the_next_replies_are_drawn(tmp_path):
    # The console here is not a terminal: auto draws plain text, always draws Markdown.
    session = FakeSession("**bold** text", "**bold** text")
    run = chat(session, tmp_path, "one", "/markdown always", "two", "/markdown")
    assert run.lines[0] == "**bold** text"
    assert "markdown = always" in run.lines
    assert "bold text" in run.lines[run.lines.index("markdown = always") + 1]
    assert run.lines[-1] == "markdown = always (/markdown auto|always|never changes it)"


def test_with_stdout_piped_the_prompt_draws_on_the_terminal_behind_stderr(monkeypatch):
    # `chatcli chat | tee log`: the prompt and its escape codes stay out of the pipe.
    import os
    import pty

    from chatcli.terminal.repl import prompt_output

    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as terminal:
        monkeypatch.setattr("sys.stdout", StringIO())
        monkeypatch.setattr("sys.stderr", terminal)
        output = prompt_output()
        assert output is not None and output.fileno() == follower
        monkeypatch.setattr("sys.stderr", StringIO())  # no terminal anywhere
        assert prompt_output() is None
    os.close(leader)
