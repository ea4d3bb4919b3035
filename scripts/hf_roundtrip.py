"""A d20-shaped model through `chatcli export` and back (a benchmark, not a test).

    python scripts/hf_roundtrip.py                     # nanochat d20's shapes, ~3.8 GB
    python scripts/hf_roundtrip.py --depth d4 --dir /tmp/rt --transformers

Writes, once, a random-weight era-E nanochat checkpoint with nanochat d20's shapes and the
saved dtypes of a nanochat CUDA run (matrices fp32, the token and value embedding tables
bf16), with a tokenizer of 65536 tokens (made-up merges: the export's tokenizer check reads
all of them). Then, each in a fresh process: the export (`chatcli export`'s path, --dtype
keep), loading the export as `--model` does (load_model), and loading the nanochat checkpoint
itself for comparison; with --transformers also AutoModelForCausalLM.from_pretrained of the
export, its logits compared with chatcli's fp32 ones (chatcli's decode weights set aside). Prints each one's wall time and memory from /proc/self/status (VmHWM: the peak
resident memory, mapped file pages included; RssAnon: the process's own memory at the end),
and whether the imported model's logits equal the nanochat checkpoint's bit for bit. A JSON
line with every number ends the output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import string
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from chatcli.bench.bench import synthetic_model
from chatcli.model.gpt import is_embedding_table
from chatcli.model.tokenizer import Tokenizer

FIELDS = ("VmHWM", "RssAnon")
PROMPT = list(range(100, 132))


def _status() -> dict[str, float]:
    """GB of each FIELDS entry of this process."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in FIELDS:
            out[name] = int(value.split()[0]) / 2**20  # kB -> GB
    return out


def synthetic_ranks(n: int) -> dict[bytes, int]:
    """n mergeable ranks: the 256 bytes, then strings of letters, digits and spaces, each
    one longer than a token before it by its last character (so every token has a split)."""
    ranks = {bytes([b]): b for b in range(256)}
    alphabet = (string.ascii_letters + string.digits + " ").encode()
    frontier = [bytes([c]) for c in alphabet]
    while len(ranks) < n:
        grown = []
        for stem, c in itertools.product(frontier, alphabet):
            token = stem + bytes([c])
            ranks[token] = len(ranks)
            grown.append(token)
            if len(ranks) == n:
                break
        frontier = grown
    return ranks


def make(depth: str, folder: Path) -> None:
    model, _ = synthetic_model(depth)
    sd = {k: v.bfloat16() if is_embedding_table(k) else v for k, v in model.state_dict().items()}
    folder.mkdir(parents=True)
    torch.save(sd, folder / "model_000001.pt")
    meta = {"step": 1, "model_config": asdict(model.config)}
    (folder / "meta_000001.json").write_text(json.dumps(meta))
    vocab = model.config.vocab_size
    Tokenizer.from_ranks(synthetic_ranks(vocab - 9)).save(folder / "tokenizer.pkl")


def stage(name: str, nanochat: Path, out: Path, logits_dir: Path) -> dict:
    t0 = time.perf_counter()
    if name == "export":
        from chatcli.chat.settings import DEFAULTS
        from chatcli.model.hf_export import GenerationDefaults, export_model, read_source

        src = read_source(str(nanochat), "sft", None, None)
        result = export_model(out, src, GenerationDefaults(DEFAULTS.temperature, DEFAULTS.top_k))
        seconds = time.perf_counter() - t0
        return {
            "seconds": seconds,
            **_status(),
            "files": result.files,
            "size_gb": result.size_bytes / 1e9,
        }
    if name == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
        seconds = time.perf_counter() - t0
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT])).logits[0]
        theirs = _status()
        ours = torch.load(logits_dir / "import-fp32.pt")
        return {"seconds": seconds, **theirs, "max_abs_diff": (logits - ours).abs().max().item()}
    from chatcli.model.checkpoint import load_model

    model, _, _ = load_model(out if name == "import" else nanochat, device="cpu")
    seconds = time.perf_counter() - t0
    loaded = _status()
    with torch.no_grad():
        torch.save(model(torch.tensor([PROMPT]))[0], logits_dir / f"{name}.pt")
        with model.decode_weights_set_aside():  # the fp32 weights alone, as transformers runs
            torch.save(model(torch.tensor([PROMPT]))[0], logits_dir / f"{name}-fp32.pt")
    return {"seconds": seconds, **loaded, "dtype": model.info.dtype}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", default="d20", choices=("d4", "d12", "d20"))
    parser.add_argument("--dir", type=Path, default=Path("/tmp/chatcli-hf-roundtrip"))
    parser.add_argument("--transformers", action="store_true", help="time from_pretrained too")
    parser.add_argument("--stage")
    args = parser.parse_args()
    nanochat, out = args.dir / f"nanochat-{args.depth}", args.dir / f"hf-{args.depth}"
    if args.stage:
        print(json.dumps(stage(args.stage, nanochat, out, args.dir)))
        return
    if not nanochat.is_dir():
        t0 = time.perf_counter()
        make(args.depth, nanochat)
        print(f"wrote {nanochat} in {time.perf_counter() - t0:.0f} s")
    if out.exists():
        shutil.rmtree(out)
    size = sum(p.stat().st_size for p in nanochat.iterdir()) / 1e9
    print(f"{nanochat}: {size:.2f} GB")
    results = {}
    stages = ["export", "import", "nanochat"] + (["transformers"] if args.transformers else [])
    for name in stages:
        cmd = [sys.executable, __file__, "--depth", args.depth, "--dir", str(args.dir)]
        done = subprocess.run([*cmd, "--stage", name], check=True, capture_output=True, text=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[name]
        extra = {k: v for k, v in r.items() if k not in ("seconds", *FIELDS)}
        print(
            f"{name:>12}: {r['seconds']:6.1f} s   peak {r['VmHWM']:5.2f} GB   "
            f"own {r['RssAnon']:5.2f} GB   {extra}"
        )
    same = torch.equal(torch.load(args.dir / "import.pt"), torch.load(args.dir / "nanochat.pt"))
    print(f"imported logits equal the nanochat checkpoint's bit for bit: {same}")
    results["bit_for_bit"] = same
    print(json.dumps(results))


if __name__ == "__main__":
    main()
