"""The serve command: the OpenAI-compatible server and its chat page."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from chatcli.cli.options import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    QuantizeOpt,
    SoftcapOpt,
    SourceOpt,
    StepOpt,
    fail,
)
from chatcli.cli.session_setup import settings_from
from chatcli.errors import ChatcliError


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
    batch: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="Requests each worker decodes together, one step for all (1: one at a "
            "time; default: 8 on a CPU, 16 on a GPU). See docs/batching.md.",
        ),
    ] = None,
    max_queue: Annotated[
        int,
        typer.Option(
            min=0,
            help="Requests that may wait for a free row of a worker; one more gets a 429 "
            "(default 64).",
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
        s = settings_from(
            model=model, source=source, step=step, device=device, dtype=dtype, quantize=quantize
        )
        run_server(
            s.model,
            host=host,
            port=port,
            workers=workers,
            cache_slots=cache_slots,
            batch=batch,
            device=s.device,
            limits=Limits(max_queue=max_queue),
            source=s.source,
            step=s.step,
            dtype=s.dtype,
            quantize=s.quantize,
            softcap=softcap,
            on_ready=_say_ready,
        )
    except ChatcliError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _say_ready(info: dict[str, Any]) -> None:
    rows = info["batch"]
    at_once = "one request at a time" if rows == 1 else f"up to {rows} requests at once"
    typer.echo(
        f"Serving {info['model']} on {', '.join(info['devices'])} at {info['url']} "
        f"(chat page at /, API at /v1; {at_once} per worker)"
    )
