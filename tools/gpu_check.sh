#!/usr/bin/env bash
# The GPU machine's one call: the `gpu` test tier and the benchmarks, logs into $OUT.
# Usage (repo root, on the GPU machine): bash tools/gpu_check.sh [extra pytest args]
# SPECRUN_BENCH=1 adds the kernel benchmarks; SPECRUN_BENCH_DECODE="1 2" the decode benchmark
# for those buckets (about 45 s of compilation per plain and 85 s per speculative bucket).
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
if [ -n "${SPECRUN_BENCH_DECODE:-}" ]; then
    # shellcheck disable=SC2086
    timeout 400 python3 -m specrun.tools.cli bench decode --buckets $SPECRUN_BENCH_DECODE \
        --json "$OUT/bench_decode.jsonl" 2> "$OUT/bench_decode.err" \
        | tee "$OUT/bench_decode.log" | grep -v '^{'
fi
exit $status
