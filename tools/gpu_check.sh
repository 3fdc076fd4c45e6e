#!/usr/bin/env bash
# The GPU machine's one call: the `gpu` test tier and the benchmarks, logs into $OUT.
# Usage (repo root, on the GPU machine): bash tools/gpu_check.sh [extra pytest args]
# Packages the machine lacks (pytest, hypothesis, gguf) can be carried as wheels unpacked into
# a folder named by $SPECRUN_SITE.
set -o pipefail
OUT=${OUT:-/tmp/specrun-gpu}
mkdir -p "$OUT" /tmp/pkg
ln -sfn "$PWD" /tmp/pkg/specrun
export PYTHONPATH=/tmp/pkg${SPECRUN_SITE:+:$SPECRUN_SITE} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/device.txt"
status=0
timeout 400 python3 -m pytest -q -m gpu -rA -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "passed|failed|error|divergences|PASSED|FAILED" || status=1
if [ -n "${SPECRUN_BENCH:-}" ]; then
    timeout 300 python3 -m specrun.tools.cli bench kernels --json "$OUT/bench_kernels.jsonl" \
        2> "$OUT/bench_kernels.err" | tee "$OUT/bench_kernels.log" | grep -v '^{'
fi
exit $status
