"""An arena's turn: two models answer the same message side by side, blind, then a vote.

Owns `ArenaTurns`: a turn (both sessions answer the same conversation with the same
settings and seed, their order as A and B drawn anew each turn, streamed side by side), the
vote (a, b, tie or both bad; `/retry` draws both again first, `/undo` drops the question),
and what a vote does (the kept reply, the winner's or on a tie A's, goes on in both
sessions; the question, that reply and the vote are saved to the conversation's file); and
the Protocols of what it drives. arena_commands.ArenaCommands is an ArenaTurns that also runs
the arena's slash commands, as slash_commands.ChatCommands is a TurnRunner.

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
from chatcli.chat.command_parsing import (
    is_command,
)
from chatcli.chat.conversation_store import NewConversation
from chatcli.chat.stream import StreamEvent
from chatcli.chat.turns import SEED_RANGE, SamplingOptions, random_seed
from chatcli.errors import ChatcliError, ConversationFileError
from chatcli.terminal.keyboard import interrupts_held, quiet_keyboard
from chatcli.terminal.session_protocols import Screen, Session
from chatcli.terminal.turn_runner import one_line

VOTE_QUESTION = "Vote: a = A better, b = B better, t = tie, x = both bad › "


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


class ArenaTurns:
    """Runs an arena's turns: each message as a duel of two sessions, then its vote."""

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
