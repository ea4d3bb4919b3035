"""A big checkpoint's memory on the CPU, from a fresh process (a benchmark, not a test).

    python scripts/load_memory.py                # nanochat d20's shapes, tables saved in bf16
    python scripts/load_memory.py --depth d12 --dir /tmp/ckpt

Writes a random-weight checkpoint with the saved dtypes of a nanochat CUDA run (matrices
fp32, the token and value embedding tables bf16) once, then loads it in a child process per
way of keeping the tables, as `chatcli chat` loads a checkpoint (read_state_dict's mmap,
pick_precision's plan, build_model), and decodes 16 tokens. Prints, after loading and after
decoding, the process's resident memory from /proc/self/status: RssAnon (its own memory,
which the OS can only swap) and RssFile (pages of the mapped checkpoint, which it can drop and
read again), and VmHWM (the peak of both). "as saved" is the loader; "widened" is the loader
with checkpoint.NARROW_TABLES_AT out of reach, as every table was kept before: fp32 copies
made at load.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

from chatcli.bench.models import SyntheticTokenizer, synthetic_config, synthetic_model
from chatcli.engine.cpu_plan import apply_cpu_plan
from chatcli.engine.engine import Engine
from chatcli.model import checkpoint
from chatcli.model.checkpoint import read_state_dict
from chatcli.model.linear import is_embedding_table
from chatcli.model.model_build import build_model, pick_precision, saved_matrix_params

FIELDS = ("VmHWM", "RssAnon", "RssFile")


def memory_status() -> dict[str, float]:
    """GB of each FIELDS entry of this process."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in FIELDS:
            out[name] = int(value.split()[0]) / 2**20  # kB -> GB
    return out


def _write(depth: str, folder: Path) -> Path:
    path = folder / f"model_{depth}.pt"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    model, _ = synthetic_model(depth)
    sd = {k: v.bfloat16() if is_embedding_table(k) else v for k, v in model.state_dict().items()}
    torch.save(sd, path)
    return path


def _child(path: Path, depth: str, widen: bool) -> None:
    if widen:  # tables of any size widen at load, as every table did before
        checkpoint.NARROW_TABLES_AT = 2**62
    config = synthetic_config(depth)
    t0 = time.perf_counter()
    sd = read_state_dict(path)
    precision = pick_precision(torch.device("cpu"), "auto", saved_matrix_params(sd))
    model = build_model(sd, config, path, torch.device("cpu"), precision)
    del sd
    loaded = memory_status()
    load_s = time.perf_counter() - t0
    apply_cpu_plan(model)
    engine = Engine(model, SyntheticTokenizer(config.vocab_size))
    prompt = list(range(1, 33))
    t0 = time.perf_counter()
    n = sum(1 for _ in engine.generate(prompt, max_tokens=16, temperature=0.0, use_tools=False))
    decode_s = time.perf_counter() - t0
    decoded = memory_status()
    what = "widened" if widen else "as saved"
    tables = str(model.transformer.wte.weight.dtype).removeprefix("torch.")
    print(
        f"{what} ({tables} tables, {precision.describe()}): load {load_s:.1f} s, "
        f"{n} tokens {n / decode_s:.1f} tok/s"
    )
    for label, status in (("loaded", loaded), ("decoded", decoded)):
        print(f"  {label:>8}: " + "  ".join(f"{k} {v:5.2f} GB" for k, v in status.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", default="d20", choices=("d4", "d12", "d20"))
    parser.add_argument("--dir", type=Path, default=Path("/tmp/chatcli-load-memory"))
    parser.add_argument("--child", choices=("saved", "widened"))
    args = parser.parse_args()
    path = args.dir / f"model_{args.depth}.pt"
    if args.child:
        _child(path, args.depth, widen=args.child == "widened")
        return
    path = _write(args.depth, args.dir)
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB")
    for way in ("saved", "widened"):
        cmd = [sys.executable, __file__, "--depth", args.depth, "--dir", str(args.dir)]
        subprocess.run([*cmd, "--child", way], check=True)


if __name__ == "__main__":
    main()
