"""The models command: the checkpoints chatcli can find, as a table: the embedded model, a
nanochat base dir's, and the runnable models in the Hub cache (hf:ORG/NAME)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from chatcli.cli.options import fail, fail_with
from chatcli.errors import ChatcliError

if TYPE_CHECKING:
    from chatcli.model.hub_cache import CachedHubModel

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
    from chatcli.model.checkpoint_listing import list_checkpoints
    from chatcli.model.checkpoint_paths import default_base_dir
    from chatcli.model.hub_cache import list_cached_models
    from chatcli.terminal.render import make_console, render_notice
    from chatcli.terminal.render_panels import render_table

    if base_dir is not None and not base_dir.is_dir():
        raise fail(
            f"No folder at {base_dir}. Pass --base-dir a folder: a nanochat base dir (the "
            "one that holds chatsft_checkpoints, base_checkpoints, ...), one of those, or a "
            "download's folder of model_*.pt files.",
            2,  # the option's value is wrong: a usage error
        )
    try:
        found = list_checkpoints(base_dir)
        # --base-dir asks about one folder; without it, the Hub cache's models are listed too.
        hub = [] if base_dir is not None else list_cached_models()
    except ChatcliError as e:
        raise fail_with(e) from None
    console = make_console()
    rows = [
        (
            c.name,
            c.source or "-",
            c.tag or "-",
            "-" if c.step is None else str(c.step),
            c.era,
            f"{c.num_params / 1e6:.1f}M" if c.problem is None else "-",
            f"{c.size_bytes / 1e6:.1f} MB",
            str(c.path) if c.problem is None else f"{c.path} (unreadable)",
        )
        for c in found
    ]
    rows += [_hub_row(m) for m in hub]
    render_table(console, ("model", "source", "tag", "step", "era", "params", "size", "path"), rows)
    errors = make_console(file=sys.stderr)
    for c in [*found, *hub]:
        if c.problem is not None:  # said once where the problem names its file already
            render_notice(
                errors, c.problem if str(c.path) in c.problem else f"{c.path}: {c.problem}"
            )
    if all(c.name == "embedded" for c in found) and not hub:
        # Said for the default base dir too: NANOCHAT_BASE_DIR pointing at the wrong place
        # looked like a listing with nothing more to find.
        looked = base_dir or default_base_dir()
        render_notice(
            errors,
            f"No checkpoints in {looked}: no model_*.pt there, nor in its chatsft_checkpoints, "
            "base_checkpoints, ... folders." + ("" if base_dir else " --base-dir looks elsewhere."),
        )


def _hub_row(m: CachedHubModel) -> tuple[str, ...]:
    """A row of a model in the Hub cache: a nanochat checkpoint's facts, or a transformers
    folder's (no source, tag, step or era of its own)."""
    c = m.checkpoint
    params = f"{m.num_params / 1e6:.1f}M" if m.num_params is not None else "-"
    path = str(m.path) if m.problem is None else f"{m.path} (not runnable)"
    if c is None:
        return (m.name, "-", "-", "-", m.era or "-", params, f"{m.size_bytes / 1e6:.1f} MB", path)
    return (
        m.name,
        c.source or "-",
        c.tag or "-",
        str(c.step),
        c.era,
        params,
        f"{m.size_bytes / 1e6:.1f} MB",
        path,
    )
