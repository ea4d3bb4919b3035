"""What each slash command does to the session, the saved conversation and the screen.

Owns: ChatCommands, which runs one line (a slash command, or a message to the model: a turn,
turn_runner.py's), the `cmd_*` handler of every command in command_parsing.COMMANDS, /retry's
seed and /samples' request.

Does not know: tokens or torch (the session does), the prompt, key bindings or history
(repl.py; a question for /samples comes through `Screen.ask`), Rich or how anything is drawn
(the `Screen` it is given, session_protocols.py), how a command line is parsed
(command_parsing.py), or where settings come from (cli/). Nothing here exits the process: a
bad turn or command prints one red line and the caller goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from chatcli.chat.command_parsing import (
    COMMANDS,
    EXPORT_FORCE,
    SHOW_SETTING,
    SYSTEM_CLEAR,
    CommandError,
    find_command,
    help_text,
    is_command,
    parse_command,
    unescape_message,
)
from chatcli.chat.conversation_export import export_json, export_markdown, write_export
from chatcli.chat.conversation_index import (
    check_name_free,
    list_conversations,
    resolve_conversation,
)
from chatcli.chat.conversation_reader import read_conversation
from chatcli.chat.conversation_store import (
    ConversationFile,
    ConversationSink,
    NewConversation,
    clean_name,
)
from chatcli.chat.settings import Settings, format_setting
from chatcli.chat.turns import SEED_RANGE, random_seed
from chatcli.errors import ChatcliError
from chatcli.terminal.session_protocols import Screen, Session
from chatcli.terminal.turn_runner import TurnRunner, one_line

# ---- running a line -----------------------------------------------------------------------------


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def _quote(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return f'"{text[: limit - 1]}…"' if len(text) > limit else f'"{text}"'


def _json_value(value: object) -> object:
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


class ChatCommands(TurnRunner):
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
        super().__init__(session, screen, conversation, settings.raw)
        self.settings = settings
        self.conversations_dir = conversations_dir
        self.model_info = dict(model_info or {})
        self.file_model = _json_value(self.model_info.get("path"))
        self._set_session_raw(self.raw)
        self.samples_next: int | None = None  # /samples N: the next message gets N replies
        self.reply_format = "text"  # /format: text, json or a schema file's path
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
            self.screen.error(one_line(e))
        return True

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

    def cmd_format(self, value: str | None) -> bool:
        from chatcli.engine.grammar import ANY_OBJECT, read_schema  # torch-free

        if value is None:
            self.screen.notice(f"format = {self.reply_format} (/format text|json|FILE changes it)")
            return True
        if value == "text":
            schema = None
        elif value == "json":
            schema = dict(ANY_OBJECT)
        else:
            schema = read_schema(Path(value).expanduser())
        self.session.options.json_schema = schema
        self.reply_format = value
        self.screen.notice(f"format = {value}")
        return True

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

    def cmd_set(self, _: None) -> bool:
        # parse_command turns every /set into the command it stands for; alone, /help set.
        return self.cmd_help("set")

    def cmd_show(self, _: None) -> bool:
        """ollama's /show: the settings, then the model."""
        self.cmd_settings(None)
        return self.cmd_model(None)

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

    def cmd_probs(self, position: int | None) -> bool:
        if not self.session.can_show_probs:
            raise ChatcliError("/probs is not supported against a server; it needs a local model.")
        probs = self.session.reply_probs()
        if position is not None and position > len(probs):
            raise CommandError(
                f"/probs {position} is past the last reply's {len(probs)} tokens: "
                f"give 1 to {len(probs)}."
            )
        self.screen.probs(probs, position)
        return True

    # ---- files ----------------------------------------------------------------------------------

    def cmd_save(self, name: str | None) -> bool:
        """/save NAME names the conversation being saved (its id and file stay); /save alone
        says where it is saved. Only where saving had stopped (a write failed) does /save
        write the conversation anew, to a new file."""
        current = self.conversation
        if name is None and current is not None:
            if current.path is None:
                self.screen.notice(
                    "This conversation is saved from its first message; /save NAME names it."
                )
            else:
                self.screen.notice(
                    f"This conversation is saved already, as {current.id} ({current.path}); "
                    "every turn is. /save NAME names it."
                )
            return True
        clean = None if name is None else clean_name(name)
        if clean is not None:  # --resume NAME must find this one alone
            check_name_free(self.conversations_dir, clean, current.path if current else None)
        if current is not None and clean is not None:
            current.append_name(clean)
            resume = f'chatcli chat --resume "{clean}"'
            if current.path is None:
                self.screen.notice(f'Named "{clean}": saved from its first message; {resume}.')
            else:
                self.screen.notice(f'Named this conversation "{clean}" ({current.id}); {resume}.')
            return True
        model = self.model_info.get("path")
        saved = ConversationFile.create(self.conversations_dir, model=_json_value(model))
        messages, finishes = self.session.transcript
        saved.append_all(messages, finishes)
        if clean is not None:
            saved.append_name(clean)
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
        self.show_notices()  # the oldest exchanges out of the model's view, as they were
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
                s.name or "-",
                f"{s.modified:%Y-%m-%d %H:%M}",
                str(s.messages) if s.problem is None else "-",
                s.preview if s.problem is None else f"(unreadable: {s.problem})",
            )
            for s in summaries
        ]
        self.screen.table(("id", "name", "modified", "messages", "preview"), rows)
        return True

    def cmd_export(self, arg: tuple[str, str, bool]) -> bool:
        fmt, where, force = arg
        path = Path(where).expanduser()
        messages, _ = self.session.transcript
        count = sum(m["role"] != "system" for m in messages)  # as /save and /load count
        if not count:
            raise ChatcliError("Nothing to export yet: the conversation has no messages.")
        text = export_markdown(messages) if fmt == "md" else export_json(messages)
        write_export(text, path, force, f"end the command with {EXPORT_FORCE}")
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
            # A file outside the conversations folder (/load PATH) is found by its path; a
            # named one by its name.
            where = cid if path is None or path.parent == self.conversations_dir else str(path)
            name = read_conversation(path).name if path is not None else None
            if name is not None and path is not None and path.parent == self.conversations_dir:
                cid, where = f'{cid} ("{name}")', f'"{name}"'
            self.screen.notice(f"Saved as {cid}; chatcli chat --resume {where} picks it up.")
