#!/usr/bin/env bash
# The GPU checks in one run, for a CUDA machine: the CUDA tests (pytest -m cuda), then
# `chatcli bench` on the embedded model and on a d20-shaped synthetic model, both on the GPU.
# Logs and the bench JSON go to $OUT (default ./cuda-check); the exit status is 1 if any part
# failed. Run from the repository root, with chatcli importable (installed, or PYTHONPATH=.).
# Budget: ~1 minute of tests and ~2-4 minutes of benches on an H100/H200.
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

for what in embedded d20; do
    args=(--device cuda --json)
    [ "$what" = d20 ] && args+=(--synthetic d20)
    t0=$SECONDS
    timeout 170 python3 -m chatcli bench "${args[@]}" >"$out/bench_$what.json" \
        2>"$out/bench_$what.err"
    rc=$?
    [ $rc = 0 ] || status=1
    echo "bench $what: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/env.txt"
    tail -3 "$out/bench_$what.err"
done
exit $status
