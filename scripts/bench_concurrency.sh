#!/usr/bin/env bash
# The reference sweep: random 256-token prompts and outputs at concurrency 1, 8, 16
# (6, 24, 32 requests) against a running router; writes a JSON file and a PNG.
#
#   scripts/bench_concurrency.sh [BASE_URL] [OUT_PREFIX] [extra pdserve bench flags...]
#   scripts/bench_concurrency.sh http://127.0.0.1:8000 results/pd --metrics-url http://127.0.0.1:30001
#
# Compare two runs afterwards:
#   pdserve bench plot results/colocated.json results/pd.json -o results/compare.png
#   pdserve bench advise results/colocated.json results/pd.json --colocated-gpus 4 --pd-gpus 8
set -euo pipefail

BASE_URL="${1:-http://127.0.0.1:8000}"
OUT_PREFIX="${2:-results/bench_$(date +%Y%m%d_%H%M%S)}"
shift $(( $# < 2 ? $# : 2 ))

mkdir -p "$(dirname "$OUT_PREFIX")"
if command -v pdserve >/dev/null 2>&1; then
    BENCH=(pdserve bench)
else
    BENCH=(python -m pdserve.bench)
fi

"${BENCH[@]}" \
    --base-url "$BASE_URL" \
    --dataset random --input-len 256 --output-len 256 \
    --concurrency 1,8,16 --num-prompts 6,24,32 \
    --seed 0 \
    --out "$OUT_PREFIX.json" --plot "$OUT_PREFIX.png" \
    "$@"
