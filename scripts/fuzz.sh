#!/usr/bin/env bash
# A long fuzz run, for before a release: `bash scripts/fuzz.sh --minutes 60`.
#
# Half the time goes to the Hypothesis and Schemathesis targets (the fuzz tests with --scale
# times the suite's examples, a third of the minutes by default, so a round takes about half
# the run; rounds repeat with fresh examples until their half is up), half
# to atheris on each byte-level parser (tests/fuzz_targets.py), its corpus kept in fuzz-corpus/
# so one run starts where the last stopped. Any finding stops the run and fails it: Hypothesis
# prints the example and its @reproduce_failure line (and keeps it in .hypothesis/ to try first
# next time); atheris writes the input to fuzz-corpus/crash-* (replay it with
# `python scripts/fuzz_atheris.py TARGET FILE`). Both folders are ignored by git.
set -euo pipefail
cd "$(dirname "$0")/.."

minutes=10
scale=""
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes="$2"; shift 2 ;;
    --scale) scale="$2"; shift 2 ;;
    *) echo "usage: $0 [--minutes N] [--scale X]" >&2; exit 2 ;;
  esac
done
scale=${scale:-$((minutes / 3 > 1 ? minutes / 3 : 1))}
python=${PYTHON:-python}
export OMP_WAIT_POLICY=PASSIVE
export CHATCLI_FUZZ_RANDOM=1  # fresh examples each round (the suite draws the same ones)
half=$((minutes * 30))  # seconds
targets=(safetensors tokenizer conversation calculator)

echo "== Hypothesis and Schemathesis: ${half}s, ${scale}x the suite's examples a round"
deadline=$((SECONDS + half))
round=0
while [ $SECONDS -lt $deadline ]; do
  round=$((round + 1))
  echo "-- round $round"
  CHATCLI_FUZZ_SCALE="$scale" "$python" -m pytest -q -x -m fuzz \
    tests/test_fuzz_values.py tests/test_fuzz_files.py tests/test_fuzz_bytes.py tests/test_fuzz_api.py \
    -k "not coverage_guided"
done

if "$python" -c "import atheris" 2>/dev/null; then
  each=$((half / ${#targets[@]}))
  mkdir -p fuzz-corpus
  for target in "${targets[@]}"; do
    echo "== atheris: $target for ${each}s"
    mkdir -p "fuzz-corpus/$target"
    if [ -z "$(ls -A "fuzz-corpus/$target")" ]; then  # seeded once; then the corpus grows
      "$python" -c "
import sys; sys.path[:0] = ['.', 'tests']
import fuzz_targets
for i, seed in enumerate(fuzz_targets.seeds('$target')):
    open(f'fuzz-corpus/$target/seed-{i}', 'wb').write(seed)"
    fi
    "$python" scripts/fuzz_atheris.py "$target" "fuzz-corpus/$target" \
      -max_total_time="$each" -artifact_prefix=fuzz-corpus/ -print_final_stats=1
  done
else
  echo "== atheris is not installed: the coverage-guided half is skipped (pip install atheris)"
fi
echo "== no finding in ${minutes} minutes"
