"""The front on the cluster, for a Ray Client address (`--ray ray://HOST:PORT`).

Owns RemoteFront: a Ray actor, placed on the cluster's head node, that serves the same HTTP
app as `chatcli serve` over a RayBackend of the deployment, and start_front, which places it
and says where it listens. Ray Client cannot carry Serve's streamed responses back to a
process outside the cluster, so with a ray:// address the front runs inside the cluster
instead of in the `chatcli serve` process, which only deploys, waits and removes.

Knows nothing of deploying: ray_cluster.py deploys first, then starts this.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from chatcli.serve.app import create_app
from chatcli.serve.guards import hosts_to_check
from chatcli.serve.ray_backend import RayBackend
from chatcli.serve.ray_names import live_replicas
from chatcli.serve.requests import Limits
from chatcli.serve.runner import BackgroundServer

HEAD = "node:__internal_head__"  # the resource only Ray's head node has


class RemoteFront:
    """The app on a loopback or network port of the node it runs on (--host, --port)."""

    def __init__(
        self,
        app: str,
        host: str,
        port: int,
        limits: Limits,
        model_name: str | None,
        api_keys: tuple[str, ...] = (),
    ) -> None:
        from ray import serve

        handle = serve.get_app_handle(app)
        card = handle.card.remote().result()
        backend = RayBackend(handle, card, lambda: live_replicas(app))
        self.model = model_name or card.name
        self.card = card
        web = create_app(
            backend, limits, self.model, allowed_hosts=hosts_to_check(host), api_keys=api_keys
        )
        self.server = BackgroundServer(web, host, port).start()

    def where(self) -> dict[str, Any]:
        """Where it listens, with what the CLI says on start."""
        return {
            "node_ip": ray.util.get_node_ip_address(),
            "port": self.server.port,
            "model": self.model,
            "device": self.card.device,
            "threads": self.card.threads,
        }

    def stop(self) -> None:
        self.server.stop()


def start_front(
    app: str,
    host: str,
    port: int,
    limits: Limits,
    model_name: str | None,
    api_keys: tuple[str, ...] = (),
) -> tuple[Any, dict[str, Any]]:
    """RemoteFront on the head node, started: (its actor, where())."""
    heads = [n["NodeID"] for n in ray.nodes() if n["Alive"] and HEAD in n["Resources"]]
    placement = NodeAffinitySchedulingStrategy(heads[0], soft=True) if heads else "DEFAULT"
    actor = (
        ray.remote(RemoteFront)
        .options(num_cpus=0, scheduling_strategy=placement, name=f"chatcli-front-{app}")
        .remote(app, host, port, limits, model_name, api_keys)
    )
    return actor, ray.get(actor.where.remote())
