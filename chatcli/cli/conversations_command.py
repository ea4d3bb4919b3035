"""The conversations command: the saved conversations from the shell, without starting a chat.

    chatcli conversations                      list them: id, name, date, turns, first question
    chatcli conversations show ID              one, as the chat showed it
    chatcli conversations rm ID [ID...]        delete them
    chatcli conversations export ID --format md|json [--output PATH [--force]]

ID is a saved conversation's id, its name given by /save NAME, a unique id prefix, or `last`,
always found in the conversations folder: never a path, so `rm ./notes.txt` deletes nothing.
Finding and reading the files is chatcli.chat's; drawing, render's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from chatcli.chat.conversation_format import LATEST
from chatcli.chat.settings import conversations_dir
from chatcli.cli.options import Command, OneLineErrors, fail_with
from chatcli.cli.session_setup import move_old_files_saying
from chatcli.errors import ChatcliError, ConversationFileError

EXPORT_FORMATS = ("md", "json")

conversations_app = typer.Typer(
    cls=OneLineErrors,
    help="List, show, remove or export the saved conversations.",
    invoke_without_command=True,
    no_args_is_help=False,
)

IdArg = Annotated[
    str,
    typer.Argument(
        metavar="ID", help=f"An id, a name (/save NAME), a unique id prefix, or {LATEST!r}."
    ),
]


def _folder() -> Path:
    """The conversations' folder, once files an earlier chatcli kept elsewhere are in it."""
    move_old_files_saying()
    return conversations_dir()


def _find(folder: Path, wanted: str, *, prefix: bool = True) -> Path:
    from chatcli.chat.conversation_index import saved_conversation

    return saved_conversation(folder, wanted, prefix=prefix)


@conversations_app.callback()
def conversations(ctx: typer.Context) -> None:
    """List the saved conversations (newest first), or show, remove or export one."""
    if ctx.invoked_subcommand is not None:
        return
    from chatcli.chat.conversation_index import list_conversations
    from chatcli.terminal.render import make_console, render_notice
    from chatcli.terminal.render_panels import render_table

    try:
        folder = _folder()
        summaries = list_conversations(folder)
    except ChatcliError as e:
        raise fail_with(e) from None
    if not summaries:
        render_notice(
            make_console(file=sys.stderr),
            f"No saved conversations in {folder}. A chat saves each as it goes.",
        )
        return
    rows = [
        (
            s.id,
            s.name or "-",
            f"{s.modified:%Y-%m-%d %H:%M}",
            str(s.turns) if s.problem is None else "-",
            s.preview if s.problem is None else f"(unreadable: {s.problem})",
        )
        for s in summaries
    ]
    render_table(make_console(), ("id", "name", "date", "turns", "first question"), rows)


@conversations_app.command("show", cls=Command)
def show(conversation: IdArg) -> None:
    """Print a conversation as the chat showed it."""
    from chatcli.chat.conversation_index import summarize
    from chatcli.chat.conversation_reader import read_conversation
    from chatcli.terminal.render import make_console, render_notice
    from chatcli.terminal.render_panels import render_transcript

    try:
        path = _find(_folder(), conversation)
        loaded = read_conversation(path)
    except ChatcliError as e:
        raise fail_with(e) from None
    notes = make_console(file=sys.stderr)
    for warning in loaded.warnings:
        render_notice(notes, f"{path.name}: {warning}")
    summary = summarize(path)
    console = make_console()
    title = [summary.id, *([summary.name] if summary.name else [])]
    title += [f"{summary.modified:%Y-%m-%d %H:%M}", f"{summary.turns} turns"]
    model = loaded.header.get("model")
    render_notice(console, " · ".join(title) + (f" · {model}" if model else ""))
    render_transcript(console, loaded.messages)


@conversations_app.command("rm", cls=Command)
def rm(
    conversation: Annotated[
        list[str], typer.Argument(metavar="ID...", help="The conversations to remove.")
    ],
) -> None:
    """Delete saved conversations (each found before any is deleted)."""
    from chatcli.terminal.render import make_console, render_notice

    try:
        folder = _folder()
        # Whole ids or names only: a prefix that matches one conversation today may be a
        # guess the user did not mean, and a deletion cannot be taken back.
        paths = list(dict.fromkeys(_find(folder, w, prefix=False) for w in conversation))
        for path in paths:
            try:
                path.unlink()
            except OSError as e:
                raise ConversationFileError(f"Cannot remove {path} ({e}).") from None
            render_notice(make_console(file=sys.stderr), f"Removed {path.stem} ({path}).")
    except ChatcliError as e:
        raise fail_with(e) from None


@conversations_app.command("export", cls=Command)
def export(
    conversation: IdArg,
    fmt: Annotated[
        str,
        typer.Option("--format", "-f", metavar="md|json", help="Markdown or nanochat JSON."),
    ] = "md",
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", metavar="PATH", help="Write there (default: stdout)."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace the --output file if it exists.")
    ] = False,
) -> None:
    """Write a conversation out as Markdown or JSON."""
    from chatcli.chat.conversation_export import export_json, export_markdown, write_export
    from chatcli.chat.conversation_reader import read_conversation
    from chatcli.errors import UsageError
    from chatcli.terminal.render import make_console, render_notice

    try:
        kind = fmt.strip().lower().replace("markdown", "md")
        if kind not in EXPORT_FORMATS:
            raise UsageError(f"--format takes md or json, not {fmt!r}.")
        path = _find(_folder(), conversation)
        messages = read_conversation(path).messages
        text = export_markdown(messages) if kind == "md" else export_json(messages)
        if output is None:
            sys.stdout.write(text)
            return
        write_export(text, output, force, "add --force")
        count = sum(m["role"] != "system" for m in messages)
        render_notice(make_console(file=sys.stderr), f"Wrote {count} messages to {output}.")
    except ChatcliError as e:
        raise fail_with(e) from None
