"""A bounded load test of `chatcli serve` over loopback: concurrent streaming clients, a fixed
number of requests, then success count, time to first token and throughput.

    python scripts/load_test.py                       # starts a server on the embedded model
    python scripts/load_test.py --model PATH --workers 2
    python scripts/load_test.py --ray local --workers 2   # its replicas on a local Ray cluster
    python scripts/load_test.py --url http://127.0.0.1:8000 --json

A server it starts (`chatcli serve`, with --ray when asked) is timed from launch to its first
healthy answer, and its memory is the RSS of its whole process tree (for Ray: the cluster's
processes too), the most seen while the load ran.

Only loopback servers are accepted, and clients and requests are capped: this is a benchmark for
your own machine, not a traffic generator. Needs the serve extra (httpx).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

MAX_CLIENTS = 256
MAX_REQUESTS = 10_000
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PROMPTS = [
    "What is 1234*56?",
    "Tell me a short story about a robot.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "How many r are there in strawberry?",
    "Give me three tips for learning to code.",
]


@dataclass
class Result:
    ok: bool
    ttft_s: float | None = None
    total_s: float = 0.0
    completion_tokens: int = 0
    error: str = ""


@dataclass
class Totals:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))  # ceil without floats
    return ordered[int(rank) - 1]


async def one_request(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> Result:
    body = {
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": i,
    }
    t0 = time.perf_counter()
    result = Result(ok=False)
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            finished = done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                choice = (chunk.get("choices") or [{}])[0]
                if result.ttft_s is None and choice.get("delta", {}).get("content"):
                    result.ttft_s = time.perf_counter() - t0
                if choice.get("finish_reason"):
                    finished = True
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
            result.ok = finished and done
            if not result.ok:
                result.error = "the stream ended without finish_reason and [DONE]"
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.total_s = time.perf_counter() - t0
    return result


async def run_load(url: str, clients: int, requests: int, max_tokens: int) -> Totals:
    totals = Totals()
    counter = iter(range(requests))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def client_loop() -> None:
            # Each client sends its next request as soon as the last one is answered.
            for i in counter:
                totals.results.append(await one_request(client, url, i, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(clients)))
        totals.wall_s = time.perf_counter() - t0
    return totals


def summarize(totals: Totals, url: str, clients: int, server_stats: dict | None) -> dict:
    ok = [r for r in totals.results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tokens = sum(r.completion_tokens for r in ok)
    failures = [r.error for r in totals.results if not r.ok]

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {
        "url": url,
        "clients": clients,
        "requests": len(totals.results),
        "succeeded": len(ok),
        "failed": len(failures),
        "failures": failures[:5],
        "wall_s": round(totals.wall_s, 3),
        "ttft_p50_s": rounded(percentile(ttfts, 50)),
        "ttft_p99_s": rounded(percentile(ttfts, 99)),
        "latency_p50_s": rounded(percentile([r.total_s for r in ok], 50)),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / totals.wall_s, 1) if totals.wall_s else None,
        "requests_per_s": round(len(ok) / totals.wall_s, 2) if totals.wall_s else None,
        "mean_tokens_per_request": round(statistics.mean([r.completion_tokens for r in ok]), 1)
        if ok
        else None,
        "server": server_stats,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, float]:
    """`chatcli serve` on a free loopback port: (process, url, seconds until healthy)."""
    port = free_port()
    command = [sys.executable, "-m", "chatcli", "serve", "--port", str(port)]
    command += ["--device", args.device, "--max-queue", str(MAX_REQUESTS)]
    if args.model:
        command += ["--model", args.model]
    if args.workers:
        command += ["--workers", args.workers]
    if args.ray:
        command += ["--ray", args.ray]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("the server did not come up within 300 s")


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (Linux's /proc; [] elsewhere)."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            found += process_tree(int(child))
    return found


def tree_rss_mib(pid: int) -> tuple[int, float]:
    """(processes, their summed resident memory in MiB) for `pid`'s tree."""
    pids, kib = process_tree(pid), 0
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        kib += next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0
        )
    return len(pids), kib / 1024


class MemoryWatch:
    """The most memory a process tree held, sampled every `every` seconds in a thread."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        self.pid, self.every = pid, every
        self.processes, self.peak_mib = tree_rss_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            processes, mib = tree_rss_mib(self.pid)
            if mib > self.peak_mib:
                self.processes, self.peak_mib = processes, mib

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"processes": self.processes, "peak_rss_mib": round(self.peak_mib, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="target a running loopback server instead of starting one")
    parser.add_argument("--model", help="checkpoint for the started server (default: embedded)")
    parser.add_argument(
        "--workers", help="replicas of the started server: N, or MIN-MAX with --ray"
    )
    parser.add_argument("--ray", metavar="ADDRESS", help="start the server with --ray ADDRESS")
    parser.add_argument("--device", default="auto", help="device of the started server")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS or not 1 <= args.requests <= MAX_REQUESTS:
        parser.error(f"--clients must be 1..{MAX_CLIENTS} and --requests 1..{MAX_REQUESTS}")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error("--url must be a loopback address (127.0.0.1, localhost or ::1)")

    proc = watch = None
    started: dict | None = None
    if args.url:
        url = args.url.rstrip("/").removesuffix("/v1")
    else:
        proc, url, startup_s = start_server(args)
        watch = MemoryWatch(proc.pid)
        started = {"startup_s": round(startup_s, 2), "ray": args.ray, "workers": args.workers}
    try:
        totals = asyncio.run(run_load(url, args.clients, args.requests, args.max_tokens))
        server_stats = httpx.get(f"{url}/stats", timeout=5).json()
    finally:
        if watch is not None and started is not None:
            started.update(watch.stop())
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    summary = summarize(totals, url, args.clients, server_stats)
    summary["started"] = started
    if args.json:
        print(json.dumps(summary))
        return
    print(f"server          {url}")
    if started:
        print(
            f"started         in {started['startup_s']} s; {started['processes']} processes, "
            f"{started['peak_rss_mib']} MiB RSS at most"
        )
    print(
        f"requests        {summary['succeeded']}/{summary['requests']} ok, {args.clients} clients"
    )
    print(f"wall            {summary['wall_s']} s ({summary['requests_per_s']} requests/s)")
    print(f"TTFT p50 / p99  {summary['ttft_p50_s']} s / {summary['ttft_p99_s']} s")
    print(f"latency p50     {summary['latency_p50_s']} s")
    print(f"tokens          {summary['completion_tokens']} ({summary['tokens_per_s']} tok/s total)")
    print(f"failures        {summary['failed']}")
    for failure in summary["failures"]:
        print(f"failure         {failure}")
    if summary["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
