"""The serve command: the OpenAI-compatible server and its chat page, and who may use it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

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
    fail_with,
)
from chatcli.cli.session_setup import settings_from
from chatcli.errors import ChatcliError, UsageError


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
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            "--api-key",
            envvar="CHATCLI_API_KEY",
            metavar="KEY",
            help="Let in only requests with Authorization: Bearer KEY (repeat for more keys); "
            "/health and the chat page's HTML stay open.",
        ),
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option(metavar="PATH", help="Keys to let in, one a line (# starts a comment)."),
    ] = None,
) -> None:
    """Serve an OpenAI-compatible API (/v1/chat/completions) and a chat page (/)."""
    try:
        from chatcli.serve.app import MAX_PORT, Limits
        from chatcli.serve.app import serve as run_server
        from chatcli.serve.auth import api_keys, open_server_warning
    except ImportError:
        raise fail("chatcli serve needs the serve extra: pip install -e '.[serve]'") from None
    from chatcli.terminal.render import make_console, render_notice

    try:
        s = settings_from(
            model=model, source=source, step=step, device=device, dtype=dtype, quantize=quantize
        )
        # The command line's mistakes first (exit 2), then the files' and the system's (1).
        if not 0 <= port <= MAX_PORT:
            raise UsageError(
                f"--port must be between 0 and {MAX_PORT} (0 picks a free port); got {port}."
            )
        if workers is not None and workers < 1:
            raise UsageError(f"--workers must be at least 1 (got {workers}).")
        try:
            keys = api_keys(api_key or (), None)
        except ChatcliError as e:
            raise UsageError(str(e)) from None
        if api_key_file is not None:
            keys = api_keys(keys, api_key_file)
        warning = open_server_warning(host, port, keys)

        def warn() -> None:  # once it listens, before the model loads: not minutes later
            if warning is not None:
                render_notice(make_console(file=sys.stderr), warning)

        locked = f"; {len(keys)} API key{'s' if len(keys) > 1 else ''}" if keys else ""
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
            api_keys=keys,
            on_listening=warn,
            on_ready=lambda i: typer.echo(
                f"Serving {i['model']} on {', '.join(i['devices'])} at {i['url']} "
                f"(chat page at /, API at /v1{locked})"
            ),
        )
    except ChatcliError as e:
        raise fail_with(e) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
