#!/usr/bin/env bash
# Tensor-parallel decoding on the two-H200 machine, in one call of about 9 minutes:
# `specrun bench decode` (random bf16 weights, EAGLE-3-shaped head, 1024 committed tokens,
# greedy) for
#   1. Llama-3.1-8B shapes at TP=1, then TP=2: buckets 1 and 32, the plain step and the
#      default table's round ((7,10,60) at 1, (3,4,8) at 32), eager rounds in CUDA graphs;
#   2. Llama-3.1-70B shapes at TP=2, bucket 1: the plain step and the (7,10,60) round,
#      eager rounds in CUDA graphs (with the draft/verify split);
#   3. the same 70B points compiled with Inductor, in the time left before the deadline
#      (no draft split: it would compile the draft phase a second time).
# Each TP point also records its collectives (all-reduces, the logits' all-gather) and times
# them alone in a CUDA graph: the floor is weights / copy bandwidth + those of the plain step.
# JSON lines (one per point, appended after each run) into $OUT/tp_bench.jsonl, everything
# printed into $OUT/tp_bench.log, the tables of all runs on stdout at the end
# (`python3 -m specrun.tools.decode_cli $OUT/tp_bench.jsonl` prints them again).
#
# Why this split: compiling one 8B round took about 45 s (plain) and 85 s (speculative, with
# the draft phase) per bucket on an H100 with empty caches (tools/gpu_check.sh), so the eight
# 8B points compiled would take the whole call; eager rounds warm up in seconds. The 70B
# graphs have 80 layers instead of 32: on this project's CPU machine Dynamo + AOT tracing of
# a plain step grew from 7.6 to 16.4 s and a whole Inductor compile from 69 to 117 s from 32
# to 80 layers (about 1 s per layer there), which puts the 70B compiled plain step at about
# 75 s and the round at about 90 s on the GPU machine's host (each rank compiles its own, in
# parallel). The eager 70B points come first so that the call has every number the issue
# asks for even if compiling runs past the deadline; the compiled ones say how far from the
# floor the fused kernels are. Expected: 8B TP=1 ~1.5 min, 8B TP=2 ~1.5 min, 70B eager
# ~1.5 min, 70B compiled ~4 min; each run is stopped at its cap or the deadline.
#
# Usage (repo root, on the two-GPU machine): bash tools/gpu_tp_bench.sh
#   TP_BENCH_DEADLINE  seconds after the start by which the last run is stopped (default 540)
set -o pipefail
OUT=${OUT:-/tmp/specrun-gpu}
DEADLINE=${TP_BENCH_DEADLINE:-540}
parts=/tmp/specrun-tp
mkdir -p "$OUT" /tmp/pkg "$parts"
ln -sfn "$PWD" /tmp/pkg/specrun
export PYTHONPATH=/tmp/pkg${SPECRUN_SITE:+:$SPECRUN_SITE} PYTHONUNBUFFERED=1
# NVLink multicast stays off (runtime/ranks.py sets the first two as well).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log=$OUT/tp_bench.log
results=$OUT/tp_bench.jsonl
: > "$results"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nvidia-smi topo -m
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', \
triton.__version__, 'GPUs', torch.cuda.device_count())"
} 2>&1 | tee "$log"

# bench NAME CAP ARGS...: one `specrun bench decode ARGS`, stopped after CAP seconds or at
# the deadline, whichever comes first; its points are appended to $results.
bench() {
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE - SECONDS))
    ((left < cap)) && cap=$left
    if ((cap < 30)); then
        echo "[$SECONDS s] $name: skipped, ${left} s left before the deadline" | tee -a "$log"
        return
    fi
    echo "[$SECONDS s] $name (stopped after $cap s): specrun bench decode $*" | tee -a "$log"
    rm -f "$parts/$name.jsonl"
    timeout -k 15 "$cap" python3 -m specrun.tools.cli bench decode "$@" \
        --json "$parts/$name.jsonl" 2>> "$log" | tee -a "$log" | grep -v '^{'
    local status=${PIPESTATUS[0]}
    echo "[$SECONDS s] $name: exit status $status" | tee -a "$log"
    [ -f "$parts/$name.jsonl" ] && cat "$parts/$name.jsonl" >> "$results"
}

common=(--rounds 20 --top-kernels 10)
bench 8b_tp1_eager 150 --shapes llama-3.1-8b --buckets 1 32 --no-compile \
    --profile-rounds 5 "${common[@]}"
bench 8b_tp2_eager 150 --shapes llama-3.1-8b --buckets 1 32 --no-compile \
    --profile-rounds 5 --tp 2 "${common[@]}"
bench 70b_tp2_eager 180 --shapes llama-3.1-70b --buckets 1 --tree 7 10 60 --no-compile \
    --profile-rounds 3 --tp 2 "${common[@]}"
bench 70b_tp2_compiled 600 --shapes llama-3.1-70b --buckets 1 --tree 7 10 60 \
    --no-draft-split --profile-rounds 3 --tp 2 "${common[@]}"
echo "[$SECONDS s] all runs" | tee -a "$log"
python3 -m specrun.tools.decode_cli "$results" 2>&1 | tee -a "$log"
[ -s "$results" ]  # exit status 1 when no point was measured
