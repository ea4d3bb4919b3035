"""Logprobs and /v1/completions from `chatcli serve --ray`'s back end: a replica on a local
Ray cluster (its Worker batching 2 rows) gives what the same model gives in this process, the
logprobs crossing Ray beside their tokens, through the openai client."""

from __future__ import annotations

import os
import threading

import pytest

os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")  # only the fixture joins a cluster
pytest.importorskip("ray.serve", reason="needs the ray extra: pip install -e '.[ray]'")
openai = pytest.importorskip("openai", reason="needs the openai client (the dev extra)")

from ray import serve  # noqa: E402

from chatcli.chat.logprob_shapes import chat_logprobs  # noqa: E402
from chatcli.engine.cpu_plan import torch_threads  # noqa: E402
from chatcli.engine.logprobs import TokenLogprob  # noqa: E402
from chatcli.serve.app import create_app, deltas_of  # noqa: E402
from chatcli.serve.ray_backend import RayBackend  # noqa: E402
from chatcli.serve.ray_cluster import (  # noqa: E402
    ReplicaCount,
    connect,
    deploy,
    disconnect,
    live_replicas,
)
from chatcli.serve.ray_replica import ReplicaSpec  # noqa: E402
from chatcli.serve.replies import GenerationParams  # noqa: E402
from chatcli.serve.requests import Limits  # noqa: E402
from chatcli.serve.runner import BackgroundServer  # noqa: E402
from chatcli.serve.worker_pool import Worker  # noqa: E402

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def ray_server():
    connect("local", local_cpus=2)
    try:
        handle = deploy(
            ReplicaSpec(device="cpu", batch=2), ReplicaCount(1, 1), gpus=False, replica_cpus=1,
            app="logprobs",
        )  # fmt: skip
        card = handle.card.remote().result()
        backend = RayBackend(handle, card, lambda: live_replicas("logprobs"), refresh_every=0.2)
        server = BackgroundServer(create_app(backend, Limits(), card.name)).start()
        yield server
        server.stop()
        serve.delete("logprobs")
    finally:
        disconnect(local=True)


@pytest.fixture(scope="module")
def local():
    """The embedded model in this process, as a replica runs it (one thread)."""
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(None, device="cpu")
    return Worker(model, tokenizer), tokenizer


def _local_reply(local, prompt: list[int], params: GenerationParams) -> list:
    worker, _ = local
    events: list = []
    with torch_threads(1):
        worker.generate(prompt, params, events.extend, threading.Event())
    return events


def test_a_ray_replicas_logprobs_are_the_local_engines(ray_server, local):
    _, tokenizer = local
    client = openai.OpenAI(base_url=f"{ray_server.url}/v1", api_key="none", max_retries=0)
    got = client.chat.completions.create(
        model="x", messages=QUESTION, max_tokens=16, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    prompt = tokenizer.render_for_completion(QUESTION)
    events = _local_reply(local, prompt, GenerationParams(16, 0.0, None, None, 0, logprobs=2))
    want = chat_logprobs(tokenizer, (e for e in events if isinstance(e, TokenLogprob)))
    content = got.choices[0].logprobs.content
    assert [t.token for t in content] == [w["token"] for w in want]
    for t, w in zip(content, want, strict=True):
        assert t.logprob == pytest.approx(w["logprob"], abs=TOLERANCE)
        assert [a.token for a in t.top_logprobs] == [a["token"] for a in w["top_logprobs"]]
    streamed = client.chat.completions.create(
        model="x", messages=QUESTION, max_tokens=16, temperature=0, logprobs=True, stream=True
    )
    tokens = [
        t.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert tokens == [w["token"] for w in want]


def test_a_ray_replica_completes_raw_text_as_the_local_engine(ray_server, local):
    _, tokenizer = local
    client = openai.OpenAI(base_url=f"{ray_server.url}/v1", api_key="none", max_retries=0)
    text = "Once upon a time"
    got = client.completions.create(
        model="x", prompt=text, max_tokens=10, temperature=0, logprobs=1
    )
    prompt = tokenizer.encode(text, prepend=tokenizer.get_bos_token_id())
    events = _local_reply(local, prompt, GenerationParams(10, 0.0, None, None, 0))
    assert got.choices[0].text == "".join(d["content"] for d in deltas_of(events))
    assert len(got.choices[0].logprobs.token_logprobs) >= 1
