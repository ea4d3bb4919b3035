"""An arena's lines: messages as duels (arena_turns.py) and the arena's slash commands.

Owns `ArenaCommands`, which runs one line (a slash command the arena takes: the sampling
settings for both sides at once, /system, /retry, /undo, /edit, /save, /clear, /stats,
/help, /exit; or a message, one turn), and `run_arena`, the loop that reads lines. Does not
know tokens, Rich or prompt-toolkit, nor where settings come from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
from chatcli.errors import ChatcliError
from chatcli.terminal.arena_turns import ArenaTurns
from chatcli.terminal.turn_runner import one_line

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


class ArenaCommands(ArenaTurns):
    """Runs an arena's lines: messages as duels and votes, and the arena's slash commands."""

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

    # ---- commands -------------------------------------------------------------------------------

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
