"""The byte-level parsers (tests/fuzz_targets.py: the safetensors header, the tokenizer's
restricted unpickler, the conversation reader, the calculator's parser) fuzzed two ways:
Hypothesis from their valid seeds, damaged byte by byte, and, where atheris is installed,
a short coverage-guided atheris run of each (scripts/fuzz_atheris.py, longer runs by
scripts/fuzz.sh)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hypothesis", reason="needs the dev extra: pip install -e '.[dev]'")

import fuzz_targets
from fuzzing import RANDOM, SCALE, budget, fuzz, mutated_bytes, time_limit
from hypothesis import given
from hypothesis import strategies as st

pytestmark = fuzz
ROOT = Path(__file__).resolve().parent.parent
ATHERIS_SECONDS = 8  # each target, in the suite


@pytest.mark.parametrize("target", list(fuzz_targets.TARGETS))
def test_a_byte_parser_takes_any_bytes(target):
    inputs = st.one_of(
        st.sampled_from(fuzz_targets.seeds(target)).flatmap(mutated_bytes),
        st.binary(max_size=300),
    )

    @given(inputs)
    @budget(150)
    def check(data: bytes) -> None:
        with time_limit(10):
            fuzz_targets.TARGETS[target](data)

    check()


@pytest.mark.slow
@pytest.mark.parametrize("target", list(fuzz_targets.TARGETS))
def test_a_byte_parser_survives_a_short_coverage_guided_run(target, tmp_path):
    pytest.importorskip("atheris", reason="atheris has no wheel for this platform")
    seconds = int(ATHERIS_SECONDS * SCALE)
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "fuzz_atheris.py"),
            target,
            f"-max_total_time={seconds}",
            f"-artifact_prefix={tmp_path}/",
            "-print_final_stats=1",
            *([] if RANDOM else ["-seed=1"]),
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 120,
    )
    found = sorted(p.name for p in tmp_path.glob("crash-*"))
    assert run.returncode == 0 and not found, (
        f"atheris found an input that breaks {target} ({found}; replay it with "
        f"python scripts/fuzz_atheris.py {target} FILE):\n{run.stderr[-4000:]}"
    )
    runs = [line for line in run.stderr.splitlines() if "stat::number_of_executed_units" in line]
    assert runs and int(runs[0].split(":")[-1]) > 0, run.stderr[-2000:]
