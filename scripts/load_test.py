"""A bounded load test of `chatcli serve` over loopback: concurrent streaming clients, a fixed
number of requests, then successes, aggregate throughput, time to first token, inter-token
latency (a request's decode time over its tokens) and the gaps between a stream's chunks.

    python scripts/load_test.py                       # starts a server on the embedded model
    python scripts/load_test.py --model PATH --workers 2 --batch 8
    python scripts/load_test.py --ray local --workers 2   # its replicas on a local Ray cluster
    python scripts/load_test.py --url http://127.0.0.1:8000 --json
    python scripts/load_test.py --compare 8           # --batch 1 against --batch 8, at 1, 4,
                                                      # 8 and 16 streams, in one run
    python scripts/load_test.py --compare 8 --synthetic d20 --rounds 1 --max-tokens 16

--compare starts both servers and measures them in turns at each number of streams (--repeat
turns each, every stream sending --rounds requests a turn), so a shared machine's slow spells
fall on both alike; the ratios are the result. --synthetic
serves a random-weight model of nanochat's shapes for that depth (its tokens shown as
printable characters), as `chatcli bench --synthetic` measures it.

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
STREAMS = (1, 4, 8, 16)


@dataclass
class Result:
    ok: bool
    ttft_s: float | None = None
    total_s: float = 0.0
    completion_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)  # between a stream's content chunks
    decode_s: float | None = None  # first content chunk to last
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
    # Numbered, so no two requests share a prompt: a worker's warm caches would answer a
    # repeated one from memory (its cached_tokens), which is not what this measures.
    body = {
        "messages": [{"role": "user", "content": f"{i}. {PROMPTS[i % len(PROMPTS)]}"}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": i,
    }
    t0 = time.perf_counter()
    result = Result(ok=False)
    last = None
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
                if choice.get("delta", {}).get("content"):
                    now = time.perf_counter()
                    if result.ttft_s is None:
                        result.ttft_s = now - t0
                    else:
                        result.gaps_s.append(now - last)
                    last = now
                if choice.get("finish_reason"):
                    finished = True
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
            result.ok = finished and done
            if not result.ok:
                result.error = "the stream ended without finish_reason and [DONE]"
            elif result.ttft_s is not None and last is not None:
                result.decode_s = last - t0 - result.ttft_s
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
    gaps = [g for r in ok for g in r.gaps_s]
    # Inter-token latency: each request's decode time over its tokens after the first (a
    # server may send a few tokens a chunk, so chunk gaps alone overstate it).
    itls = [
        r.decode_s / (r.completion_tokens - 1)
        for r in ok
        if r.decode_s is not None and r.completion_tokens > 1
    ]
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
        "itl_p50_s": rounded(percentile(itls, 50)),
        "itl_p99_s": rounded(percentile(itls, 99)),
        "gap_p50_s": rounded(percentile(gaps, 50)),
        "gap_p99_s": rounded(percentile(gaps, 99)),
        "latency_p50_s": rounded(percentile([r.total_s for r in ok], 50)),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / totals.wall_s, 1) if totals.wall_s else None,
        "requests_per_s": round(len(ok) / totals.wall_s, 2) if totals.wall_s else None,
        "mean_tokens_per_request": round(statistics.mean([r.completion_tokens for r in ok]), 1)
        if ok
        else None,
        "server": server_stats,
    }


# ---- servers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    args: argparse.Namespace, batch: int | None
) -> tuple[subprocess.Popen, str, float]:
    """A server on a free loopback port: (process, url, seconds until healthy). `chatcli
    serve` (with --batch where given), or --synthetic's own."""
    port = free_port()
    if args.synthetic:
        command = [sys.executable, __file__, "--serve-synthetic", args.synthetic]
        command += ["--port", str(port), "--batch", str(batch or 1)]
    else:
        command = [sys.executable, "-m", "chatcli", "serve", "--port", str(port)]
        command += ["--device", args.device, "--max-queue", str(MAX_REQUESTS)]
        if args.model:
            command += ["--model", args.model]
        if args.workers:
            command += ["--workers", args.workers]
        if args.ray:
            command += ["--ray", args.ray]
        if batch is not None:
            command += ["--batch", str(batch)]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
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
    raise SystemExit("the server did not come up within 600 s")


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


class _PrintableTokens:
    """A synthetic model's tokenizer for the server: prompts rendered as the embedded
    model's tokenizer renders them (ids far inside the synthetic vocabulary), every
    generated id shown as one printable character (a random model's ids are nearly all
    above the bytes), special tokens at the vocabulary's top (bench.SyntheticTokenizer)."""

    def __init__(self, vocab_size: int) -> None:
        from chatcli.bench.models import SyntheticTokenizer
        from chatcli.model.checkpoint import load_model

        self._ids = SyntheticTokenizer(vocab_size)
        _, self._chat, _ = load_model(None, device="cpu")

    def render_for_completion(self, conversation: list[dict]) -> list[int]:
        return self._chat.render_for_completion(conversation)

    def encode(self, text: str) -> list[int]:
        return self._ids.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode()

    def decode_bytes(self, ids: list[int]) -> bytes:
        top = min(self._ids.special.values())
        return bytes(32 + i % 95 for i in ids if i < top)

    def encode_special(self, name: str) -> int:
        return self._ids.encode_special(name)

    def get_bos_token_id(self) -> int:
        return self._ids.get_bos_token_id()


def serve_synthetic(depth: str, port: int, batch: int) -> None:
    """The --synthetic server: a random-weight model of that depth, with the 16-bit decode
    copies `chatcli serve` gives a large model."""
    import torch

    from chatcli.bench.models import synthetic_model
    from chatcli.bench.roofline import weight_bytes_per_token
    from chatcli.engine.cpu_plan import apply_cpu_plan
    from chatcli.model.linear import is_embedding_table
    from chatcli.model.model_build import LARGE_MODEL_MATRIX_PARAMS
    from chatcli.model.quantize import default_half_kind
    from chatcli.serve.app import Limits, Worker, create_app
    from chatcli.serve.runner import listen, run_app

    sock = listen("127.0.0.1", port)
    model, _ = synthetic_model(depth)
    with torch.no_grad():  # embedding tables in bf16, as a checkpoint's stay on the CPU
        for name, p in model.named_parameters():
            if is_embedding_table(name):
                p.data = p.data.bfloat16()
    if weight_bytes_per_token(model) / 4 > LARGE_MODEL_MATRIX_PARAMS:
        model.add_decode_weights(default_half_kind())
    apply_cpu_plan(model)
    tokenizer = _PrintableTokens(model.config.vocab_size)
    app = create_app([Worker(model, tokenizer, batch=batch)], Limits(), f"synthetic-{depth}")
    run_app(app, sock, log_level="warning")


# ---- one run, or --batch 1 against --batch N ---------------------------------------------------


def measure(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    totals = asyncio.run(run_load(url, clients, requests, max_tokens))
    server_stats = httpx.get(f"{url}/stats", timeout=5).json()
    return summarize(totals, url, clients, server_stats)


def compare(args: argparse.Namespace) -> list[dict]:
    """Both servers up; at each number of streams, --batch 1 (--against) and --batch N in turns, each
    `repeat` times (the order alternating), every request of a server's turns pooled: its
    throughput is their tokens over their time, its latencies their percentiles."""
    base = args.against
    servers = {b: start_server(args, b)[:2] for b in (base, args.compare)}
    rows = []
    try:
        for streams in args.streams:
            pooled = {b: Totals() for b in servers}
            for k in range(args.repeat):
                order = (base, args.compare) if k % 2 == 0 else (args.compare, base)
                for batch in order:
                    url = servers[batch][1]
                    totals = asyncio.run(
                        run_load(url, streams, streams * args.rounds, args.max_tokens)
                    )
                    pooled[batch].results += totals.results
                    pooled[batch].wall_s += totals.wall_s
            for batch in sorted(pooled):
                result = summarize(pooled[batch], servers[batch][1], streams, None)
                result.pop("server")
                rows.append({"batch": batch, "streams": streams, **result})
                print(_line(rows[-1]), file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _line(r: dict) -> str:
    return (
        f"{r['streams']:>7}  {r['batch']:>5}  {r['tokens_per_s']:>7}  "
        f"{_ms(r['ttft_p50_s']):>6} {_ms(r['ttft_p99_s']):>6}  "
        f"{_ms1(r['itl_p50_s']):>6} {_ms1(r['itl_p99_s']):>6}  "
        f"{_ms(r['gap_p99_s']):>6}  {r['failed']:>6}"
    )


def _ms1(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def print_table(rows: list[dict], compared: int, base: int = 1) -> None:
    print("streams  batch    tok/s  TTFT ms p50/p99  ITL ms p50/p99  gap p99  failed")
    for r in rows:
        print(_line(r))
    print(f"\n--batch {compared} over --batch {base}:")
    by = {(r["streams"], r["batch"]): r for r in rows}
    for streams in sorted({r["streams"] for r in rows}):
        one, n = by[(streams, base)], by[(streams, compared)]
        speed = n["tokens_per_s"] / one["tokens_per_s"] if one["tokens_per_s"] else None
        ttft = (
            n["ttft_p50_s"] / one["ttft_p50_s"] if n["ttft_p50_s"] and one["ttft_p50_s"] else None
        )
        speed_text = "-" if speed is None else f"{speed:.2f}x"
        ttft_text = "-" if ttft is None else f"{ttft:.2f}"
        print(
            f"  {streams:>2} streams: aggregate {speed_text}, TTFT p50 {ttft_text} of "
            f"--batch {base}'s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="target a running loopback server instead of starting one")
    parser.add_argument("--model", help="checkpoint for the started server (default: embedded)")
    parser.add_argument("--synthetic", choices=["d4", "d12", "d20"], help="a random model")
    parser.add_argument(
        "--workers", help="replicas of the started server: N, or MIN-MAX with --ray"
    )
    parser.add_argument("--ray", metavar="ADDRESS", help="start the server with --ray ADDRESS")
    parser.add_argument("--device", default="auto", help="device of the started server")
    parser.add_argument("--batch", type=int, default=None, help="the started server's --batch")
    parser.add_argument("--compare", type=int, metavar="N", help="--batch 1 against --batch N")
    parser.add_argument(
        "--against", type=int, default=1, metavar="B", help="with --compare: --batch B, not 1"
    )
    parser.add_argument(
        "--streams",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=STREAMS,
        help="with --compare: the numbers of concurrent streams (default 1,4,8,16)",
    )
    parser.add_argument("--rounds", type=int, default=4, help="with --compare: requests a stream")
    parser.add_argument(
        "--repeat", type=int, default=3, help="with --compare: turns each server takes a level"
    )
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--serve-synthetic", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_synthetic:
        serve_synthetic(args.serve_synthetic, args.port, args.batch or 1)
        return
    if not 1 <= args.clients <= MAX_CLIENTS or not 1 <= args.requests <= MAX_REQUESTS:
        parser.error(f"--clients must be 1..{MAX_CLIENTS} and --requests 1..{MAX_REQUESTS}")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error("--url must be a loopback address (127.0.0.1, localhost or ::1)")
    if args.compare is not None:
        if args.url or args.ray:
            parser.error("--compare starts its own two servers on this machine: no --url, --ray")
        if (
            not all(1 <= s <= MAX_CLIENTS for s in args.streams)
            or min(args.rounds, args.repeat) < 1
        ):
            parser.error(f"--streams must be 1..{MAX_CLIENTS}, --rounds and --repeat at least 1")
        rows = compare(args)
        if args.json:
            print(json.dumps({"compare": args.compare, "against": args.against, "runs": rows}))
        else:
            print_table(rows, args.compare, args.against)
        return

    proc = watch = None
    started: dict | None = None
    if args.url:
        url = args.url.rstrip("/").removesuffix("/v1")
    else:
        proc, url, startup_s = start_server(args, args.batch)
        watch = MemoryWatch(proc.pid)
        started = {"startup_s": round(startup_s, 2), "ray": args.ray, "workers": args.workers}
    try:
        summary = measure(url, args.clients, args.requests, args.max_tokens)
    finally:
        if watch is not None and started is not None:
            started.update(watch.stop())
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
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
    print(f"ITL p50 / p99   {summary['itl_p50_s']} s / {summary['itl_p99_s']} s")
    print(f"gaps p50 / p99  {summary['gap_p50_s']} s / {summary['gap_p99_s']} s")
    print(f"latency p50     {summary['latency_p50_s']} s")
    print(f"tokens          {summary['completion_tokens']} ({summary['tokens_per_s']} tok/s total)")
    print(f"failures        {summary['failed']}")
    for failure in summary["failures"]:
        print(f"failure         {failure}")
    if summary["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
