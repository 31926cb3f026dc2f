"""`pdserve bench-engine --verify-k` on the CPU with the tiny V3.2 model: the verify table is
well formed (times, ratios to the plain step, the computed speed-ups), and on the tiny V4 it
runs. Nothing about speed is asserted."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.engine.cli import main
from pdserve.bench.engine.verify import ACCEPT_LENGTHS

RUN = ["--num-layers", "2", "--batch-sizes", "1,3", "--context", "70", "--long-context", "0", "--warmup", "1",
       "--steps", "2", "--baseline-steps", "0", "--profile-steps", "0", "--dtype", "float32", "--device", "cpu"]  # fmt: skip


def test_verify_rows_are_well_formed(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["--model", "tiny-v3.2", *RUN, "--verify-k", "1,3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for row in report["rows"]:
        v = row["verify"]
        assert v["plain_ms"] > 0 and set(v["verify_ms"]) == {"1", "3"}
        assert v["graphed"] == {"1": False, "3": False}  # no CUDA graphs on CPU
        for k in ("1", "3"):
            assert v["ratio"][k] == pytest.approx(v["verify_ms"][k] / v["plain_ms"])
            lengths = [L for L in ACCEPT_LENGTHS if L <= int(k) + 1]
            assert [float(L) for L in v["speedup"][k]] == lengths
            for L, s in v["speedup"][k].items():
                assert s == pytest.approx(float(L) * v["plain_ms"] / v["verify_ms"][k])
        # k + 1 tokens a sequence touch more experts than one: the verify step's floor is higher
        assert 1 < v["floor_ratio"]["1"] < v["floor_ratio"]["3"], v["floor_ratio"]
    text = capsys.readouterr().out
    assert (
        "verify steps (speculative decoding" in text
        and "| 3 | 70 |" in text
        and "x, floor " in text
        and "x, eager)" in text
    )


def test_verify_on_v4_runs_and_leaves_the_state_as_it_was(tmp_path, monkeypatch):
    """V4 (tiny): the verify step's new compressor state goes to a spare slot, freed after it."""
    from pdserve.bench.engine import verify

    seen = []
    step = verify.verify_step

    def watched(bench, seqs, k):
        slots = [s.state_slot for s in seqs]
        seconds = step(bench, seqs, k)
        seen.append((slots == [s.state_slot for s in seqs], bench.blocks.num_used_state_slots == len(seqs)))
        return seconds

    monkeypatch.setattr(verify, "verify_step", watched)
    out = tmp_path / "report.json"
    assert main(["--model", "tiny-v4", *RUN, "--verify-k", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(r["verify"]["verify_ms"]["2"] > 0 for r in rows)
    assert seen and all(a and b for a, b in seen)
