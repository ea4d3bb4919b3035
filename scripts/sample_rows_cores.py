"""Whether a second core speeds up a small model's sample rows (a benchmark, not a test).

    python scripts/sample_rows_cores.py products   # 8 rows through each matrix kind
    python scripts/sample_rows_cores.py processes  # 8 rows in one step, or 4 and 4 at once

The CPU plan decodes a small model on one thread: its ops are too small for torch to split
(docs/performance.md). Sample rows are the one place with work to share, so this measures
the two ways left to give them the second core, on the embedded model (or --model PATH):

`products` times each matrix kind of the model for 8 rows: `torch.mm` on one thread, and
the matrix split into column halves as one `bmm` on two threads, with and without laying
the halves back into the (rows, out) result the rest of the step reads. Medians over
rounds that alternate the variants, in microseconds per matrix.

`processes` times 48 decode steps of the fused step: one row; 8 sample rows over one shared
256-token prompt in one step; and the same 8 rows as two steps of 4 run at once, one in
this process and one in a spawned worker that holds its own copy of the model and prompt,
the two meeting after every step over a pipe. Medians over rounds, ms per step, and each
form's aggregate tok/s over the one-row step's.
"""

# ruff: noqa: E402 (OpenMP's wait is chosen before torch is imported)
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from chatcli.cli.openmp_wait import choose_openmp_wait

choose_openmp_wait()  # before torch starts its threads, as the CLI does

import torch
import torch.multiprocessing as mp

from chatcli.bench.bench import _prompt
from chatcli.engine.engine import Engine
from chatcli.model.checkpoint import load_model
from chatcli.model.kv_cache import KVCache, SharedPrefixCache

ROWS = 8
STEPS = 48
ROUNDS = 15


def _us_per_call(fn: Callable[[], object], threads: int, calls: int = 300) -> float:
    torch.set_num_threads(threads)
    fn()  # wakes the second thread where there is one
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _time_matrix(name: str, w: torch.Tensor) -> None:
    out, width = w.shape
    wt = w.t().contiguous()  # (in, out), the fused step's layout for 8 rows
    halves = wt.view(width, 2, out // 2).permute(1, 0, 2).contiguous()  # (2, in, out/2)
    x = torch.randn(ROWS, width)
    both = x.expand(2, ROWS, width)
    laid_back = torch.bmm(both, halves).transpose(0, 1).reshape(ROWS, out)
    torch.testing.assert_close(laid_back, torch.mm(x, wt), rtol=1e-4, atol=1e-4)
    variants: dict[str, tuple[int, Callable[[], object]]] = {
        "mm, 1 thread": (1, lambda: torch.mm(x, wt)),
        "halves, 2 threads": (2, lambda: torch.bmm(both, halves)),
        "halves laid back, 2 threads": (
            2,
            lambda: torch.bmm(both, halves).transpose(0, 1).reshape(ROWS, out),
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(ROUNDS):
        for label, (threads, fn) in variants.items():
            times[label].append(_us_per_call(fn, threads))
    cells = "  ".join(f"{k} {statistics.median(v):5.1f}" for k, v in times.items())
    print(f"{name:8s} {out}x{width:<5d} {cells}  (us per matrix)")


def products(model_path: str | None) -> None:
    model, _, _ = load_model(model_path, device="cpu")
    block = model.transformer.h[0]
    a, m = block.attn, block.mlp
    kinds = {
        "qkv": torch.cat([a.c_q.weight, a.c_k.weight, a.c_v.weight]),
        "proj": a.c_proj.weight,
        "fc": m.c_fc.weight,
        "fc_proj": m.c_proj.weight,
        "lm_head": model.lm_head.weight,
    }
    with torch.inference_mode():
        for name, w in kinds.items():
            _time_matrix(name, w.detach())
    torch.set_num_threads(1)


def _prefilled(model_path: str | None) -> tuple[Engine, KVCache]:
    """The fused step's engine on one thread and the shared prompt's batch-1 cache."""
    torch.set_num_threads(1)
    model, tokenizer, _ = load_model(model_path, device="cpu")
    engine = Engine(model, tokenizer)
    prompt = _prompt(tokenizer, 256)
    cache = engine.new_cache(1, len(prompt))
    engine.forward_last(torch.tensor([prompt]), cache)
    return engine, cache


def _worker(conn: Connection, model_path: str | None, rows: int) -> None:
    """Decode `rows` sample rows one step per b"s", a fresh set of rows per b"n"."""
    engine, prompt = _prefilled(model_path)
    ids = torch.randint(0, engine.model.config.vocab_size, (rows, 1))
    cache = SharedPrefixCache(prompt, rows, STEPS + 1)
    conn.send_bytes(b"ready")
    with torch.inference_mode():
        while (message := conn.recv_bytes()) != b"q":
            if message == b"n":
                cache = SharedPrefixCache(prompt, rows, STEPS + 1)
            else:
                engine.decode_step(ids, cache)
            conn.send_bytes(b"k")


def processes(model_path: str | None) -> None:
    engine, prompt = _prefilled(model_path)
    step, vocab = engine.decode_step, engine.model.config.vocab_size
    half = ROWS // 2
    ctx = mp.get_context("spawn")  # a forked child would inherit OpenMP's threads mid-state
    conn, child_end = ctx.Pipe()
    worker = ctx.Process(target=_worker, args=(child_end, model_path, half), daemon=True)
    worker.start()
    if conn.recv_bytes() != b"ready":
        raise RuntimeError("the worker did not start")

    def one_row() -> float:
        cache = engine.new_cache(1, prompt.get_pos() + STEPS + 1)
        cache.prefill(prompt)
        ids = torch.randint(0, vocab, (1, 1))
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step(ids, cache)
        return (time.perf_counter() - t0) / STEPS

    def rows_in_one_step() -> float:
        cache = SharedPrefixCache(prompt, ROWS, STEPS + 1)
        ids = torch.randint(0, vocab, (ROWS, 1))
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step(ids, cache)
        return (time.perf_counter() - t0) / STEPS

    def rows_in_two_processes() -> float:
        conn.send_bytes(b"n")
        conn.recv_bytes()
        cache = SharedPrefixCache(prompt, half, STEPS + 1)
        ids = torch.randint(0, vocab, (half, 1))
        t0 = time.perf_counter()
        for _ in range(STEPS):
            conn.send_bytes(b"s")
            step(ids, cache)
            conn.recv_bytes()
        return (time.perf_counter() - t0) / STEPS

    forms = {
        "1 row": one_row,
        f"{ROWS} rows, one step": rows_in_one_step,
        f"{ROWS} rows, {half} + {half} in two processes": rows_in_two_processes,
    }
    times: dict[str, list[float]] = {k: [] for k in forms}
    with torch.inference_mode():
        for _ in range(ROUNDS):
            for label, form in forms.items():
                times[label].append(form())
    conn.send_bytes(b"q")
    worker.join(timeout=10)
    single = statistics.median(times["1 row"])
    for label, values in times.items():
        ms = statistics.median(values)
        rows = 1 if label == "1 row" else ROWS
        print(f"{label:34s} {ms * 1e3:6.3f} ms/step  {rows * single / ms:4.2f}x one row's tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["products", "processes"])
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded one)")
    args = parser.parse_args()
    (products if args.what == "products" else processes)(args.model)


if __name__ == "__main__":
    main()
