"""Where a GPU's batch-1 decode step spends its time: kernels a step, the CUDA graph's replay
alone, and the whole step as the engine calls it, eager-captured and compiled-captured.

    python scripts/cuda_step_profile.py [--synthetic d20] [--rows 1]

Prints one JSON object per variant. Needs a CUDA device. The weights are bf16, as chatcli
runs a bf16-capable GPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from chatcli.bench.models import cast_copy, synthetic_model
from chatcli.engine.fallback import compiled_or_eager
from chatcli.engine.static_step import CudaGraphStep, StaticDecodeStep
from chatcli.model.checkpoint import load_model
from chatcli.model.kv_cache import KVCache

PREFIX = 64
STEPS = 200


def kernels_a_step(step: StaticDecodeStep, cache: KVCache, ids: torch.Tensor) -> int:
    """CUDA kernels one eager static step launches (what the graph replays)."""
    pos = torch.tensor([cache.get_pos()], device="cuda")
    args = (ids.view(-1), pos, ids.view(-1), torch.ones(1, device="cuda"))
    step.forward_static(*args, cache.k_cache, cache.v_cache)  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.forward_static(*args, cache.k_cache, cache.v_cache)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(model, rows: int, compiled: bool) -> dict:
    c = model.config
    static = StaticDecodeStep(model)
    if compiled:
        static.forward_static = compiled_or_eager(static.forward_static)
    graph = CudaGraphStep(static)
    dtype = model.compute_dtype
    cache = KVCache(rows, c.n_kv_head, c.sequence_len, c.head_dim, c.n_layer, "cuda", dtype)
    ids = torch.randint(0, 256, (rows, PREFIX), device="cuda")
    with torch.inference_mode():
        model(ids, kv_cache=cache)
        token = ids[:, -1:]
        t0 = time.perf_counter()
        graph(token, cache)  # captures (and compiles, the first time)
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(STEPS):
            graph._graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms = start.elapsed_time(end) / STEPS
        t0 = time.perf_counter()
        for _ in range(STEPS // 2):
            logits = graph(token, cache)
            token = logits.argmax(dim=-1, keepdim=True)
            token.view(-1).tolist()  # the engine's one host read a step
        step_ms = (time.perf_counter() - t0) / (STEPS // 2) * 1e3
        kernels = kernels_a_step(static, cache, token) if not compiled else None
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "rows": rows,
        "compiled": compiled,
        "kernels_a_step_eager": kernels,
        "capture_s": round(capture_s, 3),
        "graph_replay_ms": round(replay_ms, 4),
        "engine_step_ms": round(step_ms, 4),
        "tok_s": round(rows * 1e3 / step_ms, 1),
        "weights_mb": round(weights / 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", choices=["d4", "d12", "d20"])
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()
    if args.synthetic:
        model, _ = synthetic_model(args.synthetic, "cuda")
        model = cast_copy(model, torch.bfloat16)
    else:
        model, _, _ = load_model(None, device="cuda")
    label = args.synthetic or "embedded"
    print(json.dumps({"model": label, "gpu": torch.cuda.get_device_name()}))
    for compiled in (False, True):
        print(json.dumps(measure(model, args.rows, compiled)), flush=True)


if __name__ == "__main__":
    main()
