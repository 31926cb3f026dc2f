"""On paper, not measured: full 43-layer DeepSeek-V4-Flash decode with tensor parallelism over
GPUs of a given memory bandwidth, from the floor arithmetic of `pdserve bench-engine` and, given
its JSON, the ratio (step / floor) it measured.

    python scripts/extrapolate_engine.py [docs/bench/engine_h200_<date>_v4.json] [--tp 4] [--bandwidth 1.8e12]

Assumptions (all stated, none measured): every weight splits evenly over the TP ranks (heads,
expert intermediate dims, a vocab-parallel lm_head), the KV does not (V4 has one K=V head: each
rank reads all of it), routed experts touched as expected for uniform routing, no all-reduce
time, floor = bytes / bandwidth (decode at these batches is bytes-bound). Two weight formats:
bf16 (what the engine runs today) and the released one (FP8 e4m3 matrices with 128x128 scales,
FP4 e2m1 experts with a ue8m0 scale per 32 values: what issue 13 item 3 keeps on the GPU).
"""

from __future__ import annotations

import argparse
import json

import torch

from pdserve.bench.engine.floor import step_cost
from pdserve.bench.engine.models import bench_config
from pdserve.bench.engine.plan import meta_model
from pdserve.model.config import ModelConfig


def released_bytes(name: str, p: torch.Tensor) -> float:
    """Bytes of a parameter in V4-Flash's released checkpoint."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return p.numel() * (0.5 + 1 / 32)  # e2m1 + one ue8m0 byte per 32
    replicated_bf16 = ("embed_tokens", "lm_head", "mlp.gate.weight")
    if p.dim() == 2 and p.dtype == torch.bfloat16 and not any(k in name for k in replicated_bf16):
        return p.numel() * (1 + 4 / 128**2)  # e4m3 + one float scale per 128 x 128
    return p.numel() * p.element_size()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("report", nargs="?", help="bench-engine JSON of v4-flash (its ratios are applied)")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--bandwidth", type=float, default=1.8e12, help="bytes/s of one GPU (RTX PRO 6000: ~1.8e12)")
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args()
    config = ModelConfig.from_dict(bench_config("v4-flash"))
    torch.set_default_dtype(torch.bfloat16)
    model = meta_model(config)
    ratios = {}
    if args.report:
        rows = json.load(open(args.report))["rows"]
        ratios = {r["batch"]: r["ratio"] for r in rows if r["context"] == args.context and "ratio" in r}
    print(f"V4-Flash, 43 layers, TP{args.tp} at {args.bandwidth / 1e12:.2f} TB/s a GPU, context {args.context}, bf16 KV (computed, not measured)")
    print("| batch | weights | GB a GPU a step | floor ms | tok/s at the floor | H200 ratio | step ms at that ratio | tok/s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in (1, 16, 64, 128):
        for label, fmt in (("bf16", None), ("FP8 + FP4 experts", released_bytes)):
            cost = step_cost(model, config, batch, args.context, 2, None, fmt)
            per_gpu = (cost.weight_bytes + cost.expert_bytes) / args.tp + cost.kv_bytes
            floor_ms = 1e3 * per_gpu / args.bandwidth
            r = ratios.get(batch)
            est = f"{r:.1f}x | {floor_ms * r:.1f} | {1e3 * batch / (floor_ms * r):.0f}" if r else "- | - | -"
            print(f"| {batch} | {label} | {per_gpu / 1e9:.2f} | {floor_ms:.2f} | {1e3 * batch / floor_ms:.0f} | {est} |")


if __name__ == "__main__":
    main()
