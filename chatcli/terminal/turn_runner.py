"""One turn of a chat on the terminal, from the person's message to the saved reply.

Owns: TurnRunner, which sends a message (or /samples' n of them side by side, the one kept
joining the conversation), shows the streamed reply and its status line, closes the turn on
Ctrl-C (the session keeps the partial reply) or a failure, and saves what the conversation
file must hold. slash_commands.ChatCommands is a TurnRunner that also runs the slash
commands. Does not know tokens or torch (the session does), nor how anything is drawn (the
Screen it is given).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatcli.chat.command_parsing import CommandError, is_command, parse_command
from chatcli.chat.conversation_store import (
    ConversationFile,
    ConversationFileRemoved,
    ConversationSink,
)
from chatcli.chat.stream import StreamEvent
from chatcli.errors import ChatcliError, ConversationFileError
from chatcli.terminal.keyboard import interrupts_held, quiet_keyboard
from chatcli.terminal.session_protocols import ReplyView, Screen, Session

if TYPE_CHECKING:
    from chatcli.chat.turns import Reply


def one_line(error: Exception) -> str:
    if isinstance(error, ChatcliError):
        return str(error)
    # Not one of ours: a bug or a system failure. Name it, but keep it to one line.
    detail = " ".join(str(error).split())
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


def is_exit(line: str) -> bool:
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


def reply_meta(reply: Reply) -> dict[str, object]:
    """What is saved beside a reply: enough to tell how it ended and to reproduce it."""
    stats = reply.stats
    return {"finish_reason": stats.finish_reason, "seed": stats.seed, "stats": stats.as_dict()}


class TurnRunner:
    """Runs turns of one session on one screen, saving them to `conversation` (if any)."""

    def __init__(
        self, session: Session, screen: Screen, conversation: ConversationSink | None, raw: bool
    ) -> None:
        self.session = session
        self.screen = screen
        self.conversation = conversation  # None: not saved (or no longer: a write failed)
        self.raw = raw  # show replies as their exact token text, where the session can
        self.retries = 0  # /retry's of the last reply so far: a fixed seed moves on by one each
        self.file_model: object = None  # the header's model, for a file started anew
        # (messages, finishes) a file saved anew holds: writes of what it holds already skip.
        self._saved_anew: tuple[list[dict[str, Any]], list[str | None]] | None = None

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
        meta = reply_meta(reply)
        if replace:
            self._save(lambda c: c.replace_last(reply.message, meta))
        else:
            self._save(lambda c: c.append_message(reply.message, meta))

    def _save(self, write: Callable[[ConversationSink], None]) -> None:
        if self.conversation is None:
            return
        if self._saved_anew is not None and self._saved_anew == self.session.transcript:
            return  # the file saved anew holds this already (a question and its reply at once)
        self._saved_anew = None
        try:
            write(self.conversation)
        except ConversationFileRemoved as e:
            self._save_anew(e.path)
        except ConversationFileError as e:
            # Saving is a convenience: a full disk or an unwritable folder should not end
            # the chat, nor repeat its error at every turn.
            self.conversation = None
            self.screen.error(f"{one_line(e)} This conversation is not saved from here on.")

    def _save_anew(self, gone: Path) -> None:
        """The conversation's file was removed while the chat ran: a new file in its folder,
        its header first, holds the whole conversation so far (what the failed write held
        too), and one line says so."""
        messages, finishes = self.session.transcript
        try:
            anew = ConversationFile.create(gone.parent, model=self.file_model)
            anew.append_all(messages, finishes)
        except ConversationFileError as e:
            self.conversation = None
            self.screen.error(f"{one_line(e)} This conversation is not saved from here on.")
            return
        self.conversation = anew
        self._saved_anew = (copy.deepcopy(messages), list(finishes))
        self.screen.notice(
            f"{gone} was removed while this chat ran; the conversation so far is saved anew "
            f"as {anew.id} ({anew.path})."
        )

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
        meta = {**reply_meta(reply), "sample": f"{choice}/{n}"}
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
            if is_exit(answer):
                return None
            self.screen.error(f"Type a number from 0 to {n}, or /exit to leave; got {answer!r}.")

    def _drop_question(self, text: str) -> None:
        messages = self.session.messages
        if messages and messages[-1] == {"role": "user", "content": text}:
            self.session.undo()
