"""A real scraper: Debian's `prometheus` scrapes `chatcli serve --api-key KEY` on 127.0.0.1 every
second with the key as its bearer token, and the counters read back through Prometheus' HTTP
API are the tokens the clients were sent and received. A second job without the key is
refused (the target is down for it). Skipped where the binary is not installed (CI installs it
with apt, as it does chromium).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time

import pytest

pytest.importorskip("prometheus_client", reason="needs the serve extra: pip install -e '.[serve]'")
import httpx

from chatcli.engine.scheduler import default_rows
from chatcli.serve.app import Worker, create_app
from chatcli.serve.guards import hosts_to_check
from chatcli.serve.runner import BackgroundServer

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None, reason="needs Debian's prometheus binary: apt-get install prometheus"
    ),
]
KEY = "scrape-key-0123456789"
MODEL = "chatcli-embedded"
CONFIG = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: chatcli
    authorization:
      type: Bearer
      credentials_file: {key_file}
    static_configs:
      - targets: ["{target}"]
  - job_name: nokey
    static_configs:
      - targets: ["{target}"]
"""


def free_port() -> int:
    # prometheus takes no port 0: ask the kernel for a free one and hand it over.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prometheus(tmp_path):
    """Start prometheus scraping `target` (a callable, so the server is up first)."""
    procs = []

    def start(target: str) -> str:
        key_file = tmp_path / "key"
        key_file.write_text(KEY)
        config = tmp_path / "prometheus.yml"
        config.write_text(CONFIG.format(key_file=key_file, target=target))
        url = f"127.0.0.1:{free_port()}"
        log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address={url}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append((proc, log))
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                if httpx.get(f"http://{url}/-/ready", timeout=2).status_code == 200:
                    return f"http://{url}"
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "prometheus was not ready within 30 s"
            time.sleep(0.2)

    yield start
    for proc, log in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(prometheus: str, promql: str) -> dict[str, float]:
    """An instant query's result: each series' job (or finished_reason) -> its value."""
    r = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    out = {}
    for series in r.json()["data"]["result"]:
        labels = series["metric"]
        out[labels.get("finished_reason") or labels.get("job", "")] = float(series["value"][1])
    return out


def eventually(prometheus: str, promql: str, expected: dict, timeout: float = 45) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got = query(prometheus, promql)
        if got == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_prometheus_scrapes_the_servers_token_counts_with_its_key(prometheus):
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(None, device="cpu")
    app = create_app(
        [Worker(model, tokenizer, batch=default_rows("cpu"))],
        model_name=MODEL,
        allowed_hosts=hosts_to_check("127.0.0.1"),
        api_keys=[KEY],
    )
    with BackgroundServer(app) as server:
        promql_url = prometheus(server.url.removeprefix("http://"))
        assert eventually(promql_url, "up", {"chatcli": 1.0, "nokey": 0.0}) == {
            "chatcli": 1.0,
            "nokey": 0.0,
        }

        usages: list[dict] = []

        def ask(i: int) -> None:
            body = {
                "messages": [{"role": "user", "content": f"What is {i}+{i}? " * 12}],
                "max_tokens": 5 + 5 * i,
                "temperature": 1.0,
                "seed": i,
            }
            r = httpx.post(
                f"{server.url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])

        clients = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        assert len(usages) == 4

        selector = f'{{job="chatcli",model_name="{MODEL}"}}'
        for metric, expected in (
            ("generation_tokens_total", sum(u["completion_tokens"] for u in usages)),
            ("prompt_tokens_total", sum(u["prompt_tokens"] for u in usages)),
        ):
            promql = f"chatcli:{metric}{selector}"
            assert eventually(promql_url, promql, {"chatcli": expected}) == {"chatcli": expected}
        requests = query(promql_url, f"sum(chatcli:request_success_total{selector})")
        assert requests == {"": 4.0}
        ttft = query(promql_url, f"chatcli:time_to_first_token_seconds_count{selector}")
        assert ttft == {"chatcli": 4.0}
