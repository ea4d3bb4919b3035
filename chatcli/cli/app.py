"""The `chatcli` command: chat, once, models, pull, serve, bench, export, conversations, arena,
config path; -h and --version.

Owns: the Typer app and its subcommands' registration, the root options, and `main` (choosing
how OpenMP threads wait before torch loads; stdout full or closed as one line,
`output_stream`). Each command lives in its own module
(`chat_commands`, `models_command`, `pull_command`, `serve_command`, `bench_command`,
`export_command`, `conversations_command`, `arena_command`); the shared options and click's one-line errors
live in `options`, settings and session loading in `session_setup`.
Typer lives only in this package. torch is imported only by the commands that load a model, so
`chatcli --help` stays fast.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from chatcli.chat.settings import config_path
from chatcli.cli.arena_command import arena_app
from chatcli.cli.bench_command import BENCH_HELP, bench
from chatcli.cli.chat_commands import chat, once
from chatcli.cli.conversations_command import conversations_app
from chatcli.cli.export_command import EXPORT_HELP, export
from chatcli.cli.models_command import models
from chatcli.cli.openmp_wait import choose_openmp_wait
from chatcli.cli.options import (
    HELP_OPTIONS,
    Command,
    OneLineErrors,
    fail,
    print_version,
)
from chatcli.cli.output_stream import CLOSED_AT_START, OutputFailed, drop_stdout, guard_stdout
from chatcli.cli.pull_command import pull
from chatcli.cli.serve_command import SERVE_HELP, serve

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
app.add_typer(conversations_app, name="conversations")
app.add_typer(arena_app, name="arena")


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


@config_app.command("path", cls=Command)
def config_path_command() -> None:
    """Print the config file's path (it may not exist yet)."""
    typer.echo(str(config_path()))


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
    if not guard_stdout():
        sys.exit(fail(CLOSED_AT_START).exit_code)
    try:
        app(args=bare_resume_means_last(sys.argv[1:]), prog_name="chatcli")
    except OutputFailed as e:  # stdout full or closed: one line on stderr, not a traceback
        drop_stdout()
        sys.exit(fail(str(e)).exit_code)


app.command(cls=Command)(chat)
app.command(cls=Command)(once)
app.command(cls=Command)(models)
app.command(cls=Command)(pull)
app.command(cls=Command, help=SERVE_HELP)(serve)
app.command(cls=Command, help=BENCH_HELP)(bench)
app.command(cls=Command, help=EXPORT_HELP)(export)
