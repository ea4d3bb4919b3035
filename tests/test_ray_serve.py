"""`chatcli serve --ray`: the same app over a Ray Serve deployment, on a local Ray cluster.

One cluster serves the module (starting one takes ~10 s on 2 cores): two CPU replicas of the
embedded model, answered through the official openai client and compared with the engine's
own greedy replies; and two replicas of a slow scripted model, for what happens mid-reply (a
full queue, a client that leaves, a replica killed). Every server listens on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# Only the fixtures join a cluster (see chatcli.serve.ray_cluster): set before Ray loads.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
pytest.importorskip("ray.serve", reason="needs the ray extra: pip install -e '.[ray]'")
pytest.importorskip("openai", reason="needs the openai client (the dev extra)")

import httpx
import openai
import ray
from ray import serve
from serving import wait_until

from chatcli.engine.cpu_plan import torch_threads
from chatcli.serve.app import conversation_of, create_app, deltas_of
from chatcli.serve.ray_backend import RayBackend, short_name
from chatcli.serve.ray_cluster import (
    ReplicaCount,
    connect,
    deploy,
    deployment_options,
    disconnect,
    live_replicas,
)
from chatcli.serve.ray_replica import ReplicaSpec
from chatcli.serve.replies import GenerationParams
from chatcli.serve.requests import ChatMessage, Limits
from chatcli.serve.runner import BackgroundServer
from chatcli.serve.worker_pool import Worker

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
ROOT = TESTS.parent
CHATCLI = [sys.executable, "-m", "chatcli"]


# ---- SIGTERM (first: its own cluster, before the module's starts) -------------------------------


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found |= {child, *_descendants(child)}
    return found


def _first_line(proc: subprocess.Popen, timeout: float = 120) -> str:
    """The server's first line (where it listens), or a failure after `timeout` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the server said nothing for {timeout} s"
    return proc.stdout.readline()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")  # a zombie has exited


def test_sigterm_stops_the_app_and_the_local_cluster_and_leaves_no_ray_process(tmp_path):
    stderr = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen(
        [*CHATCLI, "serve", "--ray", "local", "--port", "0", "--workers", "1", "--device", "cpu"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    try:
        line = _first_line(proc)
        assert line.startswith("Serving chatcli-default on 1 cpu replica(s) on a local Ray cluster")
        url = line.split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        ray_processes = _descendants(proc.pid)
        assert len(ray_processes) >= 3  # at least the GCS, the raylet and the replica
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        )
        assert reply.status_code == 200
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # As `chatcli serve` does: shut down cleanly, then exit as SIGTERM'd processes do.
        assert proc.wait(timeout=60) == -signal.SIGTERM
        assert time.monotonic() - signalled < 30
        assert wait_until(lambda: not any(map(_alive, ray_processes)), timeout=15)
    finally:
        proc.kill()
        proc.wait()
    stderr.seek(0)
    assert "Traceback" not in stderr.read()


# ---- the module's cluster -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    # The slow replicas load tests/ray_replicas.py: the cluster's workers inherit this path.
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), str(ROOT), before]))
    try:
        # 2 embedded replicas, 2 slow ones, 2 autoscaled and the ray:// test's one, a CPU
        # each in Ray's books (the 2 cores are shared: the scripted ones mostly sleep).
        connect("local", local_cpus=7)
        yield
    finally:
        disconnect(local=True)
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _front(app: str, spec: ReplicaSpec, limits: Limits, **kwargs):
    handle = deploy(spec, ReplicaCount(2, 2), gpus=False, replica_cpus=1, app=app)
    card = handle.card.remote().result()
    backend = RayBackend(handle, card, lambda: live_replicas(app), refresh_every=0.2)
    return BackgroundServer(create_app(backend, limits, card.name, **kwargs)).start(), backend


@pytest.fixture(scope="module")
def embedded(cluster):
    # Each replica's Worker decodes 4 requests together, drafting from the conversation
    # (`chatcli serve --ray`'s default --speculate auto): the replies must still be the
    # engine's, one request at a time without drafts (`reference`).
    spec = ReplicaSpec(device="cpu", batch=4, speculate=True)
    server, backend = _front("embedded", spec, Limits())
    yield server, backend
    server.stop()
    serve.delete("embedded")


@pytest.fixture(scope="module")
def slow(cluster):
    from ray_replicas import SlowScriptedSpec

    server, backend = _front(
        "slow", SlowScriptedSpec(device="cpu"), Limits(max_queue=1), waiting_every=0.05
    )
    yield server, backend
    server.stop()
    serve.delete("slow")


@pytest.fixture(scope="module")
def reference():
    """The embedded model in this process: the replies the replicas must give."""
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(None, device="cpu")
    worker = Worker(model, tokenizer)

    def greedy(messages: list[dict], max_tokens: int) -> str:
        chat = [ChatMessage.model_validate(m) for m in messages]
        prompt = tokenizer.render_for_completion(conversation_of(chat))
        events: list = []
        params = GenerationParams(max_tokens, 0.0, None, None, seed=0)
        with torch_threads(1):  # as the replicas run it (cpu_plan)
            worker.generate(prompt, params, events.extend, threading.Event())
        return "".join(d["content"] for d in deltas_of(events))

    return greedy


def _client(server: BackgroundServer) -> openai.OpenAI:
    return _client_at(server.url)


# ---- replies ------------------------------------------------------------------------------------


def test_the_openai_client_gets_the_engines_greedy_reply_whole_and_streamed(embedded, reference):
    server, _ = embedded
    client = _client(server)
    messages = [{"role": "user", "content": "What is 12*34?"}]
    expected = reference(messages, 24)
    whole = client.chat.completions.create(
        model="chatcli-default", messages=messages, max_tokens=24, temperature=0
    )
    assert whole.model == "chatcli-default"
    assert whole.choices[0].message.content == expected
    assert whole.usage.completion_tokens <= 24
    streamed = list(
        client.chat.completions.create(
            model="chatcli-default", messages=messages, max_tokens=24, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert streamed[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_replica_drafts_a_reply_that_copies_the_prompt_and_gives_the_plain_reply(
    embedded, reference
):
    server, _ = embedded
    before = httpx.get(f"{server.url}/stats", timeout=10).json()["drafts_accepted"]
    messages = [{"role": "user", "content": "Repeat after me: 4821, 7730, 1299, 3356, 4821, 7730."}]
    reply = _client(server).chat.completions.create(
        model="chatcli-default", messages=messages, max_tokens=40, temperature=0
    )
    assert reply.choices[0].message.content == reference(messages, 40)
    assert "4821" in reply.choices[0].message.content
    after = httpx.get(f"{server.url}/stats", timeout=10).json()["drafts_accepted"]
    assert after > before


def test_32_concurrent_streaming_clients_each_get_their_own_right_reply(embedded, reference):
    server, backend = embedded
    questions = [
        [{"role": "user", "content": f"What is {i}*{i + 7}? Then count the letters in 'r{i}'."}]
        for i in range(32)
    ]
    expected = [reference(q, 32) for q in questions]
    served_before = backend.totals["requests_served"]

    async def ask(client: openai.AsyncOpenAI, messages: list[dict]) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model="chatcli-default", messages=messages, max_tokens=32, temperature=0, stream=True
        )
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def everyone() -> list[tuple[str, str | None]]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        async with client:
            return await asyncio.gather(*(ask(client, q) for q in questions))

    answers = asyncio.run(everyone())
    assert [text for text, _ in answers] == expected
    assert all(reason in ("stop", "length") for _, reason in answers)
    assert backend.totals["requests_served"] - served_before == 32
    # Both replicas took a share.
    rows = backend.describe()["workers"]
    assert len(rows) == 2 and all(r["requests_served"] > 0 for r in rows)


def test_a_conversations_second_turn_goes_to_the_replica_that_holds_its_cache(embedded):
    server, _ = embedded
    client = _client(server)
    for topic in ("apples", "the moon", "binary numbers"):
        first = [{"role": "user", "content": f"Tell me one thing about {topic}."}]
        one = client.chat.completions.create(
            model="chatcli-default", messages=first, max_tokens=16, temperature=0
        )
        second = [
            *first,
            {"role": "assistant", "content": one.choices[0].message.content},
            {"role": "user", "content": "And another?"},
        ]
        two = client.chat.completions.create(
            model="chatcli-default", messages=second, max_tokens=8, temperature=0
        )
        # At least the whole first prompt came from the cache (the reply's text may
        # tokenize differently from the tokens the model made, so no more is promised).
        assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens


def test_health_stats_and_models_describe_the_replicas(embedded):
    server, backend = embedded
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health == {"status": "ok", "model": "chatcli-default", "workers": 2, "idle": 2}
    stats = httpx.get(f"{server.url}/stats", timeout=10).json()
    assert stats["backend"] == "ray" and stats["queue_length"] == 0
    assert stats["rows"] == 8 and stats["rows_in_use"] == 0  # 2 replicas of batch 4
    actors = live_replicas("embedded")
    assert [w["actor"] for w in stats["workers"]] == actors
    assert [w["name"] for w in stats["workers"]] == [short_name(a) for a in actors]
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["chatcli-default"]
    assert models["data"][0]["context_length"] == backend.context_len == 1280


def test_the_deployment_is_fixed_or_autoscaled_on_queued_requests():
    fixed = deployment_options(ReplicaCount(3, 3), gpus=False, replica_cpus=2)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 2}
    assert fixed["max_ongoing_requests"] == 1  # a Worker of batch 1 runs one at a time
    router = fixed["request_router_config"]["request_router_class"]
    assert router == "chatcli.serve.ray_router.ConversationRouter"
    ranged = deployment_options(ReplicaCount(1, 4), gpus=True)
    assert "num_replicas" not in ranged
    scaling = ranged["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 4)
    assert scaling["target_ongoing_requests"] == 1  # a replica for each request in the system
    assert ranged["ray_actor_options"] == {"num_gpus": 1, "num_cpus": 1}
    batched = deployment_options(ReplicaCount(1, 4), gpus=False, rows=8)
    assert batched["max_ongoing_requests"] == 8  # a Worker of batch 8: its rows at once
    assert batched["autoscaling_config"]["target_ongoing_requests"] == 8


def test_describe_from_another_thread_loses_no_count_the_loop_makes_meanwhile():
    # Tests and scripts read describe() off the event loop while the loop counts requests in and
    # out. Here the loop's change lands in the middle of a describe(): it must survive it (a
    # describe that rebuilt its dicts once dropped such a change, and a replica that had lost an
    # increment then read idle while it streamed, which failed the next test on a loaded host).
    class LiveReplicas(list):
        """The live replicas, which let the loop accept a request on first being read."""

        def __init__(self, names: list[str], on_read) -> None:
            super().__init__(names)
            self.on_read = on_read

        def _read(self) -> None:
            on_read, self.on_read = self.on_read, None
            if on_read is not None:
                on_read()

        def __iter__(self):
            self._read()
            return super().__iter__()

        def __contains__(self, name: object) -> bool:
            self._read()
            return super().__contains__(name)

    class Card:
        rows = 1

    backend = RayBackend(None, Card(), lambda: [], refresh_every=3600)
    backend._busy = {"a": 0, "b": 0}  # both have served before, and are idle

    def accept_on_a() -> None:
        backend.waiting += 1
        backend._accepted("a", {"device": "cpu"})

    backend._live = LiveReplicas(["a", "b"], accept_on_a)
    backend.describe()
    rows = {w["actor"]: w for w in backend.describe()["workers"]}
    assert rows["a"]["busy"] and rows["a"]["rows_in_use"] == 1
    assert not rows["b"]["busy"]
    backend._ended("a", None, lost=False)  # the client left
    state = backend.describe()
    assert (state["busy"], state["rows_in_use"], state["requests_interrupted"]) == (0, 0, 1)


# ---- mid-reply: queues, clients that leave, replicas that die -----------------------------------

LONG = {"messages": [{"role": "user", "content": "go"}], "stream": True}


def _events(lines) -> list[dict | str]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_every_replica_busy_and_the_queue_full_is_a_429_and_the_queued_stream_waits(slow):
    server, backend = slow
    url = f"{server.url}/v1/chat/completions"
    with (
        httpx.stream("POST", url, json={**LONG, "max_tokens": 400, "seed": 1}, timeout=30) as a,
        httpx.stream("POST", url, json={**LONG, "max_tokens": 400, "seed": 2}, timeout=30) as b,
    ):
        assert wait_until(lambda: backend.describe()["busy"] == 2, timeout=10)
        with httpx.stream(
            "POST", url, json={**LONG, "max_tokens": 4, "seed": 3}, timeout=30
        ) as queued:
            lines = queued.iter_lines()
            assert next(lines).startswith('data: {"id"')
            assert next(line for line in lines if line) == ": waiting for a worker"
            full = httpx.post(url, json={**LONG, "stream": False}, timeout=10)
            assert full.status_code == 429
            assert full.headers["retry-after"] == "5"
            assert full.json()["error"]["code"] == "queue_full"
        assert a.status_code == b.status_code == 200
    assert wait_until(lambda: backend.describe()["busy"] == 0, timeout=10)


def test_a_client_that_leaves_stops_its_generation_on_the_replica(slow):
    server, backend = slow
    url = f"{server.url}/v1/chat/completions"

    def row(actor: str) -> dict:
        (found,) = [w for w in backend.describe()["workers"] if w["actor"] == actor]
        return found

    def first_token(lines) -> None:
        next(line for line in lines if '"content": "' in line and '"role"' not in line)

    # Each stream's line iterator is held (a local) until its client is meant to leave: one
    # dropped mid-body is closed whenever the garbage collector gets to it, which closes
    # the connection (httpcore), so the server saw that client leave at a random moment.

    endless = {**LONG, "max_tokens": 4000}  # 80 s each
    with httpx.stream("POST", url, json={**endless, "seed": 1}, timeout=30) as leaving:
        leaving_lines = leaving.iter_lines()
        first_token(leaving_lines)

        def busy() -> list[str]:
            return [w["actor"] for w in backend.describe()["workers"] if w["busy"]]

        # The replica's Accepted comes before its first token, so the front counts it busy by
        # the time the client reads one.
        assert len(busy()) == 1, backend.describe()
        (replica,) = busy()
        before = row(replica)["requests_interrupted"]
        # The other replica stays busy, so the next request can only go to this one.
        with httpx.stream("POST", url, json={**endless, "seed": 2}, timeout=30) as staying:
            staying_lines = staying.iter_lines()
            first_token(staying_lines)
            leaving.close()
            left = time.monotonic()
            short = {**LONG, "stream": False, "max_tokens": 2}
            assert httpx.post(url, json=short, timeout=30).status_code == 200
            took = time.monotonic() - left
            # (A replica's row is as of its last report: it may count the interruption a
            # moment late, or an earlier one with it, so at least one more, waited for.)
            assert wait_until(lambda: row(replica)["requests_interrupted"] > before, timeout=10)
    # The replica took the request at once: the 80 s generation had stopped.
    assert took < 10


def test_a_range_of_replicas_grows_while_requests_queue(cluster):
    from ray_replicas import SlowScriptedSpec

    deploy(SlowScriptedSpec(device="cpu"), ReplicaCount(1, 2), False, 1, app="scaling")
    try:
        handle = serve.get_app_handle("scaling")
        card = handle.card.remote().result()
        backend = RayBackend(handle, card, lambda: live_replicas("scaling"), refresh_every=0.2)
        assert len(backend.describe()["workers"]) == 1
        with BackgroundServer(create_app(backend, Limits(), card.name)) as server:
            url = f"{server.url}/v1/chat/completions"
            body = {**LONG, "max_tokens": 2000}  # 40 s each: they queue until stopped
            with (
                httpx.stream("POST", url, json={**body, "seed": 1}, timeout=60),
                httpx.stream("POST", url, json={**body, "seed": 2}, timeout=60),
                httpx.stream("POST", url, json={**body, "seed": 3}, timeout=60),
            ):
                # Serve adds a replica once requests have queued for upscale_delay_s (5 s).
                grown = wait_until(lambda: len(backend.describe()["workers"]) == 2, 45, 0.5)
                assert grown
                assert wait_until(lambda: backend.describe()["busy"] == 2, timeout=30)
    finally:
        serve.delete("scaling")


def test_a_killed_replica_loses_only_its_own_stream_and_ray_replaces_it(slow):
    server, backend = slow
    url = f"{server.url}/v1/chat/completions"
    bodies: dict[int, list[str]] = {}

    def stream(seed: int) -> None:
        body = {**LONG, "messages": [{"role": "user", "content": f"s{seed}"}], "seed": seed}
        with httpx.stream("POST", url, json={**body, "max_tokens": 100}, timeout=60) as r:
            bodies[seed] = list(r.iter_lines())

    # Two run (one on each replica), one queued (the queue holds one).
    clients = [threading.Thread(target=stream, args=(seed,)) for seed in range(3)]
    for c in clients:
        c.start()
        time.sleep(0.2)
    assert wait_until(lambda: backend.describe()["busy"] == 2 and backend.waiting == 1)
    victim = backend.describe()["workers"][0]["actor"]
    ray.kill(ray.get_actor(victim, namespace="serve"))
    killed = time.monotonic()
    for c in clients:
        c.join(timeout=60)
    events = {seed: _events(lines) for seed, lines in bodies.items()}
    assert all(e[-1] == "[DONE]" for e in events.values())
    errors = [e[-2]["error"] for e in events.values() if "error" in e[-2]]
    assert len(errors) == 1  # the killed replica's stream, and only it
    assert errors[0]["type"] == "server_error"
    lost = f"Generation failed: The replica {short_name(victim)} running this request stopped"
    assert errors[0]["message"].startswith(lost)
    finished = [e[-2] for e in events.values() if "error" not in e[-2]]
    assert [f["usage"]["completion_tokens"] for f in finished] == [100, 100]
    assert backend.totals["requests_lost"] == 1
    # The server answers at once on the live replica, and Ray starts a new one.
    short = {**LONG, "stream": False, "max_tokens": 2}
    assert httpx.post(url, json=short, timeout=30).status_code == 200
    assert time.monotonic() - killed < 15

    def replaced() -> bool:
        actors = [w["actor"] for w in backend.describe()["workers"]]
        return len(actors) == 2 and victim not in actors

    assert wait_until(replaced, timeout=60, interval=0.5)


# ---- Ray Client (ray://): the front on the head node --------------------------------------------


def test_a_ray_client_address_serves_from_the_head_node_and_removes_it_all_on_sigterm(cluster):
    # A Ray Client server on this module's cluster, as `ray start --head` runs one (port 10001).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_AUTH_MODE": "token"}  # the local cluster's token is in ~/.ray
    gcs = ray.get_runtime_context().gcs_address
    server = ["-m", "ray.util.client.server", "--host=127.0.0.1", f"--port={port}"]
    gateway = subprocess.Popen(
        [sys.executable, *server, f"--address={gcs}", "--mode=legacy"], env=env
    )
    proc = None
    try:
        address = f"ray://127.0.0.1:{port}"
        one_cpu_replica = ["--port", "0", "--workers", "1", "--device", "cpu"]
        proc = subprocess.Popen(
            [*CHATCLI, "serve", "--ray", address, *one_cpu_replica],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = _first_line(proc)
        assert line.startswith(f"Serving chatcli-default on 1 cpu replica(s) on Ray at {address}")
        assert ", from the head node at http://127.0.0.1:" in line
        url = line.split(" head node at ")[1].split()[0]
        assert httpx.get(f"{url}/health", timeout=10).json()["workers"] == 1
        reply = _client_at(url).chat.completions.create(
            model="chatcli-default", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.usage.completion_tokens <= 4
        assert "chatcli" in serve.status().applications
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
        # The app and the front are gone; the cluster is not the server's to stop.
        assert "chatcli" not in serve.status().applications
        assert not [a for a in ray.util.list_named_actors(True) if "chatcli-front" in a["name"]]
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        for p in (proc, gateway):
            if p is not None:
                p.kill()
                p.wait()


def _client_at(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
