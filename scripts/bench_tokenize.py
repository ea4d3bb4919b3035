"""How much chatcli's Tokenizer.encode costs over tiktoken's encode_ordinary, on ordinary text.

Tokenizer.encode looks for runs of blanks too long for tiktoken's regex engine (long_runs.py)
before encoding. This prints, for texts of several sizes cut from chatcli's own sources and
docs, the best and median time of each, measured in alternating rounds (ABAB...) so that a
busy machine slows both alike, the time of the look alone, and a long run of spaces.

    python scripts/bench_tokenize.py [--rounds 15] [--tokenizer PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from chatcli.model.long_runs import _may_hold_a_long_run
from chatcli.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER = ROOT / "chatcli" / "default_model" / "tokenizer" / "tokenizer.pkl"
SIZES = (40, 2_000, 30_000, 300_000, 3_000_000)


def corpus() -> str:
    files = sorted(ROOT.glob("chatcli/**/*.py")) + sorted(ROOT.glob("docs/*.md"))
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def timed(fn, text: str, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(text)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    args = parser.parse_args()
    tok = Tokenizer.from_file(args.tokenizer)
    source = corpus()
    rows = []
    for size in SIZES:
        text = (source * (size // len(source) + 1))[:size]
        assert tok.encode(text) == tok.enc.encode_ordinary(text)
        reps = max(1, 300_000 // size)
        plain, ours = [], []
        for _ in range(args.rounds):
            plain.append(timed(tok.enc.encode_ordinary, text, reps))
            ours.append(timed(tok.encode, text, reps))
        ratios = [b / a for a, b in zip(plain, ours, strict=True)]
        check = min(timed(_may_hold_a_long_run, text, reps) for _ in range(args.rounds))
        rows.append(
            {
                "chars": size,
                "check_ms_best": check * 1e3,
                "tiktoken_ms_best": min(plain) * 1e3,
                "chatcli_ms_best": min(ours) * 1e3,
                "ratio_median": statistics.median(ratios),
            }
        )
        print(
            f"{size:>9,} chars  tiktoken {min(plain) * 1e3:9.3f} ms  chatcli "
            f"{min(ours) * 1e3:9.3f} ms  best ratio {min(ours) / min(plain):.3f}  "
            f"median ratio {statistics.median(ratios):.3f}  (the check alone "
            f"{check * 1e3:.4f} ms)"
        )
    spaces = "x" + " " * 1_000_000 + "x"
    seconds = timed(tok.encode, spaces, 1)
    print(f"'x', 1,000,000 spaces, 'x': {seconds * 1e3:.0f} ms (tiktoken alone panics)")
    print(json.dumps({"rows": rows, "million_spaces_ms": seconds * 1e3}))


if __name__ == "__main__":
    main()
