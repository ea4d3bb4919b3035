"""Structured output through `chatcli serve --ray`: a request's response_format travels to a
Ray Serve replica of the embedded model (its Worker batching rows) and the reply follows the
schema there, beside a request without one. On a local Ray cluster of its own (~10 s)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# Only the fixture joins a cluster (see chatcli.serve.ray_cluster): set before Ray loads.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
pytest.importorskip("ray.serve", reason="needs the ray extra: pip install -e '.[ray]'")
pytest.importorskip("llguidance", reason="needs the structured extra: pip install -e '.[dev]'")
pytest.importorskip("jsonschema", reason="needs the dev extra: pip install -e '.[dev]'")

import httpx
import jsonschema
from ray import serve

from chatcli.serve.app import create_app
from chatcli.serve.ray_backend import RayBackend
from chatcli.serve.ray_cluster import ReplicaCount, connect, deploy, disconnect, live_replicas
from chatcli.serve.ray_replica import ReplicaSpec
from chatcli.serve.requests import Limits
from chatcli.serve.runner import BackgroundServer

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parent.parent
ORDER = {
    "type": "object",
    "properties": {
        "paid": {"type": "boolean"},
        "items": {"type": "array", "items": {"enum": ["tea", "cake"]}, "maxItems": 3},
        "table": {"type": "integer", "minimum": 1, "maximum": 20},
    },
    "required": ["paid", "items", "table"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), before]))
    connect("local", local_cpus=2)
    try:
        handle = deploy(
            ReplicaSpec(device="cpu", batch=4),
            ReplicaCount(1, 1),
            gpus=False,
            replica_cpus=1,
            app="shaped",
        )
        card = handle.card.remote().result()
        backend = RayBackend(handle, card, lambda: live_replicas("shaped"), refresh_every=0.2)
        running = BackgroundServer(create_app(backend, Limits(), card.name)).start()
        yield running
        running.stop()
        serve.delete("shaped")
    finally:
        disconnect(local=True)
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def test_a_replica_follows_each_requests_schema_beside_a_free_request(server):
    def ask(response_format: dict | None, seed: int) -> dict:
        body = {
            "messages": [{"role": "user", "content": "What will you have?"}],
            "temperature": 1.0,
            "max_tokens": 100,
            "seed": seed,
        }
        if response_format is not None:
            body["response_format"] = response_format
        url = f"{server.url}/v1/chat/completions"
        return httpx.post(url, json=body, timeout=120).json()["choices"][0]

    shaped = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(ask, [shaped, None, shaped], [1, 2, 3]))
    for choice in (replies[0], replies[2]):
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), ORDER)
    assert not replies[1]["message"]["content"].startswith("{")
