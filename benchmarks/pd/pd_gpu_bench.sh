#!/usr/bin/env bash
# PD against colocated on the same hardware: `pdserve launch` each cluster config in turn, run
# `pdserve bench` against its router (with the workers' metrics), stop it; then the advisor's
# verdict on the two result files (GPU counts read from the runs).
#
#   benchmarks/pd/pd_gpu_bench.sh OUT_DIR MODEL_DIR   (from the repository root)
#
# Writes OUT_DIR/pd.json, colocated.json, advise.txt and logs.tar.gz (every process's log and each
# worker's /metrics after its sweep, from LOGS: /tmp/pd_gpu_bench_logs).
# Settings (environment):
#   PD_CONFIG (configs/pd-1gpu.yaml)  COLOCATED_CONFIG (configs/colocated-1gpu.yaml)
#   PD_METRICS ("http://127.0.0.1:30000 http://127.0.0.1:30001")  COLOCATED_METRICS ("http://127.0.0.1:30002")
#   INPUT_LEN (1024)  OUTPUT_LEN (128)  CONCURRENCY (1,8,16,32)  NUM_PROMPTS (4,16,32,64)
#   WARMUP (1: first run every level once with 8-token outputs, untimed; 0: no warm-up)
#   ROUTER (http://127.0.0.1:8000: both configs' router)
#   STARTUP_S (300: for a cluster to become healthy)  BENCH_S (150: for one sweep)  PY (python3)
set -uo pipefail

OUT=${1:?usage: pd_gpu_bench.sh OUT_DIR MODEL_DIR}
MODEL=${2:?usage: pd_gpu_bench.sh OUT_DIR MODEL_DIR}
PY=${PY:-python3}
ROUTER=${ROUTER:-http://127.0.0.1:8000}
LOGS=${LOGS:-/tmp/pd_gpu_bench_logs}
mkdir -p "$OUT" "$LOGS"

wait_healthy() {  # $1: launcher pid
    "$PY" -m benchmarks.pd.wait_healthy "$1" "$ROUTER" "${STARTUP_S:-300}"
}

run() {  # $1: name, $2: config, $3: worker metrics URLs
    local name=$1 config=$2 metrics=() pid rc=0
    for u in $3; do metrics+=(--metrics-url "$u"); done
    echo "== $name: $config ($(date -u +%H:%M:%S))"
    "$PY" -m pdserve launch --config "$config" --model "$MODEL" --log-dir "$LOGS/$name" >"$LOGS/$name.launch.log" 2>&1 &
    pid=$!
    if wait_healthy "$pid"; then
        if [[ "${WARMUP:-1}" == 1 ]]; then  # the same levels, short outputs: JIT compiles and graph shapes before timing
            timeout "${BENCH_S:-150}" "$PY" -m pdserve bench --base-url "$ROUTER" --input-len "${INPUT_LEN:-1024}" --output-len 8 \
                --concurrency "${CONCURRENCY:-1,8,16,32}" --num-prompts "${CONCURRENCY:-1,8,16,32}" --seed 1 --disable-tqdm \
                --out "$LOGS/$name.warmup.json" >"$LOGS/$name.warmup.log" 2>&1 || echo "warm-up failed: $LOGS/$name.warmup.log"
        fi
        timeout "${BENCH_S:-150}" "$PY" -m pdserve bench --base-url "$ROUTER" --input-len "${INPUT_LEN:-1024}" \
            --output-len "${OUTPUT_LEN:-128}" --concurrency "${CONCURRENCY:-1,8,16,32}" --num-prompts "${NUM_PROMPTS:-4,16,32,64}" \
            --disable-tqdm "${metrics[@]}" --out "$OUT/$name.json" || rc=$?
        for u in $3; do  # the workers' counters after the sweep (staged transfers, KV seconds, steps)
            "$PY" -c "import sys, httpx; print(httpx.get(sys.argv[1] + '/metrics', timeout=5).text)" "$u" \
                >"$LOGS/$name.${u##*:}.metrics.txt" 2>&1
        done
    else
        rc=1
        tail -n 30 "$LOGS/$name.launch.log"
    fi
    kill -TERM "$pid" 2>/dev/null
    wait "$pid"
    tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .  # after each run: a later timeout still returns them
    return $rc
}

run pd "${PD_CONFIG:-configs/pd-1gpu.yaml}" "${PD_METRICS:-http://127.0.0.1:30000 http://127.0.0.1:30001}"
run colocated "${COLOCATED_CONFIG:-configs/colocated-1gpu.yaml}" "${COLOCATED_METRICS:-http://127.0.0.1:30002}"
if [[ -f "$OUT/pd.json" && -f "$OUT/colocated.json" ]]; then
    "$PY" -m pdserve bench advise "$OUT/colocated.json" "$OUT/pd.json" | tee "$OUT/advise.txt"
fi
