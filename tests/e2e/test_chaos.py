"""The short version of scripts/chaos.py (issue 29, item 4): under `pdserve launch`, SIGKILL of the
router, the decode worker, the prefill worker and a decode TP rank, one at a time under load;
every request ends with a full answer or an OpenAI error (a lost connection only when the router
died), none hangs, the cluster serves the same greedy tokens again after each fault by itself,
and no KV block is held at the end. The script's checks are the test's; it must finish in 90 s."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.launch import free_ports

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_chaos_short(tmp_path):
    ports = ",".join(map(str, free_ports(3)))
    out = tmp_path / "chaos.json"
    argv = [sys.executable, str(ROOT / "scripts" / "chaos.py"), "--requests", "100", "--concurrency", "8",
            "--faults", "4", "--max-tokens", "8", "--min-gap", "1", "--max-gap", "3", "--request-timeout", "30",
            "--lease-seconds", "5", "--ports", ports, "--out", str(out), "--work-dir", str(tmp_path / "work")]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=200)
    took = time.monotonic() - t0
    report = json.loads(out.read_text()) if out.exists() else None
    assert proc.returncode == 0 and report is not None, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert all(report["checks"].values()) and [f["target"] for f in report["faults"]] != []
    assert sorted(f["target"] for f in report["faults"]) == ["decode", "prefill", "router", "tp_rank"]
    assert report["outcomes"]["ok"] >= 100 - report["outcomes"].get("error", 0)
    assert took < 90, f"the short chaos run took {took:.0f} s"
    print(proc.stdout[-2000:])
