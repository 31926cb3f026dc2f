"""benchmarks/engine/full_model_estimate.py's arithmetic on reports made by hand: one layer's
time is the difference of two runs over their layer difference, the fixed part what is left,
and each other GPU keeps the measured ratio to the floor."""

from __future__ import annotations

import pytest

from benchmarks.engine.full_model_estimate import ALL_REDUCE_US, SPEC_TBPS, estimate, per_layer


def report(layers: int, rows: list[tuple[int, float, float]]) -> dict:
    return {
        "settings": {"num_layers": layers, "context": 4096, "tp_shard": 4, "model": "v4-flash", "quantization": "fp4"},
        "ceilings": {"copy_bytes_per_s": 3.0e12},
        "environment": {"device": "NVIDIA H100 80GB HBM3"},
        "rows": [{"batch": b, "context": 4096, "step_ms": s, "floor_ms": f} for b, s, f in rows]
        + [{"batch": 1, "context": 131072, "step_ms": 99.0, "floor_ms": 1.0}],  # another context: left out
    }


def test_one_layer_is_the_difference_over_the_layer_difference():
    # 0.5 ms fixed + 1.0 ms a layer (floor 0.1 + 0.25 a layer) at B=1; B=16 only in the short run
    short = report(4, [(1, 4.5, 1.1), (16, 9.0, 3.0)])
    long = report(8, [(1, 8.5, 2.1)])
    p = per_layer(short, long)
    assert list(p) == [1]
    assert p[1]["layer_ms"] == pytest.approx(1.0) and p[1]["fixed_ms"] == pytest.approx(0.5)
    assert p[1]["layer_floor_ms"] == pytest.approx(0.25) and p[1]["fixed_floor_ms"] == pytest.approx(0.1)


def test_other_gpus_keep_the_ratio_and_add_two_all_reduces_a_layer():
    short, long = report(4, [(1, 4.5, 1.1)]), report(8, [(1, 8.5, 2.1)])
    rows = estimate(short, long, 43, "H100")
    measured = rows[0]
    assert measured["step_ms"] == pytest.approx(0.5 + 43) and measured["floor_ms"] == pytest.approx(0.1 + 43 * 0.25)
    for r in rows[1:]:
        scale = SPEC_TBPS["H100"] / SPEC_TBPS[r["gpu"]]
        assert r["compute_ms"] == pytest.approx(measured["step_ms"] * scale)
        nccl, tuned = ALL_REDUCE_US[r["gpu"]]
        assert r["all_reduce_ms"] == pytest.approx((86 * nccl / 1000, 86 * tuned / 1000))
        assert r["tpot_ms"][0] == pytest.approx(r["compute_ms"] + 86 * nccl / 1000)
    assert {r["gpu"] for r in rows[1:]} == {"H200", "RTX PRO 6000"}
