#!/usr/bin/env bash
# The GPU checks in one run, for a CUDA machine (scripts/cuda_check.sh [--profile]): the
# CUDA tests (pytest -m cuda), then
# `chatcli bench` on the embedded model and on a d20-shaped synthetic model, both on the GPU.
# Logs and the bench JSON go to $OUT (default ./cuda-check); the exit status is 1 if any part
# failed. Run from the repository root, with chatcli importable (installed, or PYTHONPATH=.).
# Budget on an H200: ~1 minute of tests, ~1.5 minutes of benches; with --profile also the
# d20 step's profile, whose compiled variant compiles for ~25 s.
set -u -o pipefail
out=${OUT:-cuda-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(), torch.cuda.get_device_capability())" 2>&1 | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
    >>"$out/env.txt" 2>&1

timeout 150 python3 -m pytest -m cuda -rA -q -p no:cacheprovider \
    tests/test_cuda.py tests/test_decode_step.py 2>&1 | tee "$out/pytest.log" || status=1

# bench NAME TIMEOUT ARGS...: one `chatcli bench --device cuda --json` into $out/bench_NAME.json
bench() {
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    timeout "$limit" python3 -m chatcli bench --device cuda --json "$@" \
        >"$out/bench_$name.json" 2>"$out/bench_$name.err"
    rc=$?
    [ $rc = 0 ] || status=1
    echo "bench $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/env.txt"
    tail -3 "$out/bench_$name.err"
}

bench embedded 120
bench d20 150 --synthetic d20
if [ "${1:-}" = --profile ]; then
    # Where the step's time goes (kernels, graph replay, host), eager and compiled.
    timeout 200 python3 scripts/cuda_step_profile.py --synthetic d20 2>&1 \
        | tee "$out/profile_d20.log" || status=1
fi
exit $status
