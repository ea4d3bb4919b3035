"""The serve command: the OpenAI-compatible server and its chat page, on this machine or with
its replicas on a Ray cluster (--ray), and who may use it."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from chatcli.cli.options import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    QuantizeOpt,
    SoftcapOpt,
    SourceOpt,
    SpeculateOpt,
    StepOpt,
    fail,
    fail_with,
)
from chatcli.cli.session_setup import settings_from
from chatcli.errors import ChatcliError, UsageError

RAY_EXTRA = "chatcli serve --ray needs the ray extra: pip install 'chatcli[ray]'"
# One line a paragraph: Typer shows a help's single line breaks as they are.
SERVE_HELP = (
    "Serve an OpenAI-compatible API (/v1/chat/completions) and a chat page (/).\n\n"
    "Three ways to serve it. On one machine (the default): a replica of the model per GPU, or --workers N of them on "
    "the CPU, in this process. Pick it while one machine keeps up with the load.\n\n"
    # \\[ is Rich's escape: the help is Rich markup.
    "On a Ray cluster (--ray ADDRESS; pip install 'chatcli\\[ray]'): the same server, its "
    "replicas on the cluster's machines under Ray Serve, which replaces a replica that dies "
    "and, with --workers MIN-MAX, adds replicas while requests queue; a conversation's turns "
    "go back to the replica that holds its cache. Start the cluster with `ray start --head` "
    "on one machine and `ray start --address HEAD:6379` on the others, then serve from one "
    "of them with --ray auto; --ray ray://HEAD:10001 serves from the head node, started "
    "from anywhere; --ray local tries it on this machine alone. Pick it past one machine, "
    "for any nanochat era.\n\n"
    "As a transformers export under vLLM (`chatcli export`, then `vllm serve`; see "
    "docs/huggingface.md): vLLM's batched GPU engine, for the eras transformers can load. "
    "Pick it for the most throughput on GPUs where it applies."
)


def serve(
    model: ModelOpt = None,
    source: SourceOpt = None,
    step: StepOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = None,
    speculate: SpeculateOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: a free one, said on start).")] = 8000,
    workers: Annotated[
        str | None,
        typer.Option(
            metavar="N",
            help="Model replicas (default: one per GPU, else 1). With --ray also MIN-MAX: "
            "Ray Serve adds and removes replicas in that range as requests queue.",
        ),
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
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            "--api-key",
            metavar="KEY",
            help="Let in only requests with Authorization: Bearer KEY (repeat for more keys; "
            "without it, CHATCLI_API_KEY holds one key, spaces inside kept); /health and the "
            "chat page's HTML stay open.",
        ),
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH",
            help="Keys to let in, one a line (# starts a comment); readable by you alone "
            "(chmod 600), or the server warns.",
        ),
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Run the replicas on a Ray cluster: local (one started here), auto (the "
            "cluster this machine joined, or RAY_ADDRESS) or ray://HEAD:10001 (Ray Client: "
            "the server then runs on the head node, listening on --host and --port there).",
        ),
    ] = None,
    replica_cpus: Annotated[
        float,
        typer.Option(help="With --ray: CPUs each CPU replica reserves and runs torch on."),
    ] = 1.0,
) -> None:
    """Serve an OpenAI-compatible API (/v1/chat/completions) and a chat page (/)."""
    try:
        from chatcli.serve.app import Limits
        from chatcli.serve.auth import open_server_warning
        from chatcli.serve.runner import MAX_PORT
        from chatcli.serve.runner import serve as run_server
    except ImportError:
        raise fail("chatcli serve needs the serve extra: pip install -e '.[serve]'") from None

    try:
        count = replica_count(workers, ray is not None)
        s = settings_from(
            model=model,
            source=source,
            step=step,
            device=device,
            dtype=dtype,
            quantize=quantize,
            speculate=speculate,
        )
        # The command line's mistakes first (exit 2), then the files' and the system's (1).
        if not 0 <= port <= MAX_PORT:
            raise UsageError(
                f"--port must be between 0 and {MAX_PORT} (0 picks a free port); got {port}."
            )
        keys = _api_keys(api_key, api_key_file)
        warning = open_server_warning(host, port, keys)
        locked = f"; {len(keys)} API key{'s' if len(keys) > 1 else ''}" if keys else ""
        options: dict[str, Any] = dict(
            host=host,
            port=port,
            cache_slots=cache_slots,
            batch=batch,
            device=s.device,
            limits=Limits(max_queue=max_queue),
            source=s.source,
            step=s.step,
            dtype=s.dtype,
            quantize=s.quantize,
            softcap=softcap,
            api_keys=keys,
            # once it listens, before the model loads: not minutes later
            on_listening=lambda: _warn(warning),
            on_ready=lambda info: _say_ready(info, locked),
        )
        if ray is None:
            workers_count = count[0] if count else None
            drafting = s.speculate == "auto"
            run_server(s.model, workers=workers_count, speculate=drafting, **options)
            return
        try:
            from chatcli.serve.ray_cluster import ReplicaCount, serve_on_ray
        except ImportError:
            raise fail(RAY_EXTRA) from None
        serve_on_ray(
            ray,
            s.model,
            workers=ReplicaCount(*count) if count else None,
            replica_cpus=replica_cpus,
            speculate=s.speculate == "auto",
            **options,
        )
    except ChatcliError as e:
        raise fail_with(e) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _api_keys(given: list[str] | None, key_file: Path | None) -> tuple[str, ...]:
    """The keys the server lets in: --api-key's (a usage error if one is malformed), else
    CHATCLI_API_KEY's, plus --api-key-file's (with a warning if others may read it)."""
    from chatcli.serve.keys import api_keys, env_key, key_file_warning

    try:
        keys = api_keys(given or (), None)
    except ChatcliError as e:
        raise UsageError(str(e)) from None
    if not given:  # the variable is read whole here: click would split it at spaces
        keys = api_keys([key] if (key := env_key()) is not None else [])
    if key_file is not None:
        keys = api_keys(keys, key_file)
        _warn(key_file_warning(key_file))
    return keys


def _warn(warning: str | None) -> None:
    """A warning, if any, on stderr in the terminal's notice style."""
    if warning is not None:
        from chatcli.terminal.render import make_console, render_notice

        render_notice(make_console(file=sys.stderr), warning)


def replica_count(text: str | None, ray: bool) -> tuple[int, int] | None:
    """--workers as (low, high): "3" is (3, 3), "1-4" (1, 4) (with --ray only)."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if match is None:
        raise UsageError(
            f"--workers takes a count (2) or, with --ray, a range (1-4); got {text!r}."
        )
    low = int(match[1])
    high = int(match[2]) if match[2] else low
    if low < 1 or high < low:
        raise UsageError(f"--workers {text}: counts start at 1, and a range goes up (1-4).")
    if high != low and not ray:
        raise UsageError(
            f"--workers {text}: a range autoscales, which needs a Ray cluster: add --ray local "
            "(or auto), or give one count."
        )
    return low, high


def _say_ready(info: dict[str, Any], locked: str = "") -> None:
    where = ", ".join(info["devices"])
    ray = info.get("ray")
    if ray:
        cluster = "a local Ray cluster" if ray["local"] else f"Ray at {ray['address']}"
        where = f"{ray['replicas']} {info['devices'][0]} replica(s) on {cluster}"
        started = ray["connect_s"] + ray["deploy_s"]
        where += f" (up in {started:.1f} s)"
        if ray["front"] == "head":
            where += ", from the head node"
    rows = info.get("batch", 1)
    at_once = "one request at a time" if rows == 1 else f"up to {rows} requests at once"
    typer.echo(
        f"Serving {info['model']} on {where} at {info['url']} (chat page at /, API at "
        f"/v1{locked}; {at_once} a replica)"
    )
