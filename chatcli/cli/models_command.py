"""The models command: the checkpoints chatcli can find, as a table."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from chatcli.cli.options import fail
from chatcli.errors import ChatcliError

# ---- models and config --------------------------------------------------------------------------


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
    from chatcli.terminal.render import make_console, render_notice
    from chatcli.terminal.render_panels import render_table

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
