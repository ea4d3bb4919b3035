"""The arena command: two models answer side by side, blind; the votes become a DPO file and
a leaderboard.

    chatcli arena -m runs/d20-sft -m runs/d20-rl     two checkpoints (or hf:ORG/NAME, embedded)
    chatcli arena -m runs/d20-sft --url URL          a checkpoint against a server
    chatcli arena export OUT.jsonl --format dpo|jsonl
    chatcli arena stats [--json]

Owns: the sides from the command line (each -m a local model, each --url a server: two in
all), the memory check before two local models load, wiring the sessions into the arena's
REPL (terminal/arena_commands.py), and the export and stats subcommands. The votes' records
and exports are chat/arena.py's, the ratings chat/ratings.py's.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from chatcli.chat.arena import EXPORT_FORMATS
from chatcli.chat.settings import conversations_dir
from chatcli.cli.options import (
    ApiKeyOpt,
    Command,
    DeviceOpt,
    DtypeOpt,
    MarkdownOpt,
    MaxTokOpt,
    OneLineErrors,
    QuantizeOpt,
    SeedOpt,
    SourceOpt,
    StepOpt,
    SystemOpt,
    TempOpt,
    ToolsOpt,
    TopKOpt,
    TopPOpt,
    fail_with,
)
from chatcli.cli.session_setup import setting_flags, settings_from
from chatcli.errors import ChatcliError, UsageError

EMBEDDED = "embedded"  # -m embedded: the model chatcli ships

arena_app = typer.Typer(
    cls=OneLineErrors,
    help="Two models answer side by side, blind; you vote. export and stats read the votes.",
    invoke_without_command=True,
    no_args_is_help=False,
)


def _sides(models: list[str], urls: list[str]) -> list[tuple[str, str | None]]:
    """("local", spec) for each -m (None: the embedded model), ("url", URL) for each --url."""
    sides: list[tuple[str, str | None]] = [
        ("local", None if m.strip() == EMBEDDED else m.strip()) for m in models
    ]
    sides += [("url", u.strip()) for u in urls if u.strip()]
    if len(sides) != 2:
        raise UsageError(
            f"An arena has two sides; {len(sides)} given. Name two: -m A -m B (a checkpoint, "
            f"hf:ORG/NAME or {EMBEDDED}), or -m A --url URL for a server."
        )
    return sides


@arena_app.callback()
def arena(
    ctx: typer.Context,
    model: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            "-m",
            metavar="MODEL",
            help=f"A side: a checkpoint (folder, model_*.pt, tag), hf:ORG/NAME or {EMBEDDED}.",
        ),
    ] = None,
    url: Annotated[
        list[str] | None,
        typer.Option(
            "--url",
            metavar="URL",
            help="A side: an OpenAI-compatible server (chatcli serve, vLLM).",
        ),
    ] = None,
    api_key: ApiKeyOpt = None,
    open_names: Annotated[
        bool, typer.Option("--open", help="Show which model is A and which B from the start.")
    ] = False,
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
) -> None:
    """Two models answer each message side by side as A and B; you vote a, b, tie or both
    bad. The votes are saved with the conversation."""
    if ctx.invoked_subcommand is not None:
        return
    try:
        sides = _sides(model or [], url or [])
        flags = setting_flags(locals())
        flags.pop("model", None)  # the sides name the models, not the config's model
        settings = settings_from(**flags)
        code = _run(sides, settings, api_key, open_names)
    except ChatcliError as e:
        raise fail_with(e) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    raise typer.Exit(code)


def _run(
    sides: list[tuple[str, str | None]], settings: Any, api_key: str | None, open_names: bool
) -> int:
    from chatcli.chat.conversation_store import NewConversation
    from chatcli.chat.turns import SamplingOptions
    from chatcli.cli.session_setup import load_session, move_old_files_saying, sampling_options
    from chatcli.terminal.arena_commands import ArenaCommands, run_arena
    from chatcli.terminal.arena_turns import Contender
    from chatcli.terminal.arena_view import ArenaUI
    from chatcli.terminal.render import make_console, render_notice

    piped = sys.stdin is not None and not sys.stdin.isatty()
    stdout_piped = sys.stdout is not None and not sys.stdout.isatty()
    console = make_console()
    notes = make_console(file=sys.stderr) if piped or stdout_piped else console
    move_old_files_saying()
    _check_memory(sides, settings)
    contenders = []
    options: SamplingOptions = sampling_options(settings)
    for kind, spec in sides:
        shown = spec or f"the {EMBEDDED} model"
        with notes.status(f"Connecting to {spec}…" if kind == "url" else f"Loading {shown}…"):
            if kind == "url":
                session, info = load_session(settings, None, url=spec, api_key=api_key)
            else:
                session, info = load_session(replace(settings, model=spec), None)
        session.options = options  # one set of settings: a change applies to both sides
        contenders.append(Contender(_side_name(spec, info), session))
    names = [c.name for c in contenders]
    render_notice(
        notes,
        f"Arena: {names[0]} vs {names[1]}. Each message gets both replies, as A and B in an "
        "order drawn anew each turn" + ("." if open_names else "; the names show after you vote."),
    )
    if names[0] == names[1]:
        render_notice(notes, "Both sides are the same model: its rating will not move.")
    render_notice(notes, "Vote a, b, t (tie) or x (both bad); /help lists the commands.")
    folder = conversations_dir()
    conversation = NewConversation(
        folder, model=f"arena: {names[0]} vs {names[1]}", system=settings.system
    )
    ui = ArenaUI(console, settings, folder, lines=sys.stdin if piped else None, notes=notes)
    commands = ArenaCommands(contenders, ui, options, conversation, folder, show_names=open_names)
    run_arena(commands, ui.read_message)
    return 1 if piped and ui.errors else 0


def _side_name(spec: str | None, info: dict) -> str:
    """What the votes call a side: a local checkpoint's file (its step in its name), a Hub
    model's id and step (its snapshot folder's path changes with each revision), a server's
    URL and model."""
    if spec is not None and spec.startswith("hf:"):
        return f"{spec} step {info['step']}" if info.get("step") is not None else spec
    return str(info["path"])


def _check_memory(sides: list[tuple[str, str | None]], settings: Any) -> None:
    """Two local models must fit together: said before either loads."""
    from chatcli.model.memory_need import check_models_fit, checkpoint_bytes, free_bytes

    needs = [
        (spec or EMBEDDED, checkpoint_bytes(spec, settings.source, settings.step))
        for kind, spec in sides
        if kind == "local"
    ]
    if len(needs) == 2:
        check_models_fit(needs, free_bytes(settings.device))


# ---- export -------------------------------------------------------------------------------------


@arena_app.command("export", cls=Command)
def export(
    output: Annotated[
        str, typer.Argument(metavar="OUT.jsonl", help="The file to write; - writes to stdout.")
    ],
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            metavar="dpo|jsonl",
            help="dpo: prompt, chosen, rejected per decisive vote (TRL's format); "
            "jsonl: every vote, whole.",
        ),
    ] = "dpo",
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
) -> None:
    """Write the arena's votes as preference data."""
    from chatcli.chat.arena import export_lines, read_votes
    from chatcli.chat.conversation_export import write_export
    from chatcli.terminal.render import make_console, render_notice

    try:
        kind = fmt.strip().lower()
        if kind not in EXPORT_FORMATS:
            raise UsageError(f"--format takes dpo or jsonl, not {fmt!r}.")
        folder = conversations_dir()
        votes = read_votes(folder)
        lines = export_lines(votes, kind)
        if not votes:
            raise ChatcliError(
                f"No arena votes in {folder} yet: chatcli arena -m A -m B, then vote."
            )
        if not lines:
            raise ChatcliError(
                f"None of the {len(votes)} votes prefers one reply (ties and both bad): "
                "--format jsonl keeps them."
            )
        text = "".join(line + "\n" for line in lines)
        if output == "-":
            sys.stdout.write(text)
            return
        write_export(text, Path(output).expanduser(), force, "add --force")
        what = "preference pairs" if kind == "dpo" else "votes"
        render_notice(make_console(file=sys.stderr), f"Wrote {len(lines)} {what} to {output}.")
    except ChatcliError as e:
        raise fail_with(e) from None


# ---- stats --------------------------------------------------------------------------------------


@arena_app.command("stats", cls=Command)
def stats(
    as_json: Annotated[bool, typer.Option("--json", help="Print the leaderboard as JSON.")] = False,
) -> None:
    """The leaderboard of every arena's votes: ratings and each pair's record.

    Bradley-Terry ratings on the Elo scale with 95% bootstrap intervals, and each pair's
    wins, losses, ties and both-bad votes."""
    from chatcli.chat.arena import read_votes
    from chatcli.chat.ratings import (
        ANCHOR,
        BOOTSTRAP_ROUNDS,
        BOOTSTRAP_SEED,
        leaderboard,
        pair_tallies,
    )
    from chatcli.terminal.render import make_console, render_notice
    from chatcli.terminal.render_panels import render_table

    try:
        folder = conversations_dir()
        battles = [v.battle for v in read_votes(folder)]
    except ChatcliError as e:
        raise fail_with(e) from None
    board = leaderboard(battles)
    pairs = pair_tallies(battles)
    if as_json:
        out = {
            "votes": len(battles),
            "ratings": [
                {
                    "model": r.model,
                    "rating": round(r.rating, 1),
                    "ci_low": round(r.low, 1),
                    "ci_high": round(r.high, 1),
                    "votes": r.votes,
                }
                for r in board
            ],
            "pairs": [
                {
                    "model": p.first,
                    "opponent": p.second,
                    "wins": p.wins,
                    "losses": p.losses,
                    "ties": p.ties,
                    "both_bad": p.both_bad,
                }
                for p in pairs
            ],
            "scale": {
                "anchor": ANCHOR,
                "bootstrap_rounds": BOOTSTRAP_ROUNDS,
                "seed": BOOTSTRAP_SEED,
            },
        }
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
        return
    if not battles:
        render_notice(
            make_console(file=sys.stderr),
            f"No arena votes in {folder} yet: chatcli arena -m A -m B, then vote.",
        )
        return
    if not board:
        render_notice(
            make_console(file=sys.stderr),
            f"All {len(battles)} votes are of a model against itself: nothing to rank.",
        )
        return
    console = make_console()
    render_table(
        console,
        ("rank", "model", "rating", "95% CI", "votes"),
        [
            (str(i), r.model, f"{r.rating:.0f}", f"{r.low:.0f} to {r.high:.0f}", str(r.votes))
            for i, r in enumerate(board, start=1)
        ],
    )
    console.print()
    render_table(
        console,
        ("model", "vs", "wins", "losses", "ties", "both bad"),
        [
            (p.first, p.second, str(p.wins), str(p.losses), str(p.ties), str(p.both_bad))
            for p in pairs
        ],
    )
