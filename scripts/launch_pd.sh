#!/usr/bin/env bash
# Start router + prefill + decode from a cluster config (default: configs/tiny-cpu.yaml) and keep
# them running until Ctrl-C. Any argument goes to `pdserve launch`, e.g.
#   scripts/launch_pd.sh --config configs/8x-rtx-pro-6000-pd.yaml --model /models/DeepSeek-V3.2
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m pdserve launch "$@"
