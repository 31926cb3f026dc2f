"""Wait until a cluster's router answers /health with 200, while its launcher lives (the PD
benchmark scripts' start-up wait).

    python -m benchmarks.pd.wait_healthy LAUNCHER_PID ROUTER_URL LIMIT_S

Exits 0 once healthy (printing after how long), non-zero with the reason when the launcher exits
or LIMIT_S passes.
"""

from __future__ import annotations

import os
import sys
import time

import httpx


def main(pid: int, url: str, limit: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit("the launcher exited")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                print(f"healthy after {time.monotonic() - t0:.0f} s")
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"not healthy after {limit:.0f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
