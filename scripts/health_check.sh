#!/usr/bin/env bash
# GET /health on the router (8000) and workers (30000, 30001), or on the --url ... given.
# Exit 0 when all are healthy, 1 when one is not, 2 on a usage error.
#   scripts/health_check.sh
#   scripts/health_check.sh --url http://10.0.0.5:8000 --timeout 2
set -euo pipefail
exec "${PYTHON:-python}" -m pdserve health "$@"
