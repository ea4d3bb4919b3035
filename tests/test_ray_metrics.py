"""`chatcli serve --ray`'s /metrics: the front counts every request its replicas ran, so the
cluster's figures add up there. A local Ray cluster, two CPU replicas of the embedded model
of four rows each, concurrent clients; every server listens on 127.0.0.1.
"""

from __future__ import annotations

import os
import threading

import pytest

# Only the fixture joins a cluster (see chatcli.serve.ray_cluster): set before Ray loads.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
pytest.importorskip("ray.serve", reason="needs the ray extra: pip install -e '.[ray]'")
pytest.importorskip("prometheus_client", reason="needs the serve extra: pip install -e '.[serve]'")

import httpx
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from chatcli.serve.app import create_app
from chatcli.serve.ray_backend import RayBackend
from chatcli.serve.ray_cluster import ReplicaCount, connect, deploy, disconnect, live_replicas
from chatcli.serve.ray_replica import ReplicaSpec
from chatcli.serve.runner import BackgroundServer

pytestmark = pytest.mark.slow
APP = "metrics"


@pytest.fixture(scope="module")
def front():
    connect("local", local_cpus=3)
    try:
        handle = deploy(
            ReplicaSpec(device="cpu", batch=4),
            ReplicaCount(2, 2),
            gpus=False,
            replica_cpus=1,
            app=APP,
        )
        card = handle.card.remote().result()
        backend = RayBackend(handle, card, lambda: live_replicas(APP), refresh_every=0.2)
        with BackgroundServer(create_app(backend, model_name=card.name)) as server:
            yield server, card.name
        serve.delete(APP)
    finally:
        disconnect(local=True)


def scrape(server: BackgroundServer, model: str) -> dict[str, float]:
    """Each unlabelled-but-for-the-model sample and each finished_reason's count."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels["model_name"] == model
            key = s.name + (
                f"/{s.labels['finished_reason']}" if "finished_reason" in s.labels else ""
            )
            if "le" not in s.labels:
                out[key] = s.value
    return out


def test_the_replicas_figures_add_up_at_the_front(front):
    server, model = front
    results: list = []

    def ask(i: int) -> None:
        body = {
            "messages": [{"role": "user", "content": f"Please add {i} and {i * 7}, then explain."}],
            "max_tokens": 6 + 4 * i,
            "temperature": 1.0,
            "seed": i,
        }
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        results.append((r.json()["usage"], r.json()["choices"][0]["finish_reason"]))

    clients = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    assert len(results) == 8
    stats = httpx.get(f"{server.url}/stats", timeout=10).json()
    # Each replica's own counts (its last report) add up to the front's.
    assert sum(w["requests_served"] for w in stats["workers"]) == 8, stats
    replicas_tokens = sum(w["tokens_served"] for w in stats["workers"])
    got = scrape(server, model)
    usages = [u for u, _ in results]
    assert got["chatcli:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert got["chatcli:generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
    assert got["chatcli:generation_tokens_total"] == replicas_tokens == stats["tokens_served"]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert got["chatcli:prefix_cache_hits_total"] == cached
    for reason in ("stop", "length"):
        count = sum(r == reason for _, r in results)
        assert got.get(f"chatcli:request_success_total/{reason}", 0) == count
    assert got["chatcli:time_to_first_token_seconds_count"] == 8
    gaps = sum(u["completion_tokens"] - 1 for u in usages)
    assert got["chatcli:inter_token_latency_seconds_count"] == gaps
    assert got["chatcli:time_to_first_token_seconds_sum"] > 0  # the replicas' timings came over
    # The gauges are the front's /stats: the two replicas' eight rows, none in use now.
    assert got["chatcli:num_requests_running"] == 0 == got["chatcli:kv_cache_usage_perc"]
    assert got["chatcli:num_requests_waiting"] == 0
