"""The short version of scripts/chaos.py (issue 43, item 4), two workers a role under `pdserve
launch`: SIGKILL of a decode worker (its requests migrate), `pdserve restart` of a worker (it
drains and starts again) and SIGKILL of the router, one at a time under load. No client sees a
worker fault: no error, no lost connection, no token duplicated or missing (each answer its
prompt's uninterrupted greedy tokens); a lost connection only when the router died; the cluster
serves the same greedy tokens again after each fault by itself; no KV block is held at the end.
The script's checks are the test's; it must finish in 90 s, so decode runs at TP1 here (two TP2
workers double the run): a stopped or killed rank is the full run's (docs/reliability.md), and
test_engine_failure.py's and test_stall.py's."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.launch import free_ports

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_chaos_short_two_workers_a_role(tmp_path):
    ports = ",".join(map(str, free_ports(5)))
    out = tmp_path / "chaos.json"
    argv = [sys.executable, str(ROOT / "scripts" / "chaos.py"), "--workers-per-role", "2", "--decode-tp", "1",
            "--targets", "decode", "restart", "router", "--faults", "3", "--requests", "40", "--concurrency", "4",
            "--max-tokens", "8", "--min-gap", "0.5", "--max-gap", "1", "--request-timeout", "30",
            "--lease-seconds", "5", "--ports", ports, "--out", str(out), "--work-dir", str(tmp_path / "work")]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=200)
    took = time.monotonic() - t0
    report = json.loads(out.read_text()) if out.exists() else None
    assert proc.returncode == 0 and report is not None, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert all(report["checks"].values()) and "0 client-visible failures for worker faults" in report["checks"]
    assert sorted(f["target"] for f in report["faults"]) == ["decode", "restart", "router"]
    assert report["duplicated_tokens"] == report["missing_tokens"] == 0
    assert report["outcomes"]["ok"] >= 40 - report["outcomes"].get("connection_lost", 0)
    assert took < 90, f"the short chaos run took {took:.0f} s"
    print(proc.stdout[-2000:])
