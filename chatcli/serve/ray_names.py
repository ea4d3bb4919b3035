"""What the deployment's parts are called on a Ray cluster, and its live replicas by name.

Owns: the Serve application's and deployment's names, and live_replicas (the actor names of
the deployment's replicas that are alive): what ray_cluster.py deploys under, and what the
front (ray_backend.py, ray_front.py) counts. Knows nothing of deploying or serving.
"""

from __future__ import annotations

import ray

APP = "chatcli"  # the Serve application's name on the cluster
DEPLOYMENT = "ChatReplica"


def live_replicas(app: str = APP) -> list[str]:
    """The actor names of the deployment's live replicas. Serve names a replica's actor
    SERVE_REPLICA::APP#DEPLOYMENT#ID in the "serve" namespace (it offers no public list)."""
    prefix = f"SERVE_REPLICA::{app}#{DEPLOYMENT}#"
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"] for a in named if a["namespace"] == "serve" and a["name"].startswith(prefix)
    )
