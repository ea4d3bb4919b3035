"""The pull command: download a Hub model into the Hub cache, then say where and how to run it.

It fetches exactly what `--model hf:ORG/NAME` loads (the same source and step choice), so a
pulled model runs offline afterwards. The fetching is chatcli.model.hub's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from chatcli.cli.options import SourceOpt, StepOpt, fail
from chatcli.cli.session_setup import settings_from
from chatcli.errors import ChatcliError

# ORG/NAME[@REVISION] with no hf: in front, which pull (and only pull) takes as a Hub id.
_BARE_ID = re.compile(r"[A-Za-z0-9][^/@\s]*/[^/@\s]+(@\S+)?")


def pull(
    model: Annotated[
        str,
        typer.Argument(
            metavar="hf:ORG/NAME[@REVISION]",
            help="The Hub model: its id, optionally @ a branch, tag or commit.",
            show_default=False,
        ),
    ],
    source: SourceOpt = None,
    step: StepOpt = None,
) -> None:
    """Download a Hub model (nanochat's or transformers' format) to run it, offline too."""
    from chatcli.model.hub import fetch_model
    from chatcli.model.hub_layout import HUB_PREFIX, is_hub_id

    if not is_hub_id(model):
        if not _BARE_ID.fullmatch(model) or Path(model).exists():
            raise fail(
                f"chatcli pull takes a Hub model, hf:ORG/NAME[@REVISION], not {model!r}: a "
                "local model needs no pull (pass it to --model as it is)."
            )
        model = HUB_PREFIX + model
    try:
        s = settings_from(source=source, step=step)
        got = fetch_model(model, source=s.source, step=s.step)
    except ChatcliError as e:
        raise fail(str(e)) from None
    what = (
        f"{got.picked.model_file} (step {got.picked.step})"
        if got.picked.layout == "nanochat"
        else "a transformers-format model"
    )
    where = "Found" if got.cache_only else "Pulled"
    typer.echo(f"{where} {got.hub} at commit {got.commit[:12]}: {what}, in {got.folder}")
    if got.cache_only:
        typer.echo(f"Only the Hub cache was read: {got.cache_only}.")
    flags = (f" --source {source}" if source else "") + (f" --step {step}" if step else "")
    typer.echo(f"Run it: chatcli chat --model {got.hub}{flags}")
