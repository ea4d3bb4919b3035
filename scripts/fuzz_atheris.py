"""Coverage-guided fuzzing of chatcli's byte-level parsers with atheris (libFuzzer).

    python scripts/fuzz_atheris.py TARGET [libFuzzer options]
    python scripts/fuzz_atheris.py conversation -max_total_time=60
    python scripts/fuzz_atheris.py tokenizer crash-0123abcd      # replay one input

TARGET is one of tests/fuzz_targets.py's: safetensors, tokenizer, conversation, calculator.
Without a corpus or input named, it starts from the target's valid seeds. A finding stops the
run with the Python traceback and writes the input as crash-<sha1> (see -artifact_prefix=);
run the script again with that file to replay it. Needs atheris (`pip install -e ".[dev]"`
installs it where it has a wheel).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

try:
    import atheris
except ImportError:
    sys.exit(
        "atheris is not installed: pip install atheris (wheels for Linux x86-64, CPython 3.11-3.13)"
    )

with atheris.instrument_imports(include=["chatcli"]):
    import fuzz_targets


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in fuzz_targets.TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(fuzz_targets.TARGETS)}}} [libFuzzer options]")
    name, options = sys.argv[1], sys.argv[2:]
    if not any(not o.startswith("-") for o in options):  # no corpus or input: the seeds
        corpus = Path(tempfile.mkdtemp(prefix=f"chatcli-{name}-corpus-"))
        for i, seed in enumerate(fuzz_targets.seeds(name)):
            (corpus / f"seed-{i}").write_bytes(seed)
        options.append(str(corpus))
    atheris.Setup([sys.argv[0], *options], fuzz_targets.TARGETS[name])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
