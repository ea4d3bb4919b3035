"""The interactive chat loop and its prompt: reading what the person types, handing it on.

Owns: the prompt (prompt-toolkit lives only here: key bindings, history, Tab completion of
slash commands, the `\"\"\"` multi-line block, Ctrl-C clearing the line and Ctrl-D leaving),
reading a stdin that is not a terminal line by line instead (no prompt, no escape codes),
`ChatUI` (the terminal: that input, plus drawing through render.py), and `run_repl`, a loop
that only loops: read a line, hand it to chat_commands, until the person leaves.

Does not know: what a command or a turn does (chat_commands.py), tokens or torch (the
session), Rich or how anything is drawn (render.py; the console passes through unopened), how
a command line is parsed (commands.py), or where settings come from (cli.py). Nothing here
exits the process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.enums import DEFAULT_BUFFER
from prompt_toolkit.filters import has_focus
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.input import Input
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.output import Output, create_output
from prompt_toolkit.styles import Style

from chatcli.chat.command_parsing import (
    COMMANDS,
    SET_NAMES,
    SHOW_WHAT,
    SYSTEM_CLEAR,
    CommandError,
    find_command,
)
from chatcli.chat.conversation_format import SUFFIX
from chatcli.chat.conversation_store import ConversationSink
from chatcli.chat.settings import Settings, history_path
from chatcli.chat.token_probs import TokenProb
from chatcli.chat.turns import readable_text
from chatcli.model.data_files import UnreadableFileError, check_readable
from chatcli.terminal.render import (
    ReplyRenderer,
    make_console,
    render_error,
    render_hint,
    render_interrupted,
    render_notice,
    render_status,
    render_text,
    use_markdown,
)
from chatcli.terminal.render_panels import render_recap, render_replies, render_table
from chatcli.terminal.render_probs import render_alternatives, render_probs
from chatcli.terminal.session_protocols import Session
from chatcli.terminal.slash_commands import ChatCommands

if TYPE_CHECKING:
    from chatcli.terminal.render import Console  # Rich's console: only render.py calls into it

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK_QUOTES = '"""'
LEAVE_HINT = "(Press Ctrl-D or type /exit to leave)"


# ---- the input line -----------------------------------------------------------------------------


def _opens(first_line: str) -> bool:
    """Whether a message's first line opens a block: it starts with the quotes, and text
    may follow them (`\"\"\"Hello`, as in ollama), but a line that closes its own quotes
    too (`\"\"\"hi\"\"\"`) is text."""
    line = first_line.strip()
    return line.startswith(BLOCK_QUOTES) and line.count(BLOCK_QUOTES) == 1


def _closes(line: str) -> bool:
    """Whether a later line closes the block: it ends with the quotes (`last line\"\"\"`, or
    the quotes alone) and starts at the line's start. Pasted code keeps its own: an indented
    `\"\"\"` ends a docstring, and `\"\"\"doc\"\"\"` holds a pair."""
    end = line.rstrip()
    return (
        end.endswith(BLOCK_QUOTES) and not line[:1].isspace() and end.count(BLOCK_QUOTES) % 2 == 1
    )


def block_is_open(text: str) -> bool:
    """True while the text is a `\"\"\"` block still waiting for its closing quotes."""
    first, *rest = text.strip().split("\n")
    return _opens(first) and not any(_closes(line) for line in rest)


def message_from_input(text: str) -> str:
    """What the person meant to send: a closed `\"\"\"` block the text between its quotes,
    as typed (its lines, with what follows the opening quotes and what precedes the
    closing ones); anything else (text after a block's closing line too: a paste that
    holds more, never cut short) the whole text less its outer whitespace."""
    stripped = text.strip()
    lines = stripped.split("\n")
    if len(lines) < 2 or not _opens(lines[0]) or block_is_open(stripped):
        return stripped
    end = next(i for i in range(1, len(lines)) if _closes(lines[i]))
    if end != len(lines) - 1:
        return stripped
    first = lines[0].strip()[len(BLOCK_QUOTES) :]
    last = lines[end].rstrip()[: -len(BLOCK_QUOTES)]
    body = ([first] if first else []) + lines[1:end] + ([last] if last else [])
    return "\n".join(body)


def prompt_output() -> Output | None:
    """Where the prompt draws: None (stdout) on a terminal. With stdout piped (`chatcli chat
    | tee log`) prompt-toolkit would draw its prompt and escape codes into the pipe, and
    read keys against a screen it cannot see: it draws on stderr's terminal instead, and
    stdout carries the replies alone."""
    if sys.stdout is not None and sys.stdout.isatty():
        return None
    if sys.stderr is None or not sys.stderr.isatty():
        return None  # no terminal at all: prompt-toolkit's own fallback
    return create_output(always_prefer_tty=True)


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
        if name == "set":
            return list(SET_NAMES)
        if name == "show":
            return list(SHOW_WHAT)
        if name == "system":
            return [SYSTEM_CLEAR]
        if name == "load" and self.conversations_dir.is_dir():
            files = self.conversations_dir.glob("*" + SUFFIX)
            return sorted((p.stem for p in files), reverse=True)
        return []


# ---- the terminal -------------------------------------------------------------------------------


def read_piped_message(lines: TextIO) -> str:
    """The next message from a stream that is not a terminal (`echo hi | chatcli chat`): one
    line, or a `\"\"\"` block over several. The last line counts without its newline; a block
    still open at the end is sent as it stands. Raises EOFError at the end of the stream."""
    line = lines.readline()
    if not line:
        raise EOFError
    text = line.rstrip("\r\n")
    while block_is_open(text):
        more = lines.readline()
        if not more:
            text += "\n" + BLOCK_QUOTES
            break
        text += "\n" + more.rstrip("\r\n")
    return message_from_input(text)


class ChatUI:
    """The terminal side of a chat: the console, the prompt and its history, and drawing.
    It is the `chat_commands.Screen` the commands draw on and ask their questions through.

    With `lines` (stdin when it is not a terminal) there is no prompt at all: messages and
    answers are read from it line by line, so piped input gives plain output."""

    def __init__(
        self,
        console: Console,
        settings: Settings,
        conversations_dir: Path,
        input: Input | None = None,
        output: Output | None = None,
        lines: TextIO | None = None,
        notes: Console | None = None,
    ) -> None:
        self.console = console
        self.markdown_mode = settings.markdown
        if output is None and lines is None:
            output = prompt_output()
        self._input, self._output = input, output
        self._lines = lines
        # Notices, status lines and errors: the terminal's, or stderr's where stdin is piped,
        # so stdout holds the replies (and command output) alone for whatever reads it.
        if notes is None:
            notes = console if lines is None else make_console(file=sys.stderr)
        self.notes = notes
        self.errors = 0  # errors shown: piped input exits 1 after any
        self._cancelled_empty = False  # set by Ctrl-C at the prompt: was the line empty?
        self._question: PromptSession[str] | None = None  # for /samples; no history of its own
        # No prompt at all on a pipe: prompt-toolkit would warn "Input is not a terminal" and
        # write its escape codes around every line.
        self._prompt = None if lines is not None else self._make_prompt(settings, conversations_dir)

    def _make_prompt(self, settings: Settings, conversations_dir: Path) -> PromptSession[str]:
        return PromptSession(
            message=[("class:prompt", PROMPT)],
            multiline=True,
            prompt_continuation=CONTINUATION,
            key_bindings=self._key_bindings(),
            history=self._history(settings),
            completer=CommandCompleter(conversations_dir),
            complete_while_typing=True,
            style=Style.from_dict({"prompt": "bold ansigreen"}),
            input=self._input,
            output=self._output,
        )

    def _history(self, settings: Settings) -> History:
        if not settings.history:
            return InMemoryHistory()
        path = history_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(path):  # a folder or a link loop there is named as such
                check_readable(path)
            path.touch()
        except UnreadableFileError as e:
            self.notice(f"Input history is off: {e}.")
            return InMemoryHistory()
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
                buffer.complete_state = None  # keep the pick
                if buffer.text.endswith(" "):
                    return  # a command that takes an argument: it comes next
                buffer.validate_and_handle()  # /stats, /clear, or a picked argument: done
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

    # ---- reading --------------------------------------------------------------------------------

    def read_message(self) -> str | None:
        """The next thing typed, as it should be handled; None when Ctrl-C cancelled the line.
        Raises EOFError on Ctrl-D at an empty line, or at the end of piped input."""
        if self._lines is not None:
            try:
                message = read_piped_message(self._lines)
            except KeyboardInterrupt:
                raise EOFError from None  # Ctrl-C while waiting on a pipe: leave
            return readable_text(message)
        assert self._prompt is not None
        try:
            text = self._prompt.prompt()
        except KeyboardInterrupt:
            if self._cancelled_empty:
                render_hint(self.console, LEAVE_HINT)
            return None
        return readable_text(message_from_input(text))

    def ask(self, question: str) -> str | None:
        """A one-line answer to a question; None on Ctrl-C. Ctrl-D, or the end of piped
        input, answers as Enter does ("", the question's default): a script that ends
        after /samples keeps the reply the question offers."""
        if self._lines is not None:
            try:
                line = self._lines.readline()
            except KeyboardInterrupt:
                return None
            return readable_text(line.strip())
        if self._question is None:
            self._question = PromptSession(
                history=InMemoryHistory(), input=self._input, output=self._output
            )
        try:
            return readable_text(self._question.prompt(question).strip())
        except KeyboardInterrupt:
            return None
        except EOFError:
            return ""

    # ---- drawing (render.py does it) ------------------------------------------------------------

    def renderer(self, raw: bool = False) -> ReplyRenderer:
        # Raw replies are the exact token text: Markdown would eat its `*` and `_`.
        markdown = not raw and use_markdown(self.console, self.markdown_mode)
        return ReplyRenderer(self.console, markdown=markdown)

    def notice(self, message: str) -> None:
        render_notice(self.notes, message)

    def error(self, message: str) -> None:
        self.errors += 1
        render_error(self.notes, message)

    def status(self, stats: Mapping[str, object]) -> None:
        render_status(self.notes, stats)

    def text(self, message: str) -> None:
        render_text(self.console, message)

    def interrupted(self) -> None:
        render_interrupted(self.console)

    def table(self, headers: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
        render_table(self.console, headers, rows)

    def replies(
        self, replies: Sequence[tuple[Sequence[Mapping[str, str]], str]], tools: bool = True
    ) -> None:
        render_replies(self.console, replies, tools)

    def recap(self, messages: Sequence[Mapping[str, object]]) -> None:
        render_recap(self.console, messages)

    def probs(self, probs: Sequence[TokenProb], position: int | None = None) -> None:
        if position is None:
            render_probs(self.console, probs)
        else:
            render_alternatives(self.console, probs, position)


# ---- the loop -----------------------------------------------------------------------------------


def run_repl(
    session: Session,
    *,
    settings: Settings,
    console: Console,
    conversation: ConversationSink | None,
    conversations_dir: Path,
    model_info: Mapping[str, object] | None = None,
    input: Input | None = None,
    output: Output | None = None,
    lines: TextIO | None = None,
    notes: Console | None = None,
) -> int:
    """The interactive session; returns the exit code. `input`/`output` are prompt-toolkit's
    (a pipe input and DummyOutput in tests); None means the real terminal. `lines`, a stream
    that is not a terminal (piped stdin), replaces the prompt: one message a line, until its
    end; then notices, status lines and errors go to `notes` (stderr's console by default),
    and any error makes the exit code 1, as a script expects."""
    ui = ChatUI(
        console, settings, conversations_dir, input=input, output=output, lines=lines, notes=notes
    )
    commands = ChatCommands(session, ui, settings, conversation, conversations_dir, model_info)
    commands.hint_unanswered()  # a resumed conversation that ends in a question
    while True:
        try:
            line = ui.read_message()
        except EOFError:
            break
        if line is None:
            continue
        try:
            if not commands.handle(line):
                break
        except KeyboardInterrupt:
            ui.notice("Interrupted.")  # Ctrl-C during a command, not during a reply
    commands.goodbye()
    return 1 if lines is not None and ui.errors else 0
