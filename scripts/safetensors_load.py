"""Loading a transformers folder's safetensors weights: seconds and memory (a benchmark).

    python scripts/safetensors_load.py                  # nanochat d20's shapes, era A, fp32
    python scripts/safetensors_load.py --depth d12 --dir /tmp/st
    python scripts/safetensors_load.py --depth embedded     # the embedded model's weights

Writes a random state dict of the depth's shapes (transformers' names, every weight fp32,
~560M parameters at d20), or the embedded model's weights as saved, twice: as chatcli's export writes it (hf_weights.write_safetensors)
and as the safetensors package's save_file writes it (transformers' save_pretrained does the
same). Then, in a fresh child process per file, reads it as `chatcli chat -m FOLDER` does
(hf_weights.read_weights) and reads every value once (as build_model's finiteness check
does). Prints the seconds and, from /proc/self/status, VmHWM (peak resident memory), RssAnon
(the process's own memory: copies) and RssFile (pages of the mapped file, which the OS can
drop and read again). Run it twice for a warm page cache: the first read of a file may come
from disk.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
from load_memory import memory_status  # this folder: the same /proc reading

from chatcli.bench.models import synthetic_config
from chatcli.model.gpt import ERAS, GPT
from chatcli.model.hf_export import read_source
from chatcli.model.hf_weights import read_weights, to_hf_names, write_safetensors

WRITERS = ("chatcli", "package")


def _write(depth: str, era: str, root: Path) -> None:
    if all((root / w / "model.safetensors").exists() for w in WRITERS):
        return
    from safetensors.torch import save_file

    if depth == "embedded":
        src = read_source(None, "sft", None, None)
        sd = to_hf_names(src.state_dict, src.config.vocab_size)
    else:
        config = synthetic_config(depth)
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in GPT(config, ERAS[era]).state_dict().items()}
        gen = torch.Generator().manual_seed(0)
        sd = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
        sd = to_hf_names(sd, config.vocab_size)
    for writer in WRITERS:
        (root / writer).mkdir(parents=True, exist_ok=True)
    write_safetensors(sd, root / "chatcli")
    save_file(sd, root / "package" / "model.safetensors", metadata={"format": "pt"})


def _child(folder: Path) -> None:
    t0 = time.perf_counter()
    sd = read_weights(folder)
    read_s = time.perf_counter() - t0
    assert all(bool(torch.isfinite(t).all()) for t in sd.values())
    total_s = time.perf_counter() - t0
    params = sum(t.numel() for t in sd.values())
    status = "  ".join(f"{k} {v:5.2f} GB" for k, v in memory_status().items())
    print(f"{folder.name:>8}'s file: read {read_s:.2f} s, every value {total_s:.2f} s, {params:,}")
    print(f"{'':>16}{status}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", default="d20", choices=("embedded", "d4", "d12", "d20"))
    parser.add_argument("--era", default="A", choices=sorted(ERAS))
    parser.add_argument("--dir", type=Path, default=Path("/tmp/chatcli-safetensors-load"))
    parser.add_argument("--child", type=Path)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    root = args.dir / (args.depth if args.depth == "embedded" else f"{args.depth}-{args.era}")
    _write(args.depth, args.era, root)
    for writer in WRITERS:
        subprocess.run([sys.executable, __file__, "--child", str(root / writer)], check=True)


if __name__ == "__main__":
    main()
