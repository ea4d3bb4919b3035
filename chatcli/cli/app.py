"""The `chatcli` command: chat, once, models, serve, bench, config path; -h and --version.

Owns: the commands and their flags, settings precedence (flag > CHATCLI_* env > config file >
default), turning project errors into one red line and an exit code (the shared options and
click's own errors: chatcli.cli.options). Typer lives only in these two. torch is imported
only by the commands that load a model, so `chatcli --help` stays fast.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from chatcli.chat.settings import (
    SETTING_NAMES,
    Settings,
    config_path,
    conversations_dir,
    load_settings,
)
from chatcli.cli.openmp_wait import choose_openmp_wait
from chatcli.cli.options import (
    HELP_OPTIONS,
    ApiKeyOpt,
    Command,
    CompileOpt,
    DeviceOpt,
    DtypeOpt,
    MarkdownOpt,
    MaxTokOpt,
    ModelOpt,
    OneLineErrors,
    QuantizeOpt,
    SeedOpt,
    SoftcapOpt,
    SourceOpt,
    StepOpt,
    SystemOpt,
    TempOpt,
    ToolsOpt,
    TopKOpt,
    TopPOpt,
    UrlOpt,
    fail,
    local_model_flags,
    print_version,
    server_url,
)
from chatcli.errors import ChatcliError, ConversationFileError

if TYPE_CHECKING:
    from rich.console import Console


app = typer.Typer(
    name="chatcli",
    cls=OneLineErrors,
    help="Chat with nanochat-family GPT models in the terminal. "
    "Runs an embedded demo model when no --model is given.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings=HELP_OPTIONS,
)
config_app = typer.Typer(cls=OneLineErrors, help="Inspect the configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    pass


def _settings(**flags: Any) -> Settings:
    # config_file follows CHATCLI_CONFIG, which must then name a file that exists.
    return load_settings(flags=flags, env=os.environ)


def _setting_flags(params: dict[str, Any]) -> dict[str, Any]:
    """A command's parameters that are settings (the rest, like --json, are not)."""
    return {name: value for name, value in params.items() if name in SETTING_NAMES}


def _sampling(settings: Settings):
    from chatcli.chat.turns import SamplingOptions

    return SamplingOptions(
        temperature=settings.temperature,
        top_k=settings.top_k or None,
        top_p=settings.top_p if settings.top_p < 1.0 else None,
        max_tokens=settings.max_tokens,
        seed=settings.seed,
        tools=settings.tools,
    )


def _load_session(
    settings: Settings,
    softcap: float | None,
    url: str | None = None,
    api_key: str | None = None,
    model_flag: str | None = None,
    compile_model: bool = False,
    local_flags: list[str] | None = None,
) -> tuple[Any, dict]:
    """A session and its banner info: a local model, or a client of a server at `url`.
    `local_flags` are the local-model flags given, refused with a server rather than ignored."""
    if url is not None:
        if local_flags:
            named = ", ".join(local_flags)
            raise ChatcliError(
                f"{named} is a local model's: it picks or shapes the model chatcli loads, "
                f"and a server at --url chooses its own. Drop {named} or --url."
                if len(local_flags) == 1
                else f"{named} are a local model's: they pick or shape the model chatcli "
                "loads, and a server at --url chooses its own. Drop them or --url."
            )
        try:
            from chatcli.serve.client import RemoteSession
        except ImportError as e:
            if (e.name or "").startswith("chatcli"):
                raise  # a bug of ours, not a missing extra
            raise ChatcliError("--url needs the serve extra: pip install -e '.[serve]'") from None
        # Only an explicit --model names the server's model: a checkpoint path from the
        # config file means nothing to a server.
        remote = RemoteSession(
            url,
            api_key=api_key,
            model=model_flag,
            options=_sampling(settings),
            system=settings.system,
        )
        return remote, remote.describe()

    from chatcli.chat.session import ChatSession
    from chatcli.engine.cpu_plan import apply_cpu_plan
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(
        settings.model,
        source=settings.source,
        step=settings.step,
        device=settings.device,
        dtype=settings.dtype,
        softcap=softcap,
        quantize=settings.quantize,
    )
    apply_cpu_plan(model)
    session = ChatSession(
        model, tokenizer, _sampling(settings), system=settings.system, compile=compile_model
    )
    return session, banner_info(asdict(model.info))


def banner_info(info: dict) -> dict:
    return {
        "path": "embedded default model" if info["embedded"] else info["path"],
        "tag": info["tag"],
        "source": info["source"],
        "step": info["step"],
        "era": info["era"],
        "params": info["num_params"],
        "device": info["device"],
        "dtype": info["dtype"],
        "context_len": info["sequence_len"],
        "load_s": info["load_s"],
    }


# ---- chat ---------------------------------------------------------------------------------------


@app.command(cls=Command)
def chat(
    model: ModelOpt = None,
    source: SourceOpt = None,
    step: StepOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = None,
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
    from chatcli.chat.conversation_store import (
        ConversationFile,
        ConversationSink,
        NewConversation,
        latest_conversation,
        read_conversation,
        resolve_conversation,
    )
    from chatcli.terminal.render import make_console, render_banner, render_notice, render_recap
    from chatcli.terminal.repl import run_repl

    # Piped stdin (`echo hi | chatcli chat`): messages line by line, no prompt. Piped either
    # way (`chatcli chat | tee log` too), stdout holds the replies only: the banner, notices,
    # status lines and errors go to stderr.
    piped = sys.stdin is not None and not sys.stdin.isatty()
    stdout_piped = sys.stdout is not None and not sys.stdout.isatty()
    try:
        settings = _settings(**_setting_flags(locals()))
        console = make_console()
        notes = make_console(file=sys.stderr) if piped or stdout_piped else console
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
            session, info = _load_session(
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
            render_recap(notes, loaded.messages)
            conversation = _system_on_resume(notes, session, settings.system, system, conversation)
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
        raise fail(str(e)) from None
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


@app.command(cls=Command)
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
) -> None:
    """Answer one message and exit."""
    from chatcli.terminal.render import make_console

    url = server_url(url)
    local_flags = local_model_flags(locals())
    try:
        settings = _settings(**_setting_flags(locals()))
        text = _read_prompt(prompt)
        session, info = _load_session(
            settings, softcap, url, api_key, model, compile_model, local_flags
        )
        console = make_console()
        if as_json:
            _once_json(session, info, text)
        else:
            _once_stream(session, console, settings, text)
    except ChatcliError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _read_prompt(words: list[str] | None) -> str:
    """The prompt from its words (`chatcli once What is 2+2`, as ollama takes them), or from
    stdin for none or `-`."""
    if not words or words == ["-"]:
        if sys.stdin is None or sys.stdin.isatty():
            raise ChatcliError(
                'No prompt given. Usage: chatcli once "What is 12*7?" (or pipe it in).'
            )
        prompt = sys.stdin.read()
    else:
        prompt = " ".join(words)
    prompt = prompt.strip()
    if not prompt:
        raise ChatcliError("The prompt is empty.")
    return prompt


def _once_stream(session: Any, console: Console, settings: Settings, text: str) -> None:
    from chatcli.terminal.keyboard import interrupts_held, quiet_keyboard
    from chatcli.terminal.render import ReplyRenderer, render_notice, render_status, use_markdown

    # The raw setting (config or CHATCLI_RAW) shows the special tokens, as in a chat: exact
    # token text, never read as Markdown. A server's session has no tokens to show.
    raw = settings.raw and hasattr(session, "raw")
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
        "seed": s.seed,
        "model": info["path"],
    }
    sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")


# ---- models and config --------------------------------------------------------------------------


@app.command(cls=Command)
def models(
    base_dir: Annotated[
        Path | None,
        typer.Option(
            help="A folder to list: a nanochat base dir (default: $NANOCHAT_BASE_DIR or "
            "~/.cache/nanochat), one source's folder, or a download's folder."
        ),
    ] = None,
) -> None:
    """List the checkpoints chatcli can find."""
    from chatcli.model.checkpoint import default_base_dir, list_checkpoints
    from chatcli.terminal.render import make_console, render_notice, render_table

    if base_dir is not None and not base_dir.is_dir():
        raise fail(
            f"No folder at {base_dir}. Pass --base-dir a folder: a nanochat base dir (the "
            "one that holds chatsft_checkpoints, base_checkpoints, ...), one of those, or a "
            "download's folder of model_*.pt files."
        )
    try:
        found = list_checkpoints(base_dir)
    except ChatcliError as e:
        raise fail(str(e)) from None
    console = make_console()
    rows = [
        (
            c.name,
            c.source or "-",
            c.tag or "-",
            str(c.step),
            c.era,
            f"{c.num_params / 1e6:.1f}M" if c.problem is None else "-",
            f"{c.size_bytes / 1e6:.1f} MB",
            str(c.path) if c.problem is None else f"{c.path} (unreadable)",
        )
        for c in found
    ]
    render_table(console, ("model", "source", "tag", "step", "era", "params", "size", "path"), rows)
    errors = make_console(file=sys.stderr)
    for c in found:
        if c.problem is not None:
            render_notice(errors, f"{c.path}: {c.problem}")
    if all(c.name == "embedded" for c in found):
        # Said for the default base dir too: NANOCHAT_BASE_DIR pointing at the wrong place
        # looked like a listing with nothing more to find.
        looked = base_dir or default_base_dir()
        render_notice(
            errors,
            f"No checkpoints in {looked}: no model_*.pt there, nor in its chatsft_checkpoints, "
            "base_checkpoints, ... folders." + ("" if base_dir else " --base-dir looks elsewhere."),
        )


@app.command(cls=Command)
def serve(
    model: ModelOpt = None,
    source: SourceOpt = None,
    step: StepOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: a free one, said on start).")] = 8000,
    workers: Annotated[
        int | None, typer.Option(help="Model replicas (default: one per GPU, else 1).")
    ] = None,
    cache_slots: Annotated[
        int,
        typer.Option(
            min=1,
            max=64,
            help="Conversations each worker keeps warm (each a whole context's K/V memory).",
        ),
    ] = 1,
    max_queue: Annotated[
        int,
        typer.Option(
            min=0,
            help="Requests that may wait for a busy worker; one more gets a 429 (default 64).",
        ),
    ] = 64,
    softcap: SoftcapOpt = None,
) -> None:
    """Serve an OpenAI-compatible API (/v1/chat/completions) and a chat page (/)."""
    try:
        from chatcli.serve.app import Limits
        from chatcli.serve.app import serve as run_server
    except ImportError:
        raise fail("chatcli serve needs the serve extra: pip install -e '.[serve]'") from None
    try:
        s = _settings(
            model=model, source=source, step=step, device=device, dtype=dtype, quantize=quantize
        )
        run_server(
            s.model,
            host=host,
            port=port,
            workers=workers,
            cache_slots=cache_slots,
            device=s.device,
            limits=Limits(max_queue=max_queue),
            source=s.source,
            step=s.step,
            dtype=s.dtype,
            quantize=s.quantize,
            softcap=softcap,
            on_ready=lambda i: typer.echo(
                f"Serving {i['model']} on {', '.join(i['devices'])} at {i['url']} "
                "(chat page at /, API at /v1)"
            ),
        )
    except ChatcliError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


BENCH_HELP = (
    "Measure our engine against the plain baseline, side by side, in one run.\n\n"
    "The baseline runs the model the plain way (eager fp32, the whole conversation prefilled "
    "again every turn, the prompt's cache copied into every sample row, torch.multinomial, "
    "a host read per row per step); ours as chatcli runs it. On a GPU (--device auto picks "
    "one) both run there, ours in bf16 with its decode step as a CUDA graph. Measured for both: prefill tok/s, decode tok/s at batch 1 and "
    "with 8 samples, time to first token at turns 1, 5 and 10 of a scripted chat, peak memory, "
    "and the memory's bandwidth with the roofline it sets for the weights; each the best of "
    "three alternating rounds.\n\n"
    "On a 2-core CPU the embedded model takes ~25 s, --synthetic d20 ~7 minutes and ~10 GB "
    "of memory; on an H200 ~25 s and ~45 s."
)


@app.command(cls=Command, help=BENCH_HELP)
def bench(
    model: ModelOpt = None,
    synthetic: Annotated[
        str | None, typer.Option(help="A random-weight nanochat of depth d4, d12 or d20.")
    ] = None,
    quantize: Annotated[
        str,
        typer.Option(
            help="Weights for ours. On a CPU its decode copies: auto (16-bit copies for a big "
            "model, else the fp32 weights), float32 (or none), float16, bfloat16, int8 or "
            "int4. On a GPU: auto (bf16 where the card computes in it), float32 or bfloat16."
        ),
    ] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON only.")] = False,
    softcap: SoftcapOpt = None,
    device: Annotated[
        str, typer.Option(help="auto (a CUDA device where there is one), cpu, cuda or cuda:N.")
    ] = "auto",
    compile_model: CompileOpt = False,
) -> None:
    """Measure our engine against the plain baseline, side by side, in one run."""
    from chatcli.bench.bench import (
        SYNTHETIC_DEPTHS,
        bench_device,
        gpu_weights,
        run_bench,
        synthetic_model,
    )
    from chatcli.bench.report import render_bench
    from chatcli.model.checkpoint import load_model
    from chatcli.model.quantize import QUANTIZE_KINDS
    from chatcli.terminal.render import make_console

    try:
        # The options first: a mistake should not wait for a model to load.
        quantize = "float32" if quantize == "none" else quantize  # as chat and once say it
        if quantize not in ("auto", "float32", *QUANTIZE_KINDS):
            raise ChatcliError(
                f"--quantize takes auto, float32 (or none), {', '.join(QUANTIZE_KINDS)}; "
                f"not {quantize!r}."
            )
        try:
            where = bench_device(device)
            if where.type == "cuda":
                gpu_weights(quantize, where)
        except ValueError as e:
            raise ChatcliError(str(e)) from None
        if synthetic is not None and model is not None:
            raise ChatcliError("Pass --model or --synthetic, not both.")
        if synthetic is not None and softcap is not None:
            raise ChatcliError("--softcap is a checkpoint's: a --synthetic model caps at 15.")
        if synthetic is not None:
            if synthetic not in SYNTHETIC_DEPTHS:
                raise ChatcliError(f"--synthetic takes one of {', '.join(SYNTHETIC_DEPTHS)}.")
            net, tokenizer = synthetic_model(synthetic, where)
            label = f"synthetic {synthetic}"
        else:
            # fp32 on a GPU: the baseline's weights (the bench makes ours' bf16 copy itself).
            dtype = "float32" if where.type == "cuda" else "auto"
            net, tokenizer, _ = load_model(model, device=str(where), dtype=dtype, softcap=softcap)
            label = "embedded default model" if model is None else str(model)
        # A run takes from ~25 s to minutes, with nothing to show until it ends.
        typer.echo(f"Measuring {label} on {where}, baseline and ours in turn…", err=True)
        result = run_bench(net, tokenizer, label, precision=quantize, compile=compile_model)
    except ChatcliError as e:
        raise fail(str(e)) from None
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    render_bench(make_console(), result)


@config_app.command("path", cls=Command)
def config_path_command() -> None:
    """Print the config file's path (it may not exist yet)."""
    typer.echo(str(config_path()))


def _system_on_resume(
    console: Any, session: Any, wanted: str | None, flag: str | None, conversation: Any
) -> Any:
    """A --system given with --resume replaces the resumed conversation's system prompt, in
    its file too; returns the file (None once it cannot be written)."""
    from chatcli.terminal.render import render_notice

    if flag is None or wanted == session.system:
        return conversation
    session.set_system(wanted)
    render_notice(console, "The system prompt is --system's from here on.")
    if conversation is not None:
        try:
            conversation.append_system(session.system)
        except ConversationFileError as e:
            render_notice(console, f"{e} This conversation is not saved from here on.")
            return None
    return conversation


def bare_resume_means_last(argv: list[str]) -> list[str]:
    """`--resume` with no id resumes the last conversation (click has no optional values)."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg in ("--resume", "-r") and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("last")
    return out


def main() -> None:
    # Before torch loads: OpenMP threads spin a bounded while between parallel regions,
    # rather than sleeping (a wake per product) or spinning ~3 ms (openmp_wait.py).
    choose_openmp_wait()
    app(args=bare_resume_means_last(sys.argv[1:]), prog_name="chatcli")
