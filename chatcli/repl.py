"""The interactive chat loop: reading what the person types, running it, showing the answer.

Owns: the prompt (prompt-toolkit lives only here: key bindings, history, Tab completion of
slash commands, the `\"\"\"` multi-line block), what each slash command does to the session
and the saved conversation, and one turn from the user's message to the saved reply (Ctrl-C
while the model writes closes the reply's stream; the session keeps the partial reply).

Does not know: tokens or torch (the session does), how a reply is drawn (render.py), how a
command line is parsed (commands.py), or where settings come from (cli.py). Nothing here
exits the process: a bad turn or command prints one red line and the loop goes on.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.enums import DEFAULT_BUFFER
from prompt_toolkit.filters import has_focus
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.input import Input
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.output import Output
from prompt_toolkit.styles import Style
from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from chatcli.commands import (
    COMMANDS,
    SYSTEM_CLEAR,
    CommandError,
    find_command,
    help_text,
    is_command,
    parse_command,
    unescape_message,
)
from chatcli.conversation_store import (
    SUFFIX,
    ConversationFile,
    export_json,
    export_markdown,
    list_conversations,
    read_conversation,
    resolve_conversation,
)
from chatcli.errors import ChatcliError
from chatcli.render import (
    ReplyRenderer,
    format_badge,
    render_error,
    render_notice,
    render_status,
    use_markdown,
)
from chatcli.settings import Settings, format_setting, history_path
from chatcli.stream import StreamEvent

if TYPE_CHECKING:
    from chatcli.session import Reply, SamplingOptions, TurnNotice, TurnStats

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK_QUOTES = '"""'
LEAVE_HINT = "(Press Ctrl-D or type /exit to leave)"
SEED_RANGE = 2**31  # the range ChatSession draws its random seeds from


class Session(Protocol):
    """What the REPL needs of a chat session (chatcli.session.ChatSession)."""

    options: SamplingOptions
    system: str | None
    last_reply: Reply | None
    history_stats: list[TurnStats]

    @property
    def messages(self) -> list[dict[str, Any]]: ...

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

    def load_messages(self, messages: list[dict[str, Any]]) -> None: ...

    def take_notices(self) -> list[TurnNotice]: ...


# ---- the input line -----------------------------------------------------------------------------


def block_is_open(text: str) -> bool:
    """True while the text is a `\"\"\"` block still waiting for its closing quotes."""
    stripped = text.strip()
    return stripped.startswith(BLOCK_QUOTES) and (
        len(stripped) < 2 * len(BLOCK_QUOTES) or not stripped.endswith(BLOCK_QUOTES)
    )


def message_from_input(text: str) -> str:
    """What the person meant to send: a closed `\"\"\"` block loses its quotes and the blank
    lines they stood on; anything else loses its outer whitespace."""
    stripped = text.strip()
    if not stripped.startswith(BLOCK_QUOTES) or block_is_open(stripped):
        return stripped
    lines = stripped[len(BLOCK_QUOTES) : -len(BLOCK_QUOTES)].split("\n")
    if lines and not lines[0].strip():
        del lines[0]
    if lines and not lines[-1].strip():
        del lines[-1]
    return "\n".join(lines)


class CommandCompleter(Completer):
    """Tab completion: command names (with their description) after "/", and the arguments
    a few commands take from a short list."""

    def __init__(self, conversations_dir: Path) -> None:
        self.conversations_dir = conversations_dir

    def get_completions(
        self, document: Document, complete_event: CompleteEvent
    ) -> Iterable[Completion]:
        text = document.text_before_cursor
        if not text.startswith("/") or "\n" in text:
            return
        word, space, rest = text[1:].partition(" ")
        if not space:
            for spec in COMMANDS.values():
                if spec.name.startswith(word.lower()):
                    # Commands that take an argument complete with a space, ready for it.
                    suffix = " " if " " in spec.usage else ""
                    yield Completion(
                        spec.name + suffix,
                        start_position=-len(word),
                        display="/" + spec.name,
                        display_meta=spec.description,
                    )
            return
        if " " in rest:
            return
        try:
            name = find_command(word).name
        except CommandError:
            return
        for choice in self._choices(name):
            if choice.startswith(rest):
                yield Completion(choice, start_position=-len(rest))

    def _choices(self, name: str) -> list[str]:
        if name == "help":
            return list(COMMANDS)
        if name in ("tools", "raw"):
            return ["on", "off"]
        if name == "export":
            return ["md", "json"]
        if name == "seed":
            return ["random"]
        if name == "system":
            return [SYSTEM_CLEAR]
        if name == "load" and self.conversations_dir.is_dir():
            files = self.conversations_dir.glob("*" + SUFFIX)
            return sorted((p.stem for p in files), reverse=True)
        return []


# ---- tables and side-by-side replies (plain data in, Rich out) ----------------------------------


def render_table(console: Console, headers: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    """A small table; a header of "" leaves the header row out."""
    table = Table(box=box.SIMPLE_HEAD, show_header=any(headers), show_edge=False, pad_edge=False)
    for header in headers:
        table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def reply_text(parts: Sequence[Mapping[str, str]]) -> Text:
    """A finished reply's parts as text, each calculator call as its `[calc ...]` badge."""
    text = Text()
    pending: str | None = None  # the expression of a call whose result may follow
    for part in parts:
        if part["type"] == "python_output":
            text.append(f"[{format_badge(pending or '?', part['text'])}]", style="calc")
            pending = None
            continue
        if pending is not None:
            text.append(f"[{format_badge(pending, None)}]", style="calc")
            pending = None
        if part["type"] == "python":
            pending = part["text"]
        else:
            text.append(part["text"], style="assistant")
    if pending is not None:
        text.append(f"[{format_badge(pending, None)}]", style="calc")
    return text


def render_replies(console: Console, replies: Sequence[tuple[Text, str]]) -> None:
    """Alternative replies in panels titled 1..N with a subtitle each: side by side when
    each can have 40 columns, one after another otherwise."""
    panels = [
        Panel(body, title=str(i), subtitle=subtitle, title_align="left")
        for i, (body, subtitle) in enumerate(replies, start=1)
    ]
    if console.width < 40 * len(panels):
        for panel in panels:
            console.print(panel)
        return
    grid = Table.grid(expand=True, padding=(0, 1))
    for _ in panels:
        grid.add_column(ratio=1)
    grid.add_row(*panels)
    console.print(grid)


# ---- the terminal -------------------------------------------------------------------------------


class ChatUI:
    """The terminal side of a chat: the console, the prompt and its history, and drawing."""

    def __init__(
        self,
        console: Console,
        settings: Settings,
        conversations_dir: Path,
        input: Input | None = None,
        output: Output | None = None,
    ) -> None:
        self.console = console
        self.markdown_mode = settings.markdown
        self._input, self._output = input, output
        self._cancelled_empty = False  # set by Ctrl-C at the prompt: was the line empty?
        self._prompt = PromptSession(
            message=[("class:prompt", PROMPT)],
            multiline=True,
            prompt_continuation=CONTINUATION,
            key_bindings=self._key_bindings(),
            history=self._history(settings),
            completer=CommandCompleter(conversations_dir),
            complete_while_typing=True,
            style=Style.from_dict({"prompt": "bold ansigreen"}),
            input=input,
            output=output,
        )
        self._question: PromptSession[str] | None = None  # for /samples; no history of its own

    def _history(self, settings: Settings) -> History:
        if not settings.history:
            return InMemoryHistory()
        path = history_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        except OSError as e:
            self.notice(f"Input history is off: cannot write {path} ({e}).")
            return InMemoryHistory()
        return FileHistory(str(path))

    def _key_bindings(self) -> KeyBindings:
        bindings = KeyBindings()
        editing = has_focus(DEFAULT_BUFFER)  # not while Ctrl-R search has the focus

        @bindings.add("enter", filter=editing)
        def _submit(event: KeyPressEvent) -> None:
            buffer = event.current_buffer
            state = buffer.complete_state
            if state is not None and state.current_completion is not None:
                buffer.complete_state = None  # keep the picked command; its argument comes next
            elif block_is_open(buffer.text):
                buffer.newline(copy_margin=False)
            else:
                buffer.validate_and_handle()

        @bindings.add("escape", "enter", filter=editing)
        def _newline(event: KeyPressEvent) -> None:
            event.current_buffer.newline(copy_margin=False)

        @bindings.add("c-c", filter=editing)
        def _cancel(event: KeyPressEvent) -> None:
            self._cancelled_empty = not event.current_buffer.text
            event.app.exit(exception=KeyboardInterrupt(), style="class:aborting")

        return bindings

    def read_message(self) -> str | None:
        """The next thing typed, as it should be handled; None when Ctrl-C cancelled the line.
        Raises EOFError on Ctrl-D at an empty line."""
        try:
            text = self._prompt.prompt()
        except KeyboardInterrupt:
            if self._cancelled_empty:
                self.console.print(Text(LEAVE_HINT, style="status"))
            return None
        return message_from_input(text)

    def ask(self, question: str) -> str | None:
        """A one-line answer to a question; None on Ctrl-C or Ctrl-D."""
        if self._question is None:
            self._question = PromptSession(
                history=InMemoryHistory(), input=self._input, output=self._output
            )
        try:
            return self._question.prompt(question).strip()
        except (KeyboardInterrupt, EOFError):
            return None

    def renderer(self) -> ReplyRenderer:
        return ReplyRenderer(self.console, markdown=use_markdown(self.console, self.markdown_mode))

    def notice(self, message: str) -> None:
        render_notice(self.console, message)

    def error(self, message: str) -> None:
        render_error(self.console, message)

    def status(self, stats: Mapping[str, object]) -> None:
        render_status(self.console, stats)

    def text(self, message: str) -> None:
        self.console.print(Text(message), soft_wrap=True)


# ---- what each line does ------------------------------------------------------------------------


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


class Repl:
    """Runs each line: a slash command, or a message to the model (one turn)."""

    def __init__(
        self,
        session: Session,
        ui: ChatUI,
        settings: Settings,
        conversation: ConversationFile | None,
        conversations_dir: Path,
        model_info: Mapping[str, object] | None,
    ) -> None:
        self.session = session
        self.ui = ui
        self.settings = settings
        self.conversation = conversation
        self.conversations_dir = conversations_dir
        self.model_info = dict(model_info or {})
        self.raw = settings.raw
        self._set_session_raw(self.raw)
        self.samples_next: int | None = None  # /samples N: the next message gets N replies
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
                return self.handlers[command.name](command.arg)
            message = unescape_message(line)
            if self.samples_next is not None:
                n, self.samples_next = self.samples_next, None
                self.choose_reply(message, n)
            else:
                self.send(message)
        except Exception as e:
            self.ui.error(_one_line(e))
        return True

    # ---- turns ----------------------------------------------------------------------------------

    def send(self, text: str) -> None:
        events = self.session.send(text)  # a message that cannot fit raises here, unsaved
        self._save(lambda c: c.append_message({"role": "user", "content": text}))
        self.stream(events, replace=False)

    def stream(self, events: Iterator[StreamEvent], replace: bool) -> None:
        """Shows one streamed reply, then its status line, then saves it."""
        before = self.session.last_reply
        self.show_notices()
        renderer = self.ui.renderer()
        first = True
        try:
            for event in events:
                if first:
                    self.show_notices()  # e.g. the context warning, raised at prefill
                    first = False
                renderer.handle(event)
        except KeyboardInterrupt:
            _close(events)
            renderer.finish("interrupted")
        except BaseException:
            _close(events)  # a failure outside the stream must still end the session's turn
            renderer.finish("error")
            self._save_reply(before, replace)  # the session closed the turn: keep both in step
            raise
        else:
            reply = self.session.last_reply
            renderer.finish(reply.stats.finish_reason if reply is not None else "stop")
        self.show_notices()
        reply = self.session.last_reply
        if reply is not None and reply is not before:
            self.ui.status(reply.stats.as_dict())
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

    def _save(self, write: Callable[[ConversationFile], None]) -> None:
        if self.conversation is not None:
            write(self.conversation)

    def show_notices(self) -> None:
        for notice in self.session.take_notices():
            self.ui.notice(notice.text)

    def choose_reply(self, text: str, n: int) -> None:
        """/samples: n replies side by side; the one the person keeps joins the conversation."""
        try:
            replies = self.session.sample_replies(text, n)
        except KeyboardInterrupt:
            self._drop_question(text)
            self.ui.console.print(Text("[interrupted]", style="interrupted"))
            return
        except BaseException:
            self._drop_question(text)
            raise
        self.show_notices()
        render_replies(
            self.ui.console,
            [
                (reply_text(r.parts), f"{r.stats.tokens_out} tok · {r.stats.finish_reason}")
                for r in replies
            ],
        )
        choice = self._ask_choice(n)
        if choice == 0:
            self.session.undo()
            self.ui.notice("Kept none; your message was dropped too.")
            return
        reply = replies[choice - 1]
        self.session.accept_reply(reply)
        self.ui.notice(f"Kept reply {choice}.")
        self.ui.status(reply.stats.as_dict())
        meta = {**_reply_meta(reply), "sample": f"{choice}/{n}"}
        self._save(lambda c: c.append_message({"role": "user", "content": text}))
        self._save(lambda c: c.append_message(reply.message, meta))

    def _ask_choice(self, n: int) -> int:
        while True:
            answer = self.ui.ask(f"Keep which reply? [1-{n}, Enter=1, 0=none] ")
            if answer is None:
                return 0
            if not answer:
                return 1
            if answer.isdigit() and 0 <= int(answer) <= n:
                return int(answer)
            self.ui.error(f"Type a number from 0 to {n}, got {answer!r}.")

    def _drop_question(self, text: str) -> None:
        messages = self.session.messages
        if messages and messages[-1] == {"role": "user", "content": text}:
            self.session.undo()

    # ---- settings -------------------------------------------------------------------------------

    def _echo(self, name: str, value: object) -> bool:
        self.ui.notice(f"{name} = {format_setting(name, value)}")
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
            self.ui.notice(f"raw = {_on_off(value)} (this session cannot show special tokens)")
            return True
        return self._echo("raw", value)

    def _set_session_raw(self, value: bool) -> bool:
        # ChatSession.raw makes its decoder emit special tokens; older sessions lack it.
        if not hasattr(self.session, "raw"):
            return False
        self.session.raw = value  # type: ignore[attr-defined]
        return True

    def cmd_system(self, value: str | None) -> bool:
        if value is None:
            current = self.session.system
            if current:
                self.ui.notice(f"System prompt: {current}")
            else:
                self.ui.notice("No system prompt. /system TEXT sets one.")
            return True
        text = None if value == SYSTEM_CLEAR else value
        self.session.set_system(text)
        self._save(lambda c: c.append_system(text))
        self.ui.notice(f"System prompt set: {text}" if text else "System prompt removed.")
        return True

    def cmd_settings(self, _: None) -> bool:
        options = self.session.options
        model = self.model_info.get("tag") or self.model_info.get("path")
        rows = [
            ("model", str(model) if model else format_setting("model", self.settings.model)),
            ("temperature", format_setting("temperature", options.temperature)),
            ("top_k", format_setting("top_k", options.top_k or 0)),
            ("top_p", format_setting("top_p", options.top_p or 1.0)),
            ("max_tokens", format_setting("max_tokens", options.max_tokens)),
            ("seed", format_setting("seed", options.seed)),
            ("tools", _on_off(options.tools)),
            ("raw", _on_off(self.raw)),
            ("markdown", self.settings.markdown),
            ("system", format_setting("system", self.session.system)),
            ("context", f"{self.session.context_len} tokens"),
            ("conversation", self.conversation.id if self.conversation else "(not saved)"),
        ]
        render_table(self.ui.console, ("setting", "value"), rows)
        return True

    # ---- the conversation -----------------------------------------------------------------------

    def cmd_clear(self, _: None) -> bool:
        self.session.clear()
        self._save(lambda c: c.append_clear())
        self.ui.notice("New conversation.")
        return True

    def cmd_undo(self, _: None) -> bool:
        messages = self.session.messages
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users or not self.session.undo():
            self.ui.notice("Nothing to undo.")
            return True
        self._save(lambda c: c.append_undo())
        question = _quote(str(messages[users[-1]]["content"]))
        answered = users[-1] < len(messages) - 1
        self.ui.notice(f"Undone: {question}{' and its reply' if answered else ''}.")
        return True

    def cmd_retry(self, _: None) -> bool:
        options = self.session.options
        fixed = options.seed
        seed = fixed if fixed is not None else random.randrange(SEED_RANGE)
        self.session.pop_last_reply()
        events = self.session.regenerate()
        self.ui.notice(
            f"retry with seed {seed}" + (" (fixed by /seed)" if fixed is not None else "")
        )
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
        self.samples_next = n
        self.ui.notice(f"Your next message gets {n} replies side by side; you keep one.")
        return True

    # ---- files ----------------------------------------------------------------------------------

    def cmd_save(self, name: str | None) -> bool:
        model = self.model_info.get("path")
        saved = ConversationFile.create(self.conversations_dir, name, model=_json_value(model))
        if self.session.system:
            saved.append_system(self.session.system)
        count = 0
        for message in self.session.messages:
            if message["role"] != "system":
                saved.append_message(message)
                count += 1
        self.conversation = saved
        self.ui.notice(f"Saved {count} messages to {saved.path}; new turns are saved there too.")
        return True

    def cmd_load(self, name: str) -> bool:
        path = resolve_conversation(self.conversations_dir, name)
        loaded = read_conversation(path)
        for warning in loaded.warnings:
            self.ui.notice(f"{path.name}: {warning}")
        self.session.load_messages(loaded.messages)
        self.conversation = ConversationFile(path, str(loaded.header.get("id") or path.stem))
        count = sum(1 for m in loaded.messages if m["role"] != "system")
        self.ui.notice(f"Loaded {count} messages from {self.conversation.id}.")
        return True

    def cmd_history(self, _: None) -> bool:
        summaries = list_conversations(self.conversations_dir)
        if not summaries:
            self.ui.notice(f"No saved conversations in {self.conversations_dir}.")
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
        render_table(self.ui.console, ("id", "modified", "messages", "preview"), rows)
        return True

    def cmd_export(self, arg: tuple[str, str]) -> bool:
        fmt, where = arg
        path = Path(where).expanduser()
        messages = self.session.messages
        text = export_markdown(messages) if fmt == "md" else export_json(messages)
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as e:
            raise ChatcliError(f"Cannot write {path} ({e}). Pick another path.") from None
        kind = "Markdown" if fmt == "md" else "JSON"
        self.ui.notice(f"Wrote {len(messages)} messages to {path} as {kind}.")
        return True

    # ---- information ----------------------------------------------------------------------------

    def cmd_help(self, name: str | None) -> bool:
        self.ui.text(help_text(name))
        return True

    def cmd_stats(self, _: None) -> bool:
        turns = self.session.history_stats
        if not turns:
            self.ui.notice("No turns yet.")
            return True
        rows = [
            (
                str(i),
                f"{s.ttft_s:.2f}s",
                f"{s.prefill_tps:.0f}",
                f"{s.decode_tps:.0f}",
                str(s.tokens_in),
                str(s.tokens_out),
                s.finish_reason,
            )
            for i, s in enumerate(turns, start=1)
        ]
        headers = ("turn", "ttft", "prefill tok/s", "decode tok/s", "in", "out", "finish")
        render_table(self.ui.console, headers, rows)
        return True

    def cmd_model(self, _: None) -> bool:
        if not self.model_info:
            self.ui.notice("No information about the model.")
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
        render_table(self.ui.console, ("", ""), rows)
        return True

    def cmd_exit(self, _: None) -> bool:
        return False

    def goodbye(self) -> None:
        if self.conversation is not None and any(
            m["role"] != "system" for m in self.session.messages
        ):
            cid = self.conversation.id
            self.ui.notice(f"Saved as {cid}; chatcli chat --resume {cid} picks it up.")


# ---- the loop -----------------------------------------------------------------------------------


def run_repl(
    session: Session,
    *,
    settings: Settings,
    console: Console,
    conversation: ConversationFile | None,
    conversations_dir: Path,
    model_info: Mapping[str, object] | None = None,
    input: Input | None = None,
    output: Output | None = None,
) -> int:
    """The interactive session; returns the exit code. `input`/`output` are prompt-toolkit's
    (a pipe input and DummyOutput in tests); None means the real terminal."""
    ui = ChatUI(console, settings, conversations_dir, input=input, output=output)
    repl = Repl(session, ui, settings, conversation, conversations_dir, model_info)
    while True:
        try:
            line = ui.read_message()
        except EOFError:
            break
        if line is None:
            continue
        try:
            if not repl.handle(line):
                break
        except KeyboardInterrupt:
            ui.notice("Interrupted.")  # Ctrl-C during a command, not during a reply
    repl.goodbye()
    return 0
