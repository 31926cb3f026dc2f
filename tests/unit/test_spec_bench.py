"""`pdserve bench-engine --verify-k` on the CPU with the tiny V3.2 model: the verify table is
well formed (times, ratios to the plain step, the computed speed-ups) and V4 is refused. Nothing
about speed is asserted."""

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
    text = capsys.readouterr().out
    assert "verify steps (speculative decoding" in text and "| 3 | 70 |" in text and "x, eager)" in text


def test_verify_on_v4_is_refused(capsys):
    assert main(["--model", "tiny-v4", *RUN, "--verify-k", "2"]) == 2
    assert "not yet supported for DeepSeek-V4" in capsys.readouterr().err
