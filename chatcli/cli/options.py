"""The parts of the `chatcli` command line its commands share: how it fails (one red line,
never click's usage box; exit code 2 for a usage error, 1 for a command that failed; an
unknown option names the nearest real one; a prompt that reads as an option gets the `--` it
needs), flags shown without a type, -h and --version, and the options several commands take,
with the same short flags on every command (-m model, -t temperature, -k top-k, -n max
tokens, -s system). Typer and click live in this package only.
"""

from __future__ import annotations

import difflib
import shlex
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from chatcli import __version__
from chatcli.errors import ChatcliError, UsageError
from chatcli.model.softcap import softcap_problem

try:  # typer 0.2x carries its own copy of click; its errors derive from TyperException
    from typer import TyperException as _ClickError
except ImportError:  # older typer runs on click itself
    from click import ClickException as _ClickError


class FlagsShowNoType:
    """typer 0.29's help writes a type after every flag (`--json <bool>`), as if it took a
    value; a flag takes none, so its type column stays empty."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]  # a click Command's
        for param in params:
            if getattr(param, "is_flag", False):
                param.metavar = ""
        return params


class Command(FlagsShowNoType, TyperCommand):
    pass


class OneLineErrors(FlagsShowNoType, TyperGroup):
    """Click's own errors (an unknown option, a value of the wrong type) end like every other
    error: one red line on stderr saying what to fix (click's would be a usage box), with
    click's exit code: 2 for a usage error. A bare `chatcli` (or `chatcli config`) prints the
    help and exits 0, as git does: nothing went wrong."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        argv = kwargs.get("args", args[0] if args else None)
        argv = sys.argv[1:] if argv is None else list(argv)
        try:
            # Not standalone: click raises its errors and returns typer.Exit's code.
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _ClickError as e:
            if type(e).__name__ == "NoArgsIsHelpError":
                sys.exit(0)  # the help was printed, on stdout, as the error was made
            # format_message names the parameter ("Invalid value for '--step': ...").
            message = e.format_message() if hasattr(e, "format_message") else str(e)
            if type(e).__name__ == "NoSuchOption":
                message = _no_such_option(e)
            message = " ".join(message.split())
            if not message.endswith((".", "?", "!")):
                message += "."
            ctx = getattr(e, "ctx", None)
            prompt = _prompt_taken_for_option(e, argv)
            if ctx is not None and prompt is not None:
                message += (
                    f" A prompt that starts with - goes after --: "
                    f"{ctx.command_path} -- {_shell_quote(prompt)}"
                )
            elif ctx is not None:
                message += f" See {ctx.command_path} --help."
            sys.exit(fail(message, getattr(e, "exit_code", 2)).exit_code)
        except typer.Abort:
            sys.exit(fail("Aborted.").exit_code)
        sys.exit(code if isinstance(code, int) else 0)


def nearest_options(name: str, options: Sequence[str]) -> list[str]:
    """The options an unknown `name` most likely meant: the same with dashes for underscores
    (--max_tokens), else those it begins, up to three (--max; --top: --top-k and --top-p),
    else the one closest spelling (--temprature, --top_k); none when none is close."""
    key = name.lower().replace("_", "-")
    if key in options:
        return [key]
    longs = [o for o in options if o.startswith("--")]
    if key.startswith("--") and len(key) > 3:
        starts = [o for o in longs if o.startswith(key)]
        if 1 <= len(starts) <= 3:
            return starts
    # Among the long options for anything longer than a short one: -x is not near --x.
    pool = longs if len(key) > 2 else options
    return difflib.get_close_matches(key, pool, n=1, cutoff=0.6)


def _no_such_option(error: Exception) -> str:
    """Click's "No such option" with the one nearest option of the command, not click's
    list of possibilities (for --temp it listed --help, --step, --system)."""
    name = str(getattr(error, "option_name", ""))
    ctx = getattr(error, "ctx", None)
    options: list[str] = []
    if ctx is not None:
        for param in ctx.command.get_params(ctx):
            options += [*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())]
    near = nearest_options(name, options)
    return f"No such option: {name}." + (f" Did you mean {' or '.join(near)}?" if near else "")


def _prompt_taken_for_option(error: Exception, argv: list[str]) -> str | None:
    """`chatcli once "-5 + 3"`: click reads the prompt as options (-5, -space, ...) and
    reports the first it does not know. The argument, when it reads as a prompt (a number, or
    words with spaces: no option has either), else None."""
    ctx = getattr(error, "ctx", None)
    name = getattr(error, "option_name", None)
    if type(error).__name__ != "NoSuchOption" or ctx is None or ctx.command.name != "once":
        return None
    if not name or name.startswith("--"):
        return None
    at = next((i for i, a in enumerate(argv) if a.startswith(name)), None)
    arg = name if at is None else argv[at]
    looks_like_prompt = arg[1:2].isdigit() or arg[1:2] == "." or len(arg.split()) > 1
    if not looks_like_prompt:
        return None
    # The prompt's other words follow it (`once -5 + 3`), up to an option of chatcli's.
    words = [arg]
    for word in argv[at + 1 :] if at is not None else []:
        if word.startswith("--"):
            break
        words.append(word)
    return " ".join(words)


def _shell_quote(text: str) -> str:
    """Quoted for a POSIX shell, in double quotes where that needs no escaping."""
    return f'"{text}"' if not set(text) & set('"$`\\!') else shlex.quote(text)


def print_version(value: bool) -> None:
    if value:
        typer.echo(f"chatcli {__version__}")
        raise typer.Exit()


def fail(message: str, code: int = 1) -> typer.Exit:
    """Prints `message` as one red line on stderr; the exit to raise (1: the command failed,
    2: the command line was wrong)."""
    from chatcli.terminal.render import make_console, render_error

    render_error(make_console(file=sys.stderr), message)
    return typer.Exit(code)


def fail_with(error: ChatcliError) -> typer.Exit:
    """`fail` for one of chatcli's errors: exit code 2 for a UsageError, else 1."""
    return fail(str(error), 2 if isinstance(error, UsageError) else 1)


# -h as well as --help, on every command (sub-commands inherit it).
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}


# ---- shared options ----------------------------------------------------------------------------

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model", "-m", help="Checkpoint: base dir, folder, model_*.pt, tag or hf:ORG/NAME."
    ),
]
# Each default is the built-in one; the config file or CHATCLI_<NAME> may set another.
SourceOpt = Annotated[
    str | None, typer.Option(help="Checkpoint kind: sft (default), rl, base or mid.")
]
# Text, checked by settings.validate_setting like the config's and CHATCLI_STEP: "latest" too.
StepOpt = Annotated[
    str | None, typer.Option(metavar="N|latest", help="Checkpoint step (default: latest).")
]
DeviceOpt = Annotated[str | None, typer.Option(help="auto (default), cpu, cuda, cuda:N or mps.")]
DtypeOpt = Annotated[str | None, typer.Option(help="auto (default), float32 or bfloat16.")]
QuantizeOpt = Annotated[
    str | None,
    typer.Option(help="CPU decode weights: none (default), int8 or int4 (big models)."),
]
SpeculateOpt = Annotated[
    str | None,
    typer.Option(
        metavar="auto|off",
        help="Draft tokens from the conversation and verify them in one pass (default auto).",
    ),
]
# Sampling flags are read as text and checked by settings.validate_setting, as the slash
# commands are: the same ranges, the same "off", the same messages.
TempOpt = Annotated[
    str | None,
    typer.Option(
        "--temperature", "--temp", "-t", metavar="T", help="0 to 2; 0 = greedy (default 0.6)."
    ),
]
TopKOpt = Annotated[
    str | None,
    typer.Option("--top-k", "-k", metavar="K", help="1 to 1000; 0 or off = off (default 50)."),
]
TopPOpt = Annotated[
    str | None,
    typer.Option("--top-p", metavar="P", help="Above 0, at most 1; 1 or off = off (default)."),
]
MaxTokOpt = Annotated[
    str | None,
    typer.Option(
        "--max-tokens", "-n", metavar="N", help="Reply length limit, 1 to 65536 (default 512)."
    ),
]
SeedOpt = Annotated[str | None, typer.Option(help="An integer, or 'random' (default).")]
SystemOpt = Annotated[
    str | None,
    typer.Option("--system", "-s", metavar="TEXT", help="System prompt (default: none)."),
]
MarkdownOpt = Annotated[str | None, typer.Option(help="auto (default), always or never.")]
ToolsOpt = Annotated[
    bool | None, typer.Option("--tools/--no-tools", help="Calculator tool (default: on).")
]
UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar="CHATCLI_URL",
        help="Chat with an OpenAI-compatible server (chatcli serve, vLLM, ollama) instead.",
    ),
]
ApiKeyOpt = Annotated[
    str | None, typer.Option("--api-key", envvar="CHATCLI_API_KEY", help="Bearer token for --url.")
]
CompileOpt = Annotated[
    bool,
    typer.Option(
        "--compile",
        help="torch.compile a large CPU model whose decode our kernels do not run (slow "
        "first start, cached; eager fallback). On a GPU it changes nothing: its eager CUDA "
        "graph step measured faster than a compiled one.",
    ),
]


def _softcap(value: float | None) -> float | None:
    problem = None if value is None else softcap_problem(value)
    if problem is not None:
        raise typer.BadParameter(problem)
    return value


SoftcapOpt = Annotated[
    float | None,
    typer.Option(
        callback=_softcap,
        help="The logit softcap (default: 15); a Mar 2 - 8 2026 variant of nanochat used 20.",
    ),
]


# The flags that pick or shape the model chatcli loads: a server at --url ignores them.
LOCAL_MODEL_FLAGS = {
    "source": "--source",
    "step": "--step",
    "device": "--device",
    "dtype": "--dtype",
    "quantize": "--quantize",
    "compile_model": "--compile",
    "softcap": "--softcap",
}


def local_model_flags(params: dict[str, Any]) -> list[str]:
    """The local-model flags given on the command line. Their values from the config file or
    CHATCLI_* are not here (None, False): those are defaults, not asked for this run."""
    return [flag for name, flag in LOCAL_MODEL_FLAGS.items() if params[name] not in (None, False)]


def server_url(url: str | None) -> str | None:
    """--url or CHATCLI_URL; empty means no server, so `--url ""` overrides an exported
    CHATCLI_URL and runs the local model."""
    return (url or "").strip() or None
