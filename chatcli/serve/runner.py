"""Running the app: the listening socket, uvicorn, and `chatcli serve`'s entry point.

Owns: binding the address first (a taken port fails before minutes of model loading), the
devices the local workers run on, loading one replica per worker, uvicorn with a shutdown that
ends open generations at once, `serve` (what `chatcli serve` runs without --ray), and
`BackgroundServer` (the app on a thread, for tests and scripts). The HTTP surface itself is
app.py's; a Ray cluster's counterpart of `serve` is ray_cluster.py's.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI

from chatcli.errors import ChatcliError, ConfigError
from chatcli.serve.app import create_app
from chatcli.serve.backend import Backend
from chatcli.serve.guards import hosts_to_check
from chatcli.serve.requests import (
    Limits,
)
from chatcli.serve.worker_pool import (
    Worker,
)

MAX_PORT = 65535
# uvicorn's wait for open connections at shutdown; the pool ends generations well before.
GRACE_S = 5


# ---- running it ---------------------------------------------------------------------------------


def worker_devices(device: str = "auto", workers: int | None = None) -> list[str]:
    """One device per worker: every CUDA GPU by default where there is one, else one CPU
    (or MPS) worker unless `workers` asks for more replicas."""
    import torch

    from chatcli.model.device_choice import on_apple_silicon
    from chatcli.model.model_build import pick_device

    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be at least 1 (got {workers}).")
    resolved = pick_device(device)
    if device == "auto" and resolved.type == "mps" and on_apple_silicon():
        # Each worker's load weighs our CPU kernels against MPS by the model's size, as
        # `chatcli chat` does (model/device_choice.py): the size is not known here yet.
        return ["auto"] * (workers or 1)
    if resolved.type == "cuda" and resolved.index is None:
        count = torch.cuda.device_count()
        return [f"cuda:{i % count}" for i in range(workers or count)]
    return [str(resolved)] * (workers or 1)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or a ChatcliError that says which flag to fix."""
    # bind() itself raises OverflowError, not OSError, for a port out of range.
    if not 0 <= port <= MAX_PORT:
        raise ChatcliError(
            f"--port must be between 0 and {MAX_PORT} (0 picks a free port); got {port}."
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ChatcliError(_bind_error(host, port, e)) from e
    sock.listen(2048)
    return sock


def _bind_error(host: str, port: int, e: OSError) -> str:
    """Why bind() failed, pointing at --host or --port, whichever is at fault."""
    where = f"Cannot listen on {host}:{port}: {e.strerror or e}."
    check_host = (
        "Check --host: it must be an address of this machine (127.0.0.1 for this machine "
        "only, 0.0.0.0 for every network)."
    )
    # gaierror: the host is neither an address nor a name that resolves (999.1.1.1, typos).
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return f"{where} {check_host}"
    if e.errno == errno.EADDRINUSE:
        return f"{where} Is another server running there? Pick another --port."
    if e.errno == errno.EACCES and 0 < port < 1024:
        return f"{where} Ports below 1024 need root: pick a --port above 1023."
    return f"{where} Check --host and --port."


class _Server(uvicorn.Server):
    """uvicorn's Server, that closes the pool first when it shuts down (Ctrl-C, SIGTERM,
    BackgroundServer.stop): open streams then end at once with an error event and [DONE],
    queued and non-streamed requests with a 503, instead of running on through the grace
    period and being cut off mid-body, a CancelledError logged for each."""

    def __init__(self, config: uvicorn.Config, pool: Backend | None) -> None:
        super().__init__(config)
        self.pool = pool

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.pool is not None:
            self.pool.close()
        await super().shutdown(sockets)


def run_app(app: FastAPI, sock: socket.socket, log_level: str = "info") -> None:
    """Serve `app` (create_app's or any ASGI app) on the listening `sock` until Ctrl-C or
    SIGTERM, in this thread."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=GRACE_S)
    _Server(config, getattr(app.state, "pool", None)).run(sockets=[sock])


def serve(
    model: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: int | None = None,
    device: str = "auto",
    limits: Limits = Limits(),
    *,
    cache_slots: int = 1,
    batch: int | None = None,
    source: str = "sft",
    step: int | None = None,
    dtype: str = "auto",
    quantize: str = "none",
    softcap: float | None = None,
    model_name: str | None = None,
    api_keys: Sequence[str] = (),
    log_level: str = "info",
    on_listening: Callable[[], None] | None = None,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
    speculate: bool = False,
) -> None:
    """Load one replica of `model` per worker and serve until interrupted. Each worker keeps
    `cache_slots` conversations' K/V warm (worker_pool.Worker) and decodes up to `batch`
    requests together (None: scheduler.default_rows for its device; 1: one at a time).
    On a loopback `host` only loopback Host names are answered (hosts_to_check); with
    `api_keys`, only requests that carry one of them (chatcli.serve.auth).

    on_ready gets {"url", "model", "devices", "cpu_threads", "batch"} once the models are
    loaded, just before the first request can come in: the CLI's cue to say where the server
    is. cpu_threads is the CPU plan's thread count (cpu_plan.py), None off the CPU.
    on_listening is called once the address is taken, before the models load: what must be
    said at once. speculate: a request drafts and verifies while it decodes alone in its
    worker (speculation.py).
    """
    from chatcli.engine.cpu_plan import apply_cpu_plan

    sock = listen(host, port)  # fail on a taken port before minutes of model loading
    try:
        if on_listening is not None:
            on_listening()
        load = dict(source=source, step=step, dtype=dtype, quantize=quantize, softcap=softcap)
        devices = worker_devices(device, workers)
        replicas = _load_workers(model, devices, cache_slots, batch, load)
        for worker in replicas:
            worker.engine.speculate = speculate
        # torch's thread count is the process's: the generation threads take it up when they
        # start. A small model decodes fastest on one (cpu_plan), as it does in `chatcli chat`.
        plan = apply_cpu_plan(replicas[0].engine.model)
        info = replicas[0].engine.model.info
        name = model_name or ("chatcli-default" if info.embedded else info.tag or "chatcli")
        app = create_app(
            replicas,
            limits,
            name,
            allowed_hosts=hosts_to_check(host),
            api_keys=api_keys,
            demo=info.embedded,
        )
        if on_ready is not None:
            shown = f"[{host}]" if ":" in host else host
            devices = [w.device for w in replicas]
            bound = sock.getsockname()[1]  # the real port when asked for 0
            threads = plan.threads if plan else None  # None: not a CPU model
            on_ready(
                {
                    "url": f"http://{shown}:{bound}",
                    "model": name,
                    "devices": devices,
                    "cpu_threads": threads,
                    "batch": replicas[0].rows,
                }
            )
        run_app(app, sock, log_level)
    finally:
        sock.close()


def _load_workers(
    model: str | None,
    devices: list[str],
    cache_slots: int,
    batch: int | None,
    load: dict[str, Any],
) -> list[Worker]:
    """A Worker per device, each with its own copy of the model (load_model's `load`)."""
    from chatcli.engine.scheduler import default_rows
    from chatcli.model.checkpoint import load_model

    replicas = []
    for i, dev in enumerate(devices):
        m, tokenizer, _ = load_model(model, device=dev, **load)
        rows = batch if batch is not None else default_rows(m.get_device())
        replicas.append(Worker(m, tokenizer, name=str(i), cache_slots=cache_slots, batch=rows))
    return replicas


class BackgroundServer:
    """Serves an app from a thread on a free loopback port (tests, benchmarks, notebooks).

    with BackgroundServer(app) as server: httpx.get(server.url + "/health")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = listen(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
        self._server = _Server(config, getattr(app.state, "pool", None))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def thread(self) -> threading.Thread:
        """The thread uvicorn's event loop runs on."""
        return self._thread

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
