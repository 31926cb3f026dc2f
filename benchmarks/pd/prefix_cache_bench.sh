#!/usr/bin/env bash
# Prefix caching on a GPU, the "done when": a multi-turn workload (4K-token first prompts,
# each later turn resending the conversation so far, ~90% of it a prefix of the previous prompt)
# against PD and colocated, each with and without the prefix cache. `pdserve launch` each run in
# turn, `pdserve bench --dataset multi-turn` against its router (warm-up first), stop it; then
# the table: median TTFT, prefill tokens computed and hit rate per run, PD's decode-side KV bytes
# read and saved (the decode worker's prefix cache), and the ratios
# (no cache / cache) with the goals (TTFT >= 3x, computed >= 5x) and how many answers matched.
#
#   benchmarks/pd/prefix_cache_bench.sh OUT_DIR MODEL_DIR   (from the repository root)
#
# Writes OUT_DIR/{pd,pd-nocache,colocated,colocated-nocache}.json, summary.json (the table's
# numbers) and logs.tar.gz (every process's log, from LOGS: /tmp/prefix_cache_bench_logs).
# Settings (environment):
#   RUNS ("pd pd-nocache colocated colocated-nocache": any subset, e.g. one per call)
#   PD_CONFIG (configs/pd-1gpu.yaml)  COLOCATED_CONFIG (configs/colocated-1gpu.yaml)
#   PD_METRICS (http://127.0.0.1:30000: the prefill worker)  COLOCATED_METRICS (http://127.0.0.1:30002)
#   DECODE_METRICS (http://127.0.0.1:30001: PD's decode worker: KV bytes its loads moved and saved)
#   INPUT_LEN (4096: first turn)  QUESTION_LEN (384: new tokens a later turn adds)  OUTPUT_LEN (64)
#   NUM_TURNS (8)  CONCURRENCY (1,4: conversations in flight)  NUM_PROMPTS (4,8: conversations a level)
#   MAX_MODEL_LEN (8192: the last turn is INPUT_LEN + (NUM_TURNS - 1) x (OUTPUT_LEN + QUESTION_LEN))
#   WARMUP (1: two-turn conversations with 8-token answers first, untimed)  ROUTER (http://127.0.0.1:8000)
#   STARTUP_S (300: for a cluster to become healthy)  BENCH_S (400: for one sweep)  PY (python3)
set -uo pipefail

OUT=${1:?usage: prefix_cache_bench.sh OUT_DIR MODEL_DIR}
MODEL=${2:?usage: prefix_cache_bench.sh OUT_DIR MODEL_DIR}
PY=${PY:-python3}
ROUTER=${ROUTER:-http://127.0.0.1:8000}
LOGS=${LOGS:-/tmp/prefix_cache_bench_logs}
CONCURRENCY=${CONCURRENCY:-1,4}
WORKLOAD=(--dataset multi-turn --input-len "${INPUT_LEN:-4096}" --question-len "${QUESTION_LEN:-384}" --disable-tqdm)
mkdir -p "$OUT" "$LOGS"

wait_healthy() {  # $1: launcher pid
    "$PY" -m benchmarks.pd.wait_healthy "$1" "$ROUTER" "${STARTUP_S:-300}"
}

run() {  # $1: name (pd, pd-nocache, colocated, colocated-nocache)
    local name=$1 config metrics pid rc=0 switch=() decode=()
    case $name in
        pd*) config=${PD_CONFIG:-configs/pd-1gpu.yaml}; metrics=${PD_METRICS:-http://127.0.0.1:30000}
             decode=(--metrics-url "${DECODE_METRICS:-http://127.0.0.1:30001}") ;;
        colocated*) config=${COLOCATED_CONFIG:-configs/colocated-1gpu.yaml}; metrics=${COLOCATED_METRICS:-http://127.0.0.1:30002} ;;
        *) echo "unknown run $name"; return 2 ;;
    esac
    [[ $name == *-nocache ]] && switch=(--no-enable-prefix-caching)
    echo "== $name: $config ${switch[*]} ($(date -u +%H:%M:%S))"
    "$PY" -m pdserve launch --config "$config" --model "$MODEL" --max-model-len "${MAX_MODEL_LEN:-8192}" "${switch[@]}" \
        --log-dir "$LOGS/$name" >"$LOGS/$name.launch.log" 2>&1 &
    pid=$!
    if wait_healthy "$pid"; then
        if [[ "${WARMUP:-1}" == 1 ]]; then  # JIT, graph shapes and a cache hit path before timing; other prompts (seed)
            timeout "${BENCH_S:-400}" "$PY" -m pdserve bench --base-url "$ROUTER" "${WORKLOAD[@]}" --num-turns 2 \
                --output-len 8 --concurrency "$CONCURRENCY" --num-prompts "$CONCURRENCY" --seed 1 \
                --out "$LOGS/$name.warmup.json" >"$LOGS/$name.warmup.log" 2>&1 || echo "warm-up failed: $LOGS/$name.warmup.log"
        fi
        timeout "${BENCH_S:-400}" "$PY" -m pdserve bench --base-url "$ROUTER" "${WORKLOAD[@]}" \
            --num-turns "${NUM_TURNS:-8}" --output-len "${OUTPUT_LEN:-64}" --concurrency "$CONCURRENCY" \
            --num-prompts "${NUM_PROMPTS:-4,8}" --metrics-url "$metrics" "${decode[@]}" --save-output-ids --out "$OUT/$name.json" || rc=$?
        "$PY" -c "import sys, httpx; print(httpx.get(sys.argv[1] + '/metrics', timeout=5).text)" "$metrics" \
            >"$LOGS/$name.metrics.txt" 2>&1
    else
        rc=1
        tail -n 30 "$LOGS/$name.launch.log"
    fi
    kill -TERM "$pid" 2>/dev/null
    wait "$pid"
    tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .  # after each run: a later timeout still returns them
    return $rc
}

status=0
for name in ${RUNS:-pd pd-nocache colocated colocated-nocache}; do
    run "$name" || status=1
done
"$PY" -m benchmarks.pd.prefix_cache_table "$OUT"
exit $status
