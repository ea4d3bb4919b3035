"""The chat and once commands: a conversation in the terminal, or one answer."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from chatcli.chat.settings import (
    Settings,
    conversations_dir,
)
from chatcli.cli.options import (
    ApiKeyOpt,
    CompileOpt,
    DeviceOpt,
    DtypeOpt,
    MarkdownOpt,
    MaxTokOpt,
    ModelOpt,
    QuantizeOpt,
    SeedOpt,
    SoftcapOpt,
    SourceOpt,
    SpeculateOpt,
    StepOpt,
    SystemOpt,
    TempOpt,
    ToolsOpt,
    TopKOpt,
    TopPOpt,
    UrlOpt,
    fail_with,
    local_model_flags,
    server_url,
)
from chatcli.cli.structured_output import FormatOpt, JsonSchemaOpt, reply_schema
from chatcli.errors import ChatcliError, ConversationFileError, UsageError

if TYPE_CHECKING:
    from chatcli.terminal.render import Console
from chatcli.cli.session_setup import (
    load_session,
    move_old_files_saying,
    setting_flags,
    settings_from,
    system_on_resume,
)

# ---- chat ---------------------------------------------------------------------------------------


def chat(
    model: ModelOpt = None,
    source: SourceOpt = None,
    step: StepOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = None,
    speculate: SpeculateOpt = None,
    temperature: TempOpt = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    max_tokens: MaxTokOpt = None,
    seed: SeedOpt = None,
    system: SystemOpt = None,
    markdown: MarkdownOpt = None,
    tools: ToolsOpt = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            "-r",
            help="Resume a saved conversation: its id; alone, the last one.",
        ),
    ] = None,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    compile_model: CompileOpt = False,
    softcap: SoftcapOpt = None,
) -> None:
    """Start an interactive chat session."""
    url = server_url(url)
    local_flags = local_model_flags(locals())
    from chatcli.chat.conversation_index import latest_conversation, resolve_conversation
    from chatcli.chat.conversation_reader import read_conversation
    from chatcli.chat.conversation_store import ConversationFile, ConversationSink, NewConversation
    from chatcli.terminal.render import make_console, render_notice
    from chatcli.terminal.render_panels import render_banner, render_recap
    from chatcli.terminal.repl import run_repl

    # Piped stdin (`echo hi | chatcli chat`): messages line by line, no prompt. Piped either
    # way (`chatcli chat | tee log` too), stdout holds the replies only: the banner, notices,
    # status lines and errors go to stderr.
    piped = sys.stdin is not None and not sys.stdin.isatty()
    stdout_piped = sys.stdout is not None and not sys.stdout.isatty()
    try:
        settings = settings_from(**setting_flags(locals()))
        console = make_console()
        notes = make_console(file=sys.stderr) if piped or stdout_piped else console
        move_old_files_saying()
        folder = conversations_dir()
        loaded = path = None
        if resume is not None:  # a name that finds nothing should not wait for the model
            path = latest_conversation(folder) if resume == "last" else None
            if resume != "last":
                path = resolve_conversation(folder, resume)
            if path is None:
                raise ChatcliError(f"No saved conversation to resume in {folder}.")
            loaded = read_conversation(path)
        waiting = f"Connecting to {url}…" if url else "Loading model…"
        with notes.status(waiting, spinner="dots"):
            session, info = load_session(
                settings, softcap, url, api_key, model, compile_model, local_flags
            )
        render_banner(notes, info)
        if loaded is not None and path is not None:
            for warning in loaded.warnings:
                render_notice(notes, warning)
            session.load_messages(loaded.messages, loaded.finishes)
            # Read just above: its name, not the header's id, is what --resume takes again.
            conversation: ConversationSink | None = ConversationFile(path, path.stem)
            if loaded.repaired:  # what comes next must replay onto what was loaded
                try:
                    conversation.append_snapshot(loaded.messages, loaded.finishes)
                except ConversationFileError as e:
                    render_notice(notes, f"{e} This conversation is not saved from here on.")
                    conversation = None
            count = sum(1 for m in loaded.messages if m["role"] != "system")
            render_notice(notes, f"Resumed {path.name}: {count} messages.")
            for notice in session.take_notices():  # exchanges out of the model's view
                render_notice(notes, notice.text)
            render_recap(notes, loaded.messages)
            conversation = system_on_resume(notes, session, settings.system, system, conversation)
            if system is None and settings.system and settings.system != session.system:
                render_notice(
                    notes,
                    "This conversation keeps its own system prompt, not the configured one "
                    "(/system shows it; --system with --resume replaces it).",
                )
        else:
            # Its file is made at the first message: a session that says nothing leaves none.
            conversation = NewConversation(folder, model=info["path"], system=session.system)
    except ChatcliError as e:
        raise fail_with(e) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    code = run_repl(
        session,
        settings=settings,
        console=console,
        conversation=conversation,
        conversations_dir=folder,
        model_info=info,
        lines=sys.stdin if piped else None,
        notes=notes,
    )
    raise typer.Exit(code)


# ---- once ---------------------------------------------------------------------------------------


def once(
    prompt: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="PROMPT",
            help="The message, quoted or not (its words are joined); '-' or none reads stdin.",
        ),
    ] = None,
    model: ModelOpt = None,
    source: SourceOpt = None,
    step: StepOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = None,
    speculate: SpeculateOpt = None,
    temperature: TempOpt = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    max_tokens: MaxTokOpt = None,
    seed: SeedOpt = None,
    system: SystemOpt = None,
    markdown: MarkdownOpt = None,
    tools: ToolsOpt = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print {text, parts, tools, finish_reason, usage, timings, seed, model}.",
        ),
    ] = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    compile_model: CompileOpt = False,
    softcap: SoftcapOpt = None,
    raw_text: Annotated[
        bool,
        typer.Option(
            "--raw",
            help="Continue the text as it is, no chat template: how a base checkpoint runs.",
        ),
    ] = False,
    logprobs: Annotated[
        int | None,
        typer.Option(
            "--logprobs",
            help="With --json: each token's logprob and its K likeliest alternatives (0-20).",
            metavar="K",
        ),
    ] = None,
    json_schema: JsonSchemaOpt = None,
    reply_format: FormatOpt = None,
) -> None:
    """Answer one message and exit."""
    from chatcli.terminal.render import make_console

    url = server_url(url)
    local_flags = local_model_flags(locals())
    try:
        _check_once_flags(raw_text, logprobs, as_json, url, system)
        settings = settings_from(**setting_flags(locals()))
        text = _read_prompt(prompt, raw_text)
        schema = reply_schema(json_schema, reply_format, local=url is None)
        if schema is not None and raw_text:
            raise UsageError(
                "--raw continues the text freely; --json-schema and --format json shape a "
                "chat reply: drop one or the other."
            )
        if schema is not None:  # JSON as it is written, never read as Markdown
            settings = dataclasses.replace(settings, markdown="never")
        session, info = load_session(
            settings, softcap, url, api_key, model, compile_model, local_flags
        )
        session.options.json_schema = schema
        if url is None:
            session = _local_once(session, raw_text, logprobs)
        else:
            session.logprobs = logprobs  # the server is asked for them
        console = make_console()
        if as_json:
            _once_json(session, info, text)
        else:
            _once_stream(session, console, settings, text)
    except ChatcliError as e:
        raise fail_with(e) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _check_once_flags(
    raw_text: bool, logprobs: int | None, as_json: bool, url: str | None, system: str | None
) -> None:
    """What once's --raw and --logprobs go with, refused before the model loads."""
    from chatcli.engine.logprobs import MAX_TOP_LOGPROBS

    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise UsageError(f"--logprobs {logprobs} is out of range: give 0 to {MAX_TOP_LOGPROBS}.")
    if logprobs is not None and not as_json:
        raise UsageError("--logprobs is printed in the JSON: add --json.")
    if url is not None and raw_text:
        raise UsageError(
            "--raw runs on a local model; with a server, ask its /v1/completions directly, "
            "or drop --url."
        )
    if raw_text and system is not None:
        raise UsageError("--raw continues the text as it is, with no system prompt: drop --system.")


def _local_once(session: Any, raw_text: bool, logprobs: int | None) -> Any:
    """The local session once runs: the chat's (recording logprobs only when asked) or, with
    --raw, a raw completion over its model."""
    if raw_text:
        from chatcli.chat.raw_completion import RawCompletion

        return RawCompletion(session.engine, session.tokenizer, session.options, logprobs)
    session.logprobs = logprobs
    return session


def _read_prompt(words: list[str] | None, raw: bool = False) -> str:
    """The prompt from its words (`chatcli once What is 2+2`, as ollama takes them), or from
    stdin for none or `-`. A chat message is trimmed; a --raw text is kept as given (a
    trailing space changes what comes next, as in /v1/completions), less the line break
    that ends piped input, and may be empty (<|bos|> alone)."""
    if not words or words == ["-"]:
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError(
                'No prompt given. Usage: chatcli once "What is 12*7?" (or pipe it in).'
            )
        prompt = sys.stdin.read()
        if raw:
            prompt = prompt.removesuffix("\n").removesuffix("\r")
    else:
        prompt = " ".join(words)
    if raw:
        return prompt
    prompt = prompt.strip()
    if not prompt:
        raise UsageError(
            'The prompt is empty: write the message, e.g. chatcli once "What is 12*7?"'
        )
    return prompt


def _once_stream(session: Any, console: Console, settings: Settings, text: str) -> None:
    from chatcli.terminal.keyboard import interrupts_held, quiet_keyboard
    from chatcli.terminal.render import ReplyRenderer, render_notice, render_status, use_markdown

    # The raw setting (config or CHATCLI_RAW) shows the special tokens, as in a chat: exact
    # token text, never read as Markdown. A server's session has no tokens to show.
    raw = settings.raw and session.can_show_raw
    if raw:
        session.raw = True
    markdown = not raw and use_markdown(console, settings.markdown)
    renderer = ReplyRenderer(console, markdown=markdown)
    events = session.send(text)
    for notice in session.take_notices():
        render_notice(console, notice.text)
    # What ends the reply's line: a failure (the server refused, the connection dropped) is
    # not an interruption, and its one-line error goes to stderr, not after the text.
    finish = "error"
    try:
        with quiet_keyboard():  # keys typed meanwhile would be drawn into the reply
            for event in events:
                renderer.handle(event)
        finish = session.last_reply.stats.finish_reason
    except KeyboardInterrupt:
        finish = "interrupted"
        raise
    finally:
        events.close()
        with interrupts_held():  # a Ctrl-C now would leave the live view up, the cursor hidden
            renderer.finish(finish)
    if console.is_terminal:
        render_status(console, session.last_reply.stats.as_dict())


def _once_json(session: Any, info: dict, text: str) -> None:
    from chatcli.chat.stream import ToolResult

    # Each calculator call as the stream ended it: a call cut by --max-tokens is "cut".
    calls = [e for e in session.send(text) if isinstance(e, ToolResult)]
    reply = session.last_reply
    s = reply.stats
    out = {
        "text": reply.text,
        "parts": reply.parts,
        "tools": [
            {"expression": c.expression, "output": c.output, "status": c.status} for c in calls
        ],
        "finish_reason": s.finish_reason,
        "usage": {
            "prompt_tokens": s.tokens_in,
            "completion_tokens": s.tokens_out,
            "total_tokens": s.tokens_in + s.tokens_out,
        },
        "timings": {
            "ttft_s": round(s.ttft_s, 4),
            "prefill_tps": round(s.prefill_tps, 1),
            "decode_tps": round(s.decode_tps, 1),
        },
        # Drafts from the conversation (--speculate auto): zeros where none were made.
        "speculation": {
            "verifications": s.verifications,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "acceptance": round(s.accepted / s.drafted, 4) if s.drafted else 0.0,
        },
        "seed": s.seed,
        "model": info["path"],
    }
    remote = getattr(session, "last_logprobs", None)
    if getattr(session, "logprobs", None) is not None and remote is not None:
        out["logprobs"] = {"content": remote}  # the server's, as it sent them
    elif getattr(session, "logprobs", None) is not None and reply.logprobs is not None:
        from chatcli.chat.logprob_shapes import chat_logprobs

        # A reply's entries are all recorded (no /continue here): None never occurs.
        entries = [e for e in reply.logprobs if e is not None]
        out["logprobs"] = {"content": chat_logprobs(session.tokenizer, entries)}
    sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
