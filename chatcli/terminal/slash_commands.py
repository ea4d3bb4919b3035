"""What each slash command and each turn does to the session, the saved conversation and
the screen.

Owns: running one line (a slash command, or a message to the model), the `cmd_*` handler of
every command in commands.COMMANDS, one turn from the user's message to the saved reply
(Ctrl-C while the model writes closes the reply's stream; the session keeps the partial reply),
/retry's seed, /samples' choice, and which messages reach the conversation file.

Does not know: tokens or torch (the session does), the prompt, key bindings or history
(repl.py; a question for /samples comes through `Screen.ask`), Rich or how anything is drawn
(the `Screen` it is given), how a command line is parsed (commands.py), or where settings
come from (cli.py). Nothing here exits the process: a bad turn or command prints one red line
and the caller goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from chatcli.chat.command_parsing import (
    COMMANDS,
    SHOW_SETTING,
    SYSTEM_CLEAR,
    CommandError,
    find_command,
    help_text,
    is_command,
    parse_command,
    unescape_message,
)
from chatcli.chat.conversation_store import (
    ConversationFile,
    ConversationSink,
    NewConversation,
    export_json,
    export_markdown,
    list_conversations,
    read_conversation,
    resolve_conversation,
)
from chatcli.chat.settings import Settings, format_setting
from chatcli.chat.stream import StreamEvent
from chatcli.chat.turns import SEED_RANGE, random_seed
from chatcli.errors import ChatcliError, ConversationFileError
from chatcli.terminal.keyboard import interrupts_held, quiet_keyboard

if TYPE_CHECKING:
    from chatcli.chat.turns import Reply, SamplingOptions, TurnNotice, TurnStats


# ---- what this module needs of the session and of the terminal ---------------------------------


class Session(Protocol):
    """What the commands need of a chat session (session.ChatSession, remote.RemoteSession)."""

    can_sample_replies: bool  # /samples: n replies over one prefill (a local model's)
    can_show_raw: bool  # a `raw` flag makes its replies the exact token text
    options: SamplingOptions
    system: str | None
    last_reply: Reply | None
    history_stats: list[TurnStats]

    @property
    def messages(self) -> list[dict[str, Any]]: ...

    @property
    def transcript(self) -> tuple[list[dict[str, Any]], list[str | None]]:
        """The whole conversation (exchanges dropped for the context included) and each
        message's finish_reason where known: what /save and /export write."""
        ...

    @property
    def context_len(self) -> int: ...

    def send(self, text: str) -> Iterator[StreamEvent]: ...

    def regenerate(self) -> Iterator[StreamEvent]: ...

    def continue_reply(self) -> Iterator[StreamEvent]: ...

    def sample_replies(self, text: str, n: int) -> list[Reply]: ...

    def accept_reply(self, reply: Reply) -> None: ...

    def undo(self) -> bool: ...

    def pop_last_reply(self) -> dict[str, Any] | None: ...

    def clear(self) -> None: ...

    def set_system(self, text: str | None) -> None: ...

    def load_messages(
        self, messages: list[dict[str, Any]], finishes: Sequence[str | None] | None = None
    ) -> None: ...

    def take_notices(self) -> list[TurnNotice]: ...


class ReplyView(Protocol):
    """One streamed reply on the screen (render.ReplyRenderer)."""

    def handle(self, event: StreamEvent) -> None: ...

    def finish(self, finish_reason: str) -> None: ...


class Screen(Protocol):
    """What the commands need of the terminal (repl.ChatUI): places to draw, one question
    asked of the person for /samples, and how replies are drawn (/markdown sets it)."""

    markdown_mode: str  # auto, always or never

    def renderer(self, raw: bool = False) -> ReplyView:
        """A view for one reply; `raw`: the reply is exact token text, special tokens
        included, to show as it is (never read as Markdown)."""
        ...

    def notice(self, message: str) -> None: ...

    def error(self, message: str) -> None: ...

    def status(self, stats: Mapping[str, object]) -> None: ...

    def text(self, message: str) -> None: ...

    def interrupted(self) -> None: ...

    def table(self, headers: Sequence[str], rows: Iterable[Sequence[str]]) -> None: ...

    def replies(
        self, replies: Sequence[tuple[Sequence[Mapping[str, str]], str]], tools: bool = True
    ) -> None:
        """Alternative replies side by side: each as its parts and a one-line subtitle.
        tools: whether the calculator ran (off: a call without a result was not run)."""
        ...

    def ask(self, question: str) -> str | None:
        """A one-line answer; None when the person declined (Ctrl-C). Ctrl-D, or the end of
        piped input, is an empty answer, as Enter."""
        ...

    def recap(self, messages: Sequence[Mapping[str, object]]) -> None:
        """Where a loaded conversation left off: its last question and reply."""
        ...


# ---- running a line -----------------------------------------------------------------------------


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def _quote(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return f'"{text[: limit - 1]}…"' if len(text) > limit else f'"{text}"'


def _one_line(error: Exception) -> str:
    if isinstance(error, ChatcliError):
        return str(error)
    # Not one of ours: a bug or a system failure. Name it, but keep it to one line.
    detail = " ".join(str(error).split())
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


def _is_exit(line: str) -> bool:
    """True for /exit or one of its aliases (/quit, /bye)."""
    if not is_command(line):
        return False
    try:
        return parse_command(line).name == "exit"
    except CommandError:
        return False


def _close(events: Iterator[StreamEvent]) -> None:
    # Closing the session's generator ends its turn as "interrupted" (in its finally block).
    close = getattr(events, "close", None)
    if close is not None:
        close()


def _reply_meta(reply: Reply) -> dict[str, object]:
    """What is saved beside a reply: enough to tell how it ended and to reproduce it."""
    stats = reply.stats
    return {"finish_reason": stats.finish_reason, "seed": stats.seed, "stats": stats.as_dict()}


def _json_value(value: object) -> object:
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


class ChatCommands:
    """Runs each line the person typed: a slash command, or a message to the model (one turn)."""

    def __init__(
        self,
        session: Session,
        screen: Screen,
        settings: Settings,
        conversation: ConversationSink | None,
        conversations_dir: Path,
        model_info: Mapping[str, object] | None,
    ) -> None:
        self.session = session
        self.screen = screen
        self.settings = settings
        self.conversation = conversation
        self.conversations_dir = conversations_dir
        self.model_info = dict(model_info or {})
        self.raw = settings.raw
        self._set_session_raw(self.raw)
        self.samples_next: int | None = None  # /samples N: the next message gets N replies
        self.retries = 0  # /retry's of the last reply so far: a fixed seed moves on by one each
        self.handlers: dict[str, Callable[[Any], bool]] = {
            name: getattr(self, "cmd_" + name) for name in COMMANDS
        }

    def handle(self, line: str) -> bool:
        """Runs one line; False means leave. Errors are printed, never raised."""
        if not line.strip():
            return True
        try:
            if is_command(line):
                command = parse_command(line)
                if command.arg is SHOW_SETTING:
                    return self._show_setting(command.name)
                return self.handlers[command.name](command.arg)
            if line.strip() == "/":  # an Enter on the command menu's first key, surely
                raise CommandError(
                    "/ alone is not a command: /help lists them (// sends a single /)."
                )
            message = unescape_message(line)
            if self.samples_next is not None:
                n, self.samples_next = self.samples_next, None
                return self.choose_reply(message, n)
            else:
                self.send(message)
        except Exception as e:
            self.screen.error(_one_line(e))
        return True

    # ---- turns ----------------------------------------------------------------------------------

    def send(self, text: str) -> None:
        self._check_answered()
        events = self.session.send(text)  # a message that cannot fit raises here, unsaved
        self.retries = 0
        self.stream(events, replace=False, question={"role": "user", "content": text})

    def _check_answered(self) -> None:
        # Only a resumed file ends in a question (chatcli was stopped mid-turn): a second
        # one after it would give the model two questions in a row, and a server a 400.
        messages = self.session.messages
        if messages and messages[-1]["role"] == "user":
            raise ChatcliError(
                "The last question has no reply yet: /retry answers it, /undo drops it."
            )

    def stream(
        self,
        events: Iterator[StreamEvent],
        replace: bool,
        question: dict[str, Any] | None = None,
    ) -> None:
        """Shows one streamed reply, then its status line, then saves it (after `question`,
        the message it answers, where it is a new one).

        The question is saved once the reply has begun, or once the turn is over and the
        session still holds it: a server refuses a message only once it is sent, and the
        session takes it back, so a refused one never reaches the file (nor makes one)."""
        before = self.session.last_reply
        asked = len(self.session.messages)

        def save_question() -> None:
            nonlocal question
            if question is not None and len(self.session.messages) >= asked:
                message, question = question, None
                self._save(lambda c: c.append_message(message))

        renderer: ReplyView | None = None
        first = True
        interrupted, failure = False, None
        try:
            # Keys typed meanwhile wait for the prompt, not the reply. Inside the try: a
            # Ctrl-C while the terminal's modes are put back still closes the turn below.
            with quiet_keyboard():
                self.show_notices()
                renderer = self.screen.renderer(raw=self.raw and self.session.can_show_raw)
                for event in events:
                    if first:
                        save_question()  # a reply has begun: a killed process keeps the question
                        self.show_notices()  # e.g. old exchanges dropped to make room
                        first = False
                    renderer.handle(event)
        except KeyboardInterrupt:
            interrupted = True
        except BaseException as e:
            failure = e
        # Closing the turn: a second Ctrl-C here would leave it half closed (unmarked, the
        # file a message behind the session).
        with interrupts_held():
            if interrupted:
                _close(events)
                if renderer is not None:
                    renderer.finish("interrupted")
                else:
                    self.screen.interrupted()
                messages = self.session.messages
                if question is not None and messages and messages[-1]["role"] == "user":
                    # Ctrl-C before the session's turn began (its stream never ran, so
                    # nothing closed it): the question goes, unsaved, rather than wait
                    # without a reply.
                    self.session.undo()
                    question = None
                    self.screen.notice("Stopped before the reply began: your message was dropped.")
            elif failure is not None:
                _close(events)  # a failure outside the stream must still end the turn
                if renderer is not None:
                    renderer.finish("error")
                save_question()
                self._save_reply(before, replace)  # the session closed the turn: keep in step
                raise failure
            else:
                reply = self.session.last_reply
                assert renderer is not None  # made before the stream ran
                renderer.finish(reply.stats.finish_reason if reply is not None else "stop")
            save_question()
            self.show_notices()
            reply = self.session.last_reply
            if reply is not None and reply is not before:
                self.screen.status(reply.stats.as_dict())
            self._save_reply(before, replace)

    def _save_reply(self, before: Reply | None, replace: bool) -> None:
        reply = self.session.last_reply
        if reply is None or reply is before:
            return
        meta = _reply_meta(reply)
        if replace:
            self._save(lambda c: c.replace_last(reply.message, meta))
        else:
            self._save(lambda c: c.append_message(reply.message, meta))

    def _save(self, write: Callable[[ConversationSink], None]) -> None:
        if self.conversation is None:
            return
        try:
            write(self.conversation)
        except ConversationFileError as e:
            # Saving is a convenience: a full disk or an unwritable folder should not end
            # the chat, nor repeat its error at every turn.
            self.conversation = None
            self.screen.error(f"{_one_line(e)} This conversation is not saved from here on.")

    def show_notices(self) -> None:
        for notice in self.session.take_notices():
            self.screen.notice(notice.text)

    def choose_reply(self, text: str, n: int) -> bool:
        """/samples: n replies side by side; the one the person keeps joins the conversation.
        False when the person typed /exit at the question: leave."""
        self._check_answered()
        try:
            replies = self.session.sample_replies(text, n)
        except KeyboardInterrupt:
            self._drop_question(text)
            self.screen.interrupted()
            return True
        except BaseException:
            self._drop_question(text)
            raise
        self.show_notices()
        self.screen.replies(
            [(r.parts, f"{r.stats.tokens_out} tok · {r.stats.finish_reason}") for r in replies],
            tools=self.session.options.tools,
        )
        choice = self._ask_choice(n)
        if choice is None or choice == 0:
            self.session.undo()
            self.screen.notice("Kept none; your message was dropped too.")
            return choice == 0
        reply = replies[choice - 1]
        self.session.accept_reply(reply)
        self.retries = 0
        self.screen.notice(f"Kept reply {choice}.")
        self.screen.status(reply.stats.as_dict())
        self.show_notices()  # a context nearly full
        meta = {**_reply_meta(reply), "sample": f"{choice}/{n}"}
        self._save(lambda c: c.append_message({"role": "user", "content": text}))
        self._save(lambda c: c.append_message(reply.message, meta))
        return True

    def _ask_choice(self, n: int) -> int | None:
        """The number of the reply to keep, 0 for none; None for /exit (or /quit): leave."""
        while True:
            answer = self.screen.ask(f"Keep which reply? [1-{n}, Enter=1, 0=none] ")
            if answer is None:
                return 0
            if not answer:
                return 1
            if answer.isdigit() and 0 <= int(answer) <= n:
                return int(answer)
            if _is_exit(answer):
                return None
            self.screen.error(f"Type a number from 0 to {n}, or /exit to leave; got {answer!r}.")

    def _drop_question(self, text: str) -> None:
        messages = self.session.messages
        if messages and messages[-1] == {"role": "user", "content": text}:
            self.session.undo()

    # ---- settings -------------------------------------------------------------------------------

    def _echo(self, name: str, value: object) -> bool:
        self.screen.notice(f"{name} = {format_setting(name, value)}")
        return True

    def _setting_values(self) -> dict[str, object]:
        """The settings a command changes, as format_setting takes them."""
        options = self.session.options
        return {
            "temperature": options.temperature,
            "top_k": options.top_k or 0,
            "top_p": options.top_p or 1.0,
            "max_tokens": options.max_tokens,
            "seed": options.seed,
            "tools": options.tools,
            "raw": self.raw,
            "markdown": self.screen.markdown_mode,
        }

    def _show_setting(self, name: str) -> bool:
        shown = format_setting(name, self._setting_values()[name])
        self.screen.notice(f"{name} = {shown} ({find_command(name).usage} changes it)")
        return True

    def cmd_temperature(self, value: float) -> bool:
        self.session.options.temperature = value
        return self._echo("temperature", value)

    def cmd_top_k(self, value: int) -> bool:
        self.session.options.top_k = value or None
        return self._echo("top_k", value)

    def cmd_top_p(self, value: float) -> bool:
        self.session.options.top_p = value if value < 1.0 else None
        return self._echo("top_p", value)

    def cmd_max_tokens(self, value: int) -> bool:
        self.session.options.max_tokens = value
        return self._echo("max_tokens", value)

    def cmd_seed(self, value: int | None) -> bool:
        self.session.options.seed = value
        return self._echo("seed", value)

    def cmd_tools(self, value: bool) -> bool:
        self.session.options.tools = value
        return self._echo("tools", value)

    def cmd_raw(self, value: bool) -> bool:
        self.raw = value
        if not self._set_session_raw(value):
            self.screen.notice(f"raw = {_on_off(value)} (this session cannot show special tokens)")
            return True
        return self._echo("raw", value)

    def cmd_markdown(self, value: str) -> bool:
        self.screen.markdown_mode = value  # from the next reply on
        return self._echo("markdown", value)

    def _set_session_raw(self, value: bool) -> bool:
        if not self.session.can_show_raw:
            return False
        self.session.raw = value  # type: ignore[attr-defined]
        return True

    def cmd_system(self, value: str | None) -> bool:
        if value is None:
            current = self.session.system
            if current:
                self.screen.notice(f"System prompt: {current}")
            else:
                self.screen.notice("No system prompt. /system TEXT sets one.")
            return True
        text = None if value == SYSTEM_CLEAR else value
        self.session.set_system(text)
        self._save(lambda c: c.append_system(text))
        self.screen.notice(f"System prompt set: {text}" if text else "System prompt removed.")
        return True

    def cmd_settings(self, _: None) -> bool:
        model = self.model_info.get("tag") or self.model_info.get("path")
        rows = [
            ("model", str(model) if model else format_setting("model", self.settings.model)),
            *(
                (name, format_setting(name, value))
                for name, value in self._setting_values().items()
            ),
            ("system", format_setting("system", self.session.system)),
            (
                "context",
                f"{self.session.context_len} tokens" if self.session.context_len else "not known",
            ),
            ("conversation", self._conversation_label()),
        ]
        self.screen.table(("setting", "value"), rows)
        return True

    # ---- the conversation -----------------------------------------------------------------------

    def cmd_clear(self, _: None) -> bool:
        self.session.clear()
        self.retries = 0
        before = self.conversation.id if self.conversation else None
        if self.conversation is not None:
            # A new file at the next message: the one before stays whole, for --resume.
            model = self.model_info.get("path")
            self.conversation = NewConversation(
                self.conversations_dir, model=_json_value(model), system=self.session.system
            )
        kept = f" The last one is saved as {before}." if before else ""
        self.screen.notice(f"New conversation.{kept}")
        return True

    def _conversation_label(self) -> str:
        if self.conversation is None:
            return "(not saved)"
        return self.conversation.id or "(saved from its first message)"

    def cmd_undo(self, _: None) -> bool:
        messages = self.session.messages
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users or not self.session.undo():
            self.screen.notice("Nothing to undo.")
            return True
        self.retries = 0
        self._save(lambda c: c.append_undo())
        question = _quote(str(messages[users[-1]]["content"]))
        answered = users[-1] < len(messages) - 1
        self.screen.notice(f"Undone: {question}{' and its reply' if answered else ''}.")
        return True

    def cmd_retry(self, _: None) -> bool:
        options = self.session.options
        fixed = options.seed
        messages = self.session.messages
        if messages and messages[-1]["role"] == "user":
            # A question left without its reply (a resumed file): its first answer, not a
            # retry, so a fixed seed answers as it would have.
            self.retries = 0
            self.screen.notice("Answering the last question.")
            self.stream(self.session.regenerate(), replace=False)
            return True
        retry = self.retries + 1
        if fixed is None:
            seed, why = random_seed(), ""
        else:
            # Reproducible yet different: the n-th retry of a reply uses the fixed seed + n.
            seed = (fixed + retry) % SEED_RANGE
            why = f" (the fixed seed {fixed} + {retry})"
        self.session.pop_last_reply()  # a session puts it back if no new reply can come
        events = self.session.regenerate()
        self.retries = retry
        self.screen.notice(f"retry with seed {seed}{why}")
        # The session reads the seed when the stream starts, so it stays set until it ends.
        options.seed = seed
        try:
            self.stream(events, replace=True)
        finally:
            options.seed = fixed
        return True

    def cmd_continue(self, _: None) -> bool:
        self.stream(self.session.continue_reply(), replace=True)
        return True

    def cmd_samples(self, n: int) -> bool:
        # A session that cannot sample (a server's: one reply per request) says so now,
        # not after the message is typed.
        if not self.session.can_sample_replies:
            raise ChatcliError(
                "/samples is not supported against a server; it needs a local model."
            )
        self.samples_next = n
        same = (
            " At temperature 0 they are all the same reply: /temperature 0.8 varies them."
            if self.session.options.temperature == 0
            else ""
        )
        self.screen.notice(f"Your next message gets {n} replies side by side; you keep one.{same}")
        return True

    # ---- files ----------------------------------------------------------------------------------

    def cmd_save(self, name: str | None) -> bool:
        current = self.conversation
        if name is None and current is not None and current.path is not None:
            self.screen.notice(
                f"This conversation is saved already, as {current.id} ({current.path}); every "
                "turn is. "
                "/save NAME writes a copy under NAME."
            )
            return True
        model = self.model_info.get("path")
        saved = ConversationFile.create(self.conversations_dir, name, model=_json_value(model))
        messages, finishes = self.session.transcript
        saved.append_all(messages, finishes)
        self.conversation = saved
        count = sum(m["role"] != "system" for m in messages)
        self.screen.notice(
            f"Saved {count} messages to {saved.path}; new turns are saved there too."
        )
        return True

    def cmd_load(self, name: str) -> bool:
        path = resolve_conversation(self.conversations_dir, name)
        loaded = read_conversation(path)
        for warning in loaded.warnings:
            self.screen.notice(f"{path.name}: {warning}")
        self.session.load_messages(loaded.messages, loaded.finishes)
        self.retries = 0
        self.conversation = ConversationFile(path, path.stem)  # what --resume and /load take
        if loaded.repaired:  # what comes next must replay onto what was loaded
            self._save(lambda c: c.append_snapshot(loaded.messages, loaded.finishes))
        count = sum(1 for m in loaded.messages if m["role"] != "system")
        self.screen.notice(f"Loaded {count} messages from {self.conversation.id}.")
        self.screen.recap(loaded.messages)
        self.hint_unanswered()
        return True

    def hint_unanswered(self) -> None:
        """After a resume or /load: a conversation that ends in a question (chatcli was stopped
        mid-turn) says at once what to do with it, not after the next message is refused."""
        messages = self.session.messages
        if messages and messages[-1]["role"] == "user":
            self.screen.notice(
                "The last question has no reply yet: /retry answers it, /undo drops it."
            )

    def cmd_history(self, _: None) -> bool:
        summaries = list_conversations(self.conversations_dir)
        if not summaries:
            self.screen.notice(f"No saved conversations in {self.conversations_dir}.")
            return True
        current = self.conversation.path if self.conversation else None
        rows = [
            (
                ("* " if s.path == current else "") + s.id,
                f"{s.modified:%Y-%m-%d %H:%M}",
                str(s.messages) if s.problem is None else "-",
                s.preview if s.problem is None else f"(unreadable: {s.problem})",
            )
            for s in summaries
        ]
        self.screen.table(("id", "modified", "messages", "preview"), rows)
        return True

    def cmd_export(self, arg: tuple[str, str]) -> bool:
        fmt, where = arg
        path = Path(where).expanduser()
        messages, _ = self.session.transcript
        count = sum(m["role"] != "system" for m in messages)  # as /save and /load count
        if not count:
            raise ChatcliError("Nothing to export yet: the conversation has no messages.")
        text = export_markdown(messages) if fmt == "md" else export_json(messages)
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as e:
            raise ChatcliError(f"Cannot write {path} ({e}). Pick another path.") from None
        kind = "Markdown" if fmt == "md" else "JSON"
        self.screen.notice(f"Wrote {count} messages to {path} as {kind}.")
        return True

    # ---- information ----------------------------------------------------------------------------

    def cmd_help(self, name: str | None) -> bool:
        self.screen.text(help_text(name))
        return True

    def cmd_stats(self, _: None) -> bool:
        turns = self.session.history_stats
        if not turns:
            self.screen.notice("No turns yet.")
            return True
        rows = [
            (
                str(i),
                # 0: not measured (stopped before the prefill or the first token), as the
                # status line leaves it out
                f"{s.ttft_s:.2f}s" if s.ttft_s else "-",
                f"{s.prefill_tps:.0f}" if s.prefill_tps else "-",
                f"{s.decode_tps:.0f}" if s.decode_tps else "-",
                str(s.tokens_in),
                str(s.tokens_out),
                s.finish_reason,
            )
            for i, s in enumerate(turns, start=1)
        ]
        headers = ("turn", "ttft", "prefill tok/s", "decode tok/s", "in", "out", "finish")
        self.screen.table(headers, rows)
        return True

    def cmd_model(self, _: None) -> bool:
        if not self.model_info:
            self.screen.notice("No information about the model.")
            return True
        rows = []
        for key, value in self.model_info.items():
            if isinstance(value, float):
                shown = f"{value:.2f}"
            elif isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
                shown = f"{value:,}"
            else:
                shown = "-" if value in (None, "") else str(value)
            rows.append((key, shown))
        self.screen.table(("", ""), rows)
        return True

    def cmd_exit(self, _: None) -> bool:
        return False

    def goodbye(self) -> None:
        """On leaving: where the conversation was saved, and how to pick it up again."""
        if (
            self.conversation is not None
            and self.conversation.id is not None
            and any(m["role"] != "system" for m in self.session.messages)
        ):
            cid = self.conversation.id
            path = self.conversation.path
            # A file outside the conversations folder (/load PATH) is found by its path.
            where = cid if path is None or path.parent == self.conversations_dir else str(path)
            self.screen.notice(f"Saved as {cid}; chatcli chat --resume {where} picks it up.")
