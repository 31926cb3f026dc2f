"""The whole DeepSeek-V4-Flash decode step at tensor parallelism, computed from measured shards.

    pdserve bench-engine --model v4-flash --dtype fp4 --tp-shard 4 --num-layers 4 --out short.json
    pdserve bench-engine --model v4-flash --dtype fp4 --tp-shard 4 --num-layers 8 --out long.json
    python -m benchmarks.engine.full_model_estimate short.json long.json [--layers 43]

What is measured and what is computed:

- measured (the two runs, one GPU, one rank's share of a TP-N worker as pdserve splits it): per
  batch size, the step and its floor at two layer counts. Their difference over the layer
  difference is one layer's time (and floor); the rest is the step's fixed part (embedding,
  lm_head, sampling, the graph launch).
- computed: `layers` layers + the fixed part on the measured GPU; then on other GPUs by keeping
  each row's measured ratio to its floor and moving the floor to that GPU's copy rate (the
  measured GPU's copy rate times the bandwidth ratio of the two parts' specifications); plus the
  all-reduces, 2 a layer (attention output, MoE output: B x hidden bf16 each), at a published
  NCCL latency per interconnect (ALL_REDUCE_US, with where each figure comes from).

The layer mix of short and long runs follows bench-engine's released proportions; the real
model's 2 sliding / 21 CSA / 20 HCA layers are approximated by the per-layer average of the
difference. Nothing here is a measurement of a TP worker: pdserve's TP>1 decode also runs
without CUDA graphs today, which this estimate does not charge.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Specification HBM / GDDR bandwidth (TB/s): the ratio moves a measured copy rate to another part.
SPEC_TBPS = {"H100": 3.35, "H200": 4.8, "RTX PRO 6000": 1.8}

# Published NCCL all-reduce latencies for messages up to ~64 KB (us), per interconnect:
# - NVLink (H100/H200 class): 16.7 us at 4 KB, nccl-tests all_reduce_perf on 8 x H20 with NVLink,
#   default NCCL (github.com deepseek-ai/DeepEP issue 303); 2.3 us at 8 B with NCCL 2.27's
#   symmetric memory tuned on 8 x H200 (github.com NVIDIA/nccl issue 1940).
# - PCIe Gen5 (RTX PRO 6000, no NVLink): 24.2 us at 8 KB, 24.1 us at 64 KB with NCCL, 9.2 us at
#   8 KB with a one-shot custom all-reduce, 8 GPUs behind PCIe switches (github.com
#   voipmonitor/rtx6kpro, hardware/pcie-bandwidth.md).
ALL_REDUCE_US = {"H200": (16.7, 2.3), "RTX PRO 6000": (24.2, 9.2)}
ALL_REDUCES_PER_LAYER = 2


def per_layer(short: dict, long: dict) -> dict[int, dict[str, float]]:
    """Per batch size (context rows of the common context): one layer's step and floor ms, the
    fixed part's, and the measured ratio."""
    n_s, n_l = short["settings"]["num_layers"], long["settings"]["num_layers"]
    if n_l <= n_s:
        raise SystemExit(f"the second run needs more layers than the first ({n_l} <= {n_s})")
    context = short["settings"]["context"]
    rows = {r["batch"]: r for r in short["rows"] if r["context"] == context and "error" not in r}
    out = {}
    for r in long["rows"]:
        if r["context"] != context or r["batch"] not in rows or "error" in r:
            continue
        s = rows[r["batch"]]
        layer = (r["step_ms"] - s["step_ms"]) / (n_l - n_s)
        floor = (r["floor_ms"] - s["floor_ms"]) / (n_l - n_s)
        out[r["batch"]] = {
            "layer_ms": layer,
            "layer_floor_ms": floor,
            "fixed_ms": s["step_ms"] - n_s * layer,
            "fixed_floor_ms": s["floor_ms"] - n_s * floor,
        }
    return out


def estimate(short: dict, long: dict, layers: int, measured_on: str) -> list[dict]:
    """Rows: batch, GPU, compute ms, all-reduce ms (NCCL default / tuned), TPOT ms (both)."""
    copy = short["ceilings"]["copy_bytes_per_s"]
    hidden = 4096
    rows = []
    for b, p in sorted(per_layer(short, long).items()):
        step = p["fixed_ms"] + layers * p["layer_ms"]
        floor = p["fixed_floor_ms"] + layers * p["layer_floor_ms"]
        ratio = step / floor
        rows.append(dict(batch=b, gpu=measured_on + " (measured shards)", step_ms=step, floor_ms=floor, ratio=ratio))
        for gpu, (ar_default, ar_tuned) in ALL_REDUCE_US.items():
            scale = SPEC_TBPS[measured_on] / SPEC_TBPS[gpu]  # the floor is bytes-bound at these batches
            compute = ratio * floor * scale
            n = ALL_REDUCES_PER_LAYER * layers
            rows.append(
                dict(
                    batch=b,
                    gpu=gpu,
                    copy_tbps=copy / 1e12 / scale,
                    compute_ms=compute,
                    message_kib=b * hidden * 2 / 1024,
                    all_reduce_ms=(n * ar_default / 1000, n * ar_tuned / 1000),
                    tpot_ms=(compute + n * ar_default / 1000, compute + n * ar_tuned / 1000),
                )
            )
    return rows


def table(rows: list[dict], layers: int, tp: int) -> str:
    lines = [
        f"| B | GPU | {layers}-layer compute ms (x floor) | all-reduces ({2 * layers}) ms: NCCL / tuned | "
        "TPOT ms: NCCL / tuned |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "step_ms" in r:
            lines.append(f"| {r['batch']} | {r['gpu']}, TP{tp} rank | {r['step_ms']:.2f} ({r['ratio']:.1f}x) | - | - |")
        else:
            ar, tpot = r["all_reduce_ms"], r["tpot_ms"]
            lines.append(
                f"| {r['batch']} | {r['gpu']} ({r['copy_tbps']:.2f} TB/s) | {r['compute_ms']:.2f} | "
                f"{ar[0]:.2f} / {ar[1]:.2f} | {tpot[0]:.2f} / {tpot[1]:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("short", type=Path, help="bench-engine JSON of the shard at fewer layers")
    p.add_argument("long", type=Path, help="the same at more layers")
    p.add_argument("--layers", type=int, default=43, help="the whole model's layers (V4-Flash: 43)")
    p.add_argument("--measured-on", choices=sorted(SPEC_TBPS), help="default: from the report's device name")
    args = p.parse_args()
    short, long = json.loads(args.short.read_text()), json.loads(args.long.read_text())
    device = short["environment"]["device"]
    on = args.measured_on or next((k for k in ("H200", "H100") if k in device), None)
    if on is None:
        raise SystemExit(f"name the measured part with --measured-on (device {device!r})")
    tp = short["settings"].get("tp_shard", 1)
    print(
        f"measured on {device}; TP{tp} shards of {short['settings']['model']}, quantization {short['settings']['quantization']}"
    )
    print(table(estimate(short, long, args.layers, on), args.layers, tp))


if __name__ == "__main__":
    main()
