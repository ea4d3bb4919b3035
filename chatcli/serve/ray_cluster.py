"""`chatcli serve --ray ADDRESS`: join or start a Ray cluster, deploy the model's replicas on
it with Ray Serve, and serve the same HTTP app over them from this process.

Owns: reading ADDRESS (`local` starts a one-machine cluster in this process, `auto` finds a
running one by Ray's rules, RAY_ADDRESS included, `ray://HOST:PORT` names one); the
deployment's options (a fixed count of replicas or an autoscaled range, one GPU each where
the cluster has GPUs, else CPUs with torch's threads to match, one request at a time each);
listing the live replicas; and the life of it all: the app answers once every replica has
loaded the model, and Ctrl-C or SIGTERM closes the app, then removes the deployment (and
stops a local cluster) before the process exits.

The front stays this process (uvicorn, chatcli.serve.app) rather than Serve's own HTTP
proxy: the one app, with its guards, limits, errors, streaming and shutdown, serves both
back ends, and Serve carries only the calls to the replicas.

Knows nothing of HTTP beyond handing chatcli.serve.app a RayBackend.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Before Ray loads: nothing but connect() may join a cluster. Ray would otherwise join one
# for any call made unconnected, such as a thread of Serve's still running once the
# cluster was left, and find whichever cluster `ray start` last ran on this machine.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")

import ray
from ray import serve

from chatcli.errors import ChatcliError, ConfigError
from chatcli.serve.ray_names import APP, DEPLOYMENT, live_replicas
from chatcli.serve.requests import Limits

log = logging.getLogger(__name__)

ROUTER = "chatcli.serve.ray_router.ConversationRouter"
# A local cluster's shared-memory object store: replicas send only token ids and text.
LOCAL_OBJECT_STORE_BYTES = 100 * 1024 * 1024
# Serve checks each replica this often; a dead one is replaced on the next check.
HEALTH_CHECK_S = 2.0
# A replica being removed waits this long for its requests (the front cancelled them).
REPLICA_GRACE_S = 5.0
# How often the process that started a ray:// front checks it is still there.
WATCH_FRONT_S = 5.0
# The most each step of leaving the cluster may take.
TEARDOWN_S = 30.0


@dataclass(frozen=True)
class ReplicaCount:
    """--workers with --ray: a fixed count (low == high) or a range to autoscale in."""

    low: int
    high: int

    @property
    def autoscaled(self) -> bool:
        return self.low != self.high

    def __str__(self) -> str:
        return f"{self.low}-{self.high}" if self.autoscaled else str(self.low)


def deployment_options(
    count: ReplicaCount, gpus: bool, replica_cpus: float = 1.0, rows: int = 1
) -> dict[str, Any]:
    """Serve's options for the replicas: `rows` requests at a time each (its Worker's batch),
    a GPU each on a GPU cluster, conversations routed home, and autoscaling on the requests
    in the system (running and queued in the front's router), `rows` per replica, for a
    range."""
    actor: dict[str, Any] = {"num_gpus": 1, "num_cpus": 1} if gpus else {"num_cpus": replica_cpus}
    options: dict[str, Any] = {
        "name": DEPLOYMENT,
        "ray_actor_options": actor,
        "max_ongoing_requests": rows,
        # A conversation's turns go back to the replica that holds its cache (ray_router.py).
        "request_router_config": {"request_router_class": ROUTER},
        "health_check_period_s": HEALTH_CHECK_S,
        "graceful_shutdown_wait_loop_s": 0.5,
        "graceful_shutdown_timeout_s": REPLICA_GRACE_S,
    }
    if count.autoscaled:
        options["autoscaling_config"] = {
            "min_replicas": count.low,
            "initial_replicas": count.low,
            "max_replicas": count.high,
            "target_ongoing_requests": rows,
            # A queue must last a few seconds before a replica (and its model load) is added,
            # and a minute of quiet before one is taken away.
            "upscale_delay_s": 5.0,
            "downscale_delay_s": 60.0,
        }
    else:
        options["num_replicas"] = count.low
    return options


# ---- the cluster --------------------------------------------------------------------------------


def connect(address: str, local_cpus: int) -> bool:
    """ray.init for ADDRESS; True when it started a local cluster (which closing stops)."""
    quiet = {"logging_level": logging.WARNING}
    if address == "local":
        # A cluster for this machine only: bounded CPUs (the replicas' reservations), no
        # dashboard, a small object store. Its GPUs Ray finds itself.
        ray.init(
            address="local",
            num_cpus=local_cpus,
            include_dashboard=False,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            **quiet,
        )
        return True
    if address != "auto" and ":" not in address:
        raise ConfigError(
            f"--ray takes local, auto, ray://HOST:PORT (Ray Client) or the HOST:PORT of the "
            f"cluster's head; got {address!r}."
        )
    try:
        ray.init(address=address, **quiet)
    except ConnectionError as e:
        raise ChatcliError(
            f"No Ray cluster found at {address} ({e}). Start one with `ray start --head` "
            "(and `ray start --address HEAD:6379` on the other machines), set RAY_ADDRESS, "
            "or serve on a cluster of this machine alone with --ray local. A cluster that "
            "asks for a token (Ray's default) also needs RAY_AUTH_MODE=token here, with its "
            "token in ~/.ray/auth_token or RAY_AUTH_TOKEN."
        ) from None
    return False


def cluster_gpus() -> int:
    return int(ray.cluster_resources().get("GPU", 0))


def _gpus_here(device: str) -> int:
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


def replica_device(device: str, gpus: int) -> str:
    """The device each replica loads its model on, from --device and the cluster's GPUs."""
    if device in ("auto", "cuda") or device.startswith("cuda:"):
        if gpus:
            return "cuda"  # each replica sees only the GPU Ray gave it
        if device != "auto":
            raise ConfigError(
                f"--device {device}: the Ray cluster has no GPUs. Use --device cpu, or add "
                "machines with GPUs to the cluster."
            )
        return "cpu"
    if device == "cpu":
        return "cpu"
    raise ConfigError(f"--device {device} cannot be used with --ray: use auto, cuda or cpu.")


def deploy(spec: Any, count: ReplicaCount, gpus: bool, replica_cpus: float, app: str = APP) -> Any:
    """Deploy the replicas and wait until every one has loaded the model: its handle."""
    from chatcli.serve.ray_replica import ChatReplica

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # no INFO line for each step
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    # No Serve HTTP proxy: this process is the front, and Serve's would take port 8000.
    serve.start(proxy_location="Disabled", logging_config=quiet)
    if app in serve.status().applications:
        raise ChatcliError(
            f"A Serve application named {app!r} already runs on this Ray cluster: another "
            "`chatcli serve --ray` serves it. Stop that server first (or remove every "
            "Serve application with `serve shutdown -y`)."
        )
    deployment = serve.deployment(ChatReplica).options(
        **deployment_options(count, gpus, replica_cpus, spec.batch)
    )
    handle = serve.run(
        deployment.bind(spec),
        name=app,
        route_prefix=None,
        logging_config=quiet,
    )
    return handle


def disconnect(local: bool, app: str = APP) -> None:
    """Remove the deployment (a local cluster: stop Serve and the cluster), then leave."""

    def remove() -> None:
        # A local cluster goes as a whole, Serve with it: its graceful shutdown only waits
        # on replicas whose requests the front has already ended. Not when the connection
        # is gone: Serve would look for the cluster afresh.
        if not local and ray.is_initialized():
            serve.delete(app)

    bounded(remove, TEARDOWN_S, f"removing the Serve application {app!r}")
    bounded(ray.shutdown, TEARDOWN_S, "leaving the Ray cluster")


def bounded(work: Callable[[], Any], seconds: float, what: str) -> None:
    """Run `work`, waiting for it `seconds` at most: a cluster that stopped answering must
    not keep the process from exiting (Ray Client can wait for ever on a lost connection).
    Its failure is logged, not raised: this is the way out."""
    done = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except Exception as e:
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="chatcli-ray-teardown", daemon=True).start()
    if not done.wait(seconds):
        log.warning("%s: the cluster did not answer within %g s", what, seconds)
    elif failed:
        log.warning("%s failed: %s", what, failed[0])


# ---- serving ------------------------------------------------------------------------------------


class _Terminated(Exception):
    """SIGTERM, turned into an exception so the cluster is left cleanly before exiting."""


def serve_on_ray(
    address: str,
    model: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: ReplicaCount | None = None,
    device: str = "auto",
    limits: Limits = Limits(),
    *,
    cache_slots: int = 1,
    batch: int | None = None,
    replica_cpus: float = 1.0,
    source: str = "sft",
    step: int | None = None,
    dtype: str = "auto",
    quantize: str = "none",
    softcap: float | None = None,
    speculate: bool = False,
    model_name: str | None = None,
    log_level: str = "info",
    api_keys: Sequence[str] = (),
    on_listening: Callable[[], None] | None = None,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """`chatcli serve --ray ADDRESS`: serve.runner.serve's counterpart, its replicas on Ray.
    api_keys and on_listening as serve.runner.serve's: the same app checks the same keys;
    batch as serve's, each replica's Worker decoding that many requests together; speculate
    as serve's, each replica's requests drafting from their conversations.

    on_ready gets {"url", "model", "devices", "cpu_threads", "ray"}, "ray" holding the
    address, the replica count, where the front runs ("here", or "head" for a ray://
    address), and the start-up's seconds (cluster, deploy)."""
    from chatcli.engine.scheduler import default_rows
    from chatcli.serve.ray_replica import ReplicaSpec
    from chatcli.serve.runner import listen

    if replica_cpus <= 0:
        raise ConfigError(f"--replica-cpus must be above 0 (got {replica_cpus:g}).")
    remote = address.startswith("ray://")
    # Fail on a taken port before the cluster starts (a ray:// front listens on the head).
    sock = None if remote else listen(host, port)
    if on_listening is not None:
        on_listening()
    keys = tuple(api_keys)
    local = None
    terminated = False

    def on_term(signum: int, frame: Any) -> None:
        raise _Terminated()

    before = signal.signal(signal.SIGTERM, on_term)
    try:
        started = time.perf_counter()
        wanted = workers or ReplicaCount(1, 1)
        # A local cluster's CPUs: what its replicas reserve (a GPU replica reserves one).
        cpus = max(1, round(wanted.high * replica_cpus), wanted.high, _gpus_here(device))
        local = connect(address, local_cpus=cpus)
        # ray.init put its own SIGTERM handler in (it exits without removing anything).
        signal.signal(signal.SIGTERM, on_term)
        connected = time.perf_counter()
        gpus = cluster_gpus()
        dev = replica_device(device, gpus)
        count = (workers or ReplicaCount(gpus, gpus)) if dev == "cuda" else wanted
        rows = batch if batch is not None else default_rows(dev)
        spec = ReplicaSpec(
            model, source, step, dtype, quantize, softcap, cache_slots, dev, rows, speculate
        )
        handle = deploy(spec, count, dev == "cuda", replica_cpus)
        about = {
            "address": address,
            "local": local,
            "replicas": str(count),
            "front": "head" if remote else "here",
            "connect_s": round(connected - started, 2),
            "deploy_s": round(time.perf_counter() - connected, 2),
        }
        ready = _announcer(on_ready, about)
        if sock is None:
            _serve_from_the_head(host, port, limits, model_name, ready, keys)
        else:
            _serve_here(sock, handle, host, limits, model_name, log_level, ready, keys)
    except _Terminated:
        terminated = True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one clean exit, not two
        if sock is not None:
            sock.close()
        if local is not None:
            disconnect(local)
        signal.signal(signal.SIGTERM, before)
    if terminated:
        # Exit as a SIGTERM'd process does, as `chatcli serve` does after its shutdown.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


# on_ready's call: (url, the model's name, the replicas' count, their device, CPU threads)
Announce = Callable[[str, str, int, str, int | None], None]


def _announcer(
    on_ready: Callable[[dict[str, Any]], None] | None, about: dict[str, Any]
) -> Announce:
    def announce(url: str, name: str, replicas: int, device: str, threads: int | None) -> None:
        if on_ready is not None:
            devices = [device] * replicas
            info = {"url": url, "model": name, "devices": devices, "cpu_threads": threads}
            on_ready({**info, "ray": about})

    return announce


def _url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _serve_here(
    sock: Any,
    handle: Any,
    host: str,
    limits: Limits,
    model_name: str | None,
    log_level: str,
    ready: Announce,
    api_keys: tuple[str, ...] = (),
) -> None:
    """The app in this process, over the deployment's handle, until Ctrl-C or SIGTERM."""
    from chatcli.serve.app import create_app
    from chatcli.serve.guards import hosts_to_check
    from chatcli.serve.ray_backend import RayBackend
    from chatcli.serve.runner import run_app

    card = handle.card.remote().result()  # a replica's: the tokenizer, the context
    backend = RayBackend(handle, card, live_replicas)
    name = model_name or card.name
    app = create_app(backend, limits, name, allowed_hosts=hosts_to_check(host), api_keys=api_keys)
    url = _url(host, sock.getsockname()[1])
    ready(url, name, len(backend.describe()["workers"]), card.device, card.threads)
    run_app(app, sock, log_level)


def _serve_from_the_head(
    host: str,
    port: int,
    limits: Limits,
    model_name: str | None,
    ready: Announce,
    api_keys: tuple[str, ...] = (),
) -> None:
    """The app on the cluster's head node (a ray:// address), watched from here until
    Ctrl-C or SIGTERM; then stopped."""
    from chatcli.serve.ray_front import start_front

    try:
        front, where = start_front(APP, host, port, limits, model_name, api_keys)
    except ray.exceptions.RayActorError as e:
        raise ChatcliError(f"The server could not start on the cluster's head node: {e}") from e
    try:
        # On every address (0.0.0.0) the head's own address reaches it; else --host does.
        shown = where["node_ip"] if host in ("0.0.0.0", "::") else host
        url = _url(shown, where["port"])
        ready(url, where["model"], len(live_replicas()), where["device"], where["threads"])
        while True:
            time.sleep(WATCH_FRONT_S)
            try:
                ray.get(front.where.remote(), timeout=WATCH_FRONT_S)
            except (ray.exceptions.RayError, TimeoutError) as e:
                raise ChatcliError(f"The server on the cluster's head node stopped: {e}") from e
    finally:

        def stop() -> None:
            ray.get(front.stop.remote(), timeout=REPLICA_GRACE_S)
            ray.kill(front)

        bounded(stop, TEARDOWN_S, "stopping the server on the head node")
