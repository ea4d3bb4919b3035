"""An arena's lines: each message answered by two models side by side, blind, then a vote.

Owns `ArenaCommands`: a turn (both sessions answer the same conversation with the same
settings and seed, their order as A and B drawn anew each turn, streamed side by side), the
vote (a, b, tie or both bad; `/retry` draws both again first, `/undo` drops the question),
what a vote does (the kept reply, the winner's or on a tie A's, goes on in both sessions;
the question, that reply and the vote are saved to the conversation's file), the slash
commands the arena takes, and `run_arena`, the loop that reads lines.

Does not know: tokens or torch (the sessions), Rich or prompt-toolkit (the ArenaScreen,
arena_view.py), the vote's record and exports (chat/arena.py) or where settings come from.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from chatcli.chat.arena import (
    LABELS,
    OUTCOME_WORDS,
    VOTE_HELP,
    Side,
    kept_label,
    parse_vote,
    session_tally,
    vote_record,
)
from chatcli.chat.calc_markers import parts_from_text, text_from_parts
from chatcli.chat.command_parsing import (
    SHOW_SETTING,
    SYSTEM_CLEAR,
    CommandError,
    is_command,
    parse_command,
    unescape_message,
)
from chatcli.chat.conversation_store import NewConversation, clean_name
from chatcli.chat.settings import format_setting
from chatcli.chat.stream import StreamEvent
from chatcli.chat.turns import SEED_RANGE, SamplingOptions, random_seed
from chatcli.errors import ChatcliError, ConversationFileError
from chatcli.terminal.keyboard import interrupts_held, quiet_keyboard
from chatcli.terminal.session_protocols import Screen, Session
from chatcli.terminal.turn_runner import one_line

VOTE_QUESTION = "Vote: a = A better, b = B better, t = tie, x = both bad › "
# The chat's commands the arena runs (the rest need one session: /samples, /continue...).
SETTINGS = ("temperature", "top_k", "top_p", "max_tokens", "seed", "tools")
ARENA_HELP = """Arena commands:
  a, b, t, x (or /vote a|b|tie|bad)   vote, once both replies are in
  /retry                draw both replies again (after a vote: ask the last question again)
  /undo                 drop the last question and its reply
  /edit [TEXT]          rewrite the reply that went on (alone: edit it at the prompt)
  /system [TEXT|clear]  show or set the system prompt of both models
  /temperature, /top_k, /top_p, /max_tokens, /seed, /tools   as in chatcli chat, both sides
  /stats                this session's votes per model
  /save [NAME]          where the conversation and its votes are saved; NAME names it
  /clear                start a new conversation
  /exit                 leave (Ctrl-D too)"""


class ArenaSession(Session, Protocol):
    def put_reply(self, message: dict[str, Any], finish: str | None = None) -> None: ...


class DuelShow(Protocol):
    def handle(self, side: int, event: StreamEvent) -> None: ...

    def finish(self, subtitles: Sequence[str]) -> None: ...


class ArenaScreen(Screen, Protocol):
    def duel(self, titles: Sequence[str], tools: bool = True) -> DuelShow: ...

    def ask_vote(self, question: str) -> str | None: ...

    def tally(self, rows: Sequence[Mapping[str, object]]) -> None: ...

    def edit(self, text: str) -> str | None:
        """`text` edited by the person; None when declined (or there is no terminal)."""
        ...


@dataclass
class Contender:
    name: str  # what the votes call it: a checkpoint's path, hf:ORG/NAME, a server's URL
    session: ArenaSession


def _close(events: Iterator[StreamEvent]) -> None:
    close = getattr(events, "close", None)
    if close is not None:
        close()


class ArenaCommands:
    """Runs an arena's lines: messages as duels and votes, and the arena's slash commands."""

    def __init__(
        self,
        contenders: Sequence[Contender],
        screen: ArenaScreen,
        options: SamplingOptions,
        conversation: NewConversation | None,
        conversations_dir: Path,
        show_names: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        assert len(contenders) == 2
        self.contenders = list(contenders)
        self.screen = screen
        self.options = options  # both sessions' own: a setting changes both sides at once
        self.conversation = conversation
        self.conversations_dir = conversations_dir
        self.show_names = show_names
        self.rng = rng or random.Random()
        self.outcomes: list[tuple[str, str, str]] = []  # (model A, model B, outcome) voted

    # ---- lines ----------------------------------------------------------------------------------

    def handle(self, line: str) -> bool:
        """Runs one line; False means leave. Errors are printed, never raised."""
        if not line.strip():
            return True
        try:
            if is_command(line):
                return self._command(line)
            if line.strip() == "/":
                raise CommandError("/ alone is not a command: /help lists the arena's.")
            return self.turn(unescape_message(line))
        except Exception as e:
            self.screen.error(one_line(e))
        return True

    def _command(self, line: str) -> bool:
        word = line.strip()[1:].split(maxsplit=1)[0].lower() if line.strip()[1:] else ""
        if word == "vote":
            raise ChatcliError("Nothing to vote on: a vote comes after a turn's two replies.")
        if word == "stats":
            return self.show_tally()
        if word in ("help", "?"):
            self.screen.text(ARENA_HELP)
            return True
        if word == "edit":
            rest = line.strip()[1:].partition(" ")[2].strip()
            return self.cmd_edit(rest or None)
        command = parse_command(line)
        name, arg = command.name, command.arg
        if name in SETTINGS:
            return self._setting(name, arg)
        handlers: dict[str, Callable[[Any], bool]] = {
            "system": self.cmd_system,
            "retry": self.cmd_retry,
            "undo": self.cmd_undo,
            "save": self.cmd_save,
            "clear": self.cmd_clear,
            "exit": lambda _: False,
        }
        if name not in handlers:
            raise ChatcliError(f"/{name} is chatcli chat's, not the arena's: /help lists these.")
        return handlers[name](arg)

    def _setting(self, name: str, value: object) -> bool:
        options = self.options
        if value is SHOW_SETTING:
            value = getattr(options, name)
        elif name == "top_k":
            options.top_k = value or None  # type: ignore[assignment]
        elif name == "top_p":
            options.top_p = value if value < 1.0 else None  # type: ignore[operator,assignment]
        else:
            setattr(options, name, value)
        shown = {"top_k": value or 0, "top_p": value or 1.0}.get(name, value)
        self.screen.notice(f"{name} = {format_setting(name, shown)} (both sides)")
        return True

    # ---- a turn and its vote --------------------------------------------------------------------

    def turn(self, text: str) -> bool:
        """Both models answer `text`, then the person votes. False: leave (/exit at the vote)."""
        messages = self.contenders[0].session.messages
        if messages and messages[-1]["role"] == "user":
            raise ChatcliError("The last question has no reply: /retry answers it, /undo drops it.")
        order = [0, 1]
        self.rng.shuffle(order)  # which model is A this turn
        if not self._duel(order, lambda s: s.send(text), self.options.seed, self._lengths()):
            return True
        return self._vote(order, text)

    def _duel(
        self,
        order: Sequence[int],
        start: Callable[[ArenaSession], Iterator[StreamEvent]],
        seed: int | None,
        bases: Sequence[int],
    ) -> bool:
        """Streams both replies side by side, A (contender order[0]) on the left; both with
        the turn's seed (None: a fresh one). False when the turn was dropped (a failure, or
        stopped early): each contender's session is back to its `bases` entry, the length
        of its transcript before the question (a server's session takes back a question it
        was refused by itself; the transcript, unlike the messages, keeps the exchanges a
        full context dropped from view)."""
        base = {id(self.contenders[i].session): bases[i] for i in order}

        def drop_turn(session: ArenaSession) -> None:
            if len(session.transcript[0]) > base[id(session)]:
                session.undo()

        fixed = self.options.seed
        self.options.seed = random_seed() if seed is None else seed
        sessions = [self.contenders[i].session for i in order]
        streams: list[Iterator[StreamEvent]] = []
        try:
            for session in sessions:
                streams.append(start(session))
        except BaseException:
            for events in streams:
                _close(events)
            for session in sessions:
                drop_turn(session)
            self.options.seed = fixed
            raise
        titles = [self._title(label, i) for label, i in zip(LABELS, order, strict=True)]
        before = [s.last_reply for s in sessions]
        view = self.screen.duel(titles, self.options.tools)
        failure: BaseException | None = None
        interrupted = False
        try:
            with quiet_keyboard():
                for session in sessions:
                    self._notices(session)
                live = [True, True]
                while any(live):  # one event of each in turn: both advance together
                    for side, events in enumerate(streams):
                        if not live[side]:
                            continue
                        event = next(events, None)
                        if event is None:
                            live[side] = False
                        else:
                            view.handle(side, event)
        except KeyboardInterrupt:
            interrupted = True
        except BaseException as e:
            failure = e
        with interrupts_held():
            for events in streams:
                _close(events)  # a stopped turn ends as "interrupted", its reply kept
            self.options.seed = fixed
            replies = [s.last_reply for s in sessions]
            answered = all(
                r is not None and r is not b and s.messages[-1]["role"] == "assistant"
                for r, b, s in zip(replies, before, sessions, strict=True)
            )
            # Tokens and finish only: a speed would tell the models apart before the vote.
            view.finish(
                [
                    f"{r.stats.tokens_out} tok · {r.stats.finish_reason}" if r is not None else ""
                    for r in replies
                ]
            )
            if failure is not None or not answered:
                for session in sessions:
                    drop_turn(session)
                if failure is not None:
                    raise failure
                self.screen.notice("Stopped before both replies began: the turn was dropped.")
                return False
            if interrupted:
                self.screen.interrupted()
        return True

    def _title(self, label: str, contender: int) -> str:
        return f"{label} · {self.contenders[contender].name}" if self.show_names else label

    def _notices(self, session: ArenaSession) -> None:
        for notice in session.take_notices():
            self.screen.notice(notice.text)

    def _vote(self, order: Sequence[int], question: str) -> bool:
        """Asks for the vote until one comes; /retry draws both again meanwhile."""
        retries = 0
        while True:
            answer = self.screen.ask_vote(VOTE_QUESTION)
            if answer is None:
                self._drop_turn()
                self.screen.notice("No vote: the question and both replies were dropped.")
                return True
            spoken = answer
            if is_command(answer):
                word, _, rest = answer.strip()[1:].partition(" ")
                if word.lower() == "vote":
                    spoken = rest
                elif word.lower() == "retry":
                    retries += 1
                    fixed = self.options.seed
                    seed = None if fixed is None else (fixed + retries) % SEED_RANGE
                    if not self._redraw(order, seed):
                        return True
                    continue
                elif word.lower() == "undo":
                    self._drop_turn()
                    self.screen.notice("Dropped the question and both replies.")
                    return True
                elif word.lower() in ("exit", "quit", "bye"):
                    self._drop_turn()
                    return False
                elif word.lower() == "stats":
                    self.show_tally()
                    continue
            outcome = parse_vote(spoken)
            if outcome is not None:
                self._record(order, outcome, question)
                return True
            self.screen.error(
                f"Vote with {VOTE_HELP} (or /vote a|b|tie|bad); /retry draws both again, "
                f"/undo drops the question. Got {answer!r}."
            )

    def _redraw(self, order: Sequence[int], seed: int | None) -> bool:
        def again(session: ArenaSession) -> Iterator[StreamEvent]:
            session.pop_last_reply()
            return session.regenerate()

        self.screen.notice("Drawing both replies again.")
        # Before the question: the transcripts end with it and the reply drawn for it.
        return self._duel(order, again, seed, [n - 2 for n in self._lengths()])

    def _lengths(self) -> list[int]:
        """Each contender's transcript length: where a dropped turn takes it back to."""
        return [len(c.session.transcript[0]) for c in self.contenders]

    def _drop_turn(self) -> None:
        for c in self.contenders:
            c.session.undo()

    def _record(self, order: Sequence[int], outcome: str, question: str) -> None:
        a, b = (self.contenders[i] for i in order)
        replies = [c.session.last_reply for c in (a, b)]
        assert replies[0] is not None and replies[1] is not None
        sides = [
            Side(label, c.name, r.message, r.stats.as_dict())
            for label, c, r in zip(LABELS, (a, b), replies, strict=True)
        ]
        kept = LABELS.index(kept_label(outcome))
        winner, loser = (a, b) if kept == 0 else (b, a)
        kept_reply = replies[kept]
        loser.session.put_reply(kept_reply.message, kept_reply.stats.finish_reason)
        prompt = winner.session.messages[:-1]  # the system prompt, the exchanges, the question
        record = vote_record(prompt, sides, outcome, self._settings(kept_reply.stats.seed))
        meta = {
            "finish_reason": kept_reply.stats.finish_reason,
            "seed": kept_reply.stats.seed,
            "stats": kept_reply.stats.as_dict(),
            "arena": {"label": LABELS[kept], "model": winner.name},
        }
        self._save(lambda c: c.append_message({"role": "user", "content": question}))
        self._save(lambda c: c.append_message(kept_reply.message, meta))
        self._save(lambda c: c.append_vote(record))
        self.outcomes.append((a.name, b.name, outcome))
        self.screen.notice(
            f"Voted {OUTCOME_WORDS[outcome]}. A was {a.name}; B was {b.name}. "
            f"{LABELS[kept]}'s reply goes on."
        )

    def _settings(self, seed: int) -> dict[str, object]:
        o = self.options
        return {
            "temperature": o.temperature,
            "top_k": o.top_k,
            "top_p": o.top_p,
            "max_tokens": o.max_tokens,
            "seed": seed,
            "tools": o.tools,
        }

    def _save(self, write: Callable[[NewConversation], None]) -> None:
        if self.conversation is None:
            return
        try:
            write(self.conversation)
        except ConversationFileError as e:
            self.conversation = None
            self.screen.error(f"{one_line(e)} This arena is not saved from here on.")

    # ---- commands -------------------------------------------------------------------------------

    def show_tally(self) -> bool:
        if not self.outcomes:
            self.screen.notice("No votes yet.")
            return True
        rows = [
            {"model": m, "wins": w, "losses": lo, "ties": t, "both bad": bad}
            for m, w, lo, t, bad in session_tally(self.outcomes)
        ]
        self.screen.tally(rows)
        return True

    def cmd_system(self, value: str | None) -> bool:
        if value is None:
            current = self.contenders[0].session.system
            self.screen.notice(f"System prompt: {current}" if current else "No system prompt.")
            return True
        text = None if value == SYSTEM_CLEAR else value
        for c in self.contenders:
            c.session.set_system(text)
        self._save(lambda c: c.append_system(text))
        self.screen.notice(f"System prompt set: {text}" if text else "System prompt removed.")
        return True

    def cmd_undo(self, _: None) -> bool:
        if not any(m["role"] == "user" for m in self.contenders[0].session.messages):
            self.screen.notice("Nothing to undo.")
            return True
        self._drop_turn()
        self._save(lambda c: c.append_undo())
        self.screen.notice("Undone: the last question and its reply (its vote stays counted).")
        return True

    def cmd_edit(self, text: str | None) -> bool:
        """The reply that went on after the last vote, rewritten: in both sessions and the
        file. The vote keeps both replies as they were drawn."""
        messages = self.contenders[0].session.messages
        if not self.outcomes or not messages or messages[-1]["role"] != "assistant":
            raise ChatcliError("Nothing to edit: /edit rewrites the reply a vote kept.")
        if text is None:
            text = self.screen.edit(text_from_parts(messages[-1]["content"]))
            if text is None:
                raise ChatcliError("No new reply given; it stays as it was. /edit TEXT gives one.")
        text = text.strip()
        if not text:
            raise ChatcliError("An empty reply cannot go on; /undo drops the exchange instead.")
        message = {"role": "assistant", "content": parts_from_text(text)}
        for c in self.contenders:
            c.session.put_reply(message, "stop")
        self._save(lambda c: c.replace_last(message, {"finish_reason": "stop", "edited": True}))
        self.screen.notice("The reply that goes on is yours now; the vote keeps both as drawn.")
        return True

    def cmd_retry(self, _: None) -> bool:
        """After a vote: the last question asked again, both drawn anew, another vote."""
        messages = self.contenders[0].session.messages
        users = [m for m in messages if m["role"] == "user"]
        if not users:
            self.screen.notice("Nothing to retry.")
            return True
        question = str(users[-1]["content"])
        self.cmd_undo(None)
        return self.turn(question)

    def cmd_save(self, name: str | None) -> bool:
        current = self.conversation
        if current is None:
            raise ChatcliError("This arena is not being saved (a write failed earlier).")
        if name is not None:
            current.append_name(clean_name(name))
            self.screen.notice(f'Named this arena "{clean_name(name)}".')
        elif current.path is None:
            self.screen.notice("This arena is saved from its first vote, with its votes.")
        else:
            self.screen.notice(f"Saved with its votes as {current.id} ({current.path}).")
        return True

    def cmd_clear(self, _: None) -> bool:
        for c in self.contenders:
            c.session.clear()
        if self.conversation is not None:
            self.conversation = NewConversation(
                self.conversations_dir,
                model=self.conversation.model,
                system=self.contenders[0].session.system,
            )
        self.screen.notice("New conversation.")
        return True

    def goodbye(self) -> None:
        if self.conversation is not None and self.conversation.id is not None:
            votes = len(self.outcomes)
            self.screen.notice(
                f"Saved as {self.conversation.id} with {votes} vote{'s' if votes != 1 else ''}; "
                "chatcli arena stats and chatcli arena export read every arena's votes."
            )


def run_arena(
    commands: ArenaCommands,
    read_message: Callable[[], str | None],
) -> None:
    """The arena's loop: read a line, hand it on, until /exit or the input ends."""
    while True:
        try:
            line = read_message()
        except EOFError:
            break
        if line is None:
            continue
        try:
            if not commands.handle(line):
                break
        except KeyboardInterrupt:
            commands.screen.notice("Interrupted.")
    commands.goodbye()
