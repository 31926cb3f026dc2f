"""Block-scaled FP8 GEMM (`fp8_gemm.fp8_linear`) on the GPU at DeepSeek-V3.2's projection shapes:
correctness against `ref_fp8.fp8_linear_ref` (bf16 x, float32 math), time against the floor and
against two baselines in the same run.

    python -m benchmarks.kernels.bench_fp8_gemm [--rows 1 16 64 128 2048] [--sweep] [--out DIR]
    python -m benchmarks.kernels.bench_fp8_gemm --smoke     # CPU, interpreter, small dims: the code path only

Floor: max(bytes / copy rate, 2 M N K / bf16 matmul rate), bytes = the weight as stored (1 byte a
value + float32 scale per 128 x 128 block) + x + y in bf16; rates measured here (`bench.ceilings`).
Baselines: "naive" dequantizes the weight to bf16 and multiplies (torch), every call; "bf16" is a
torch matmul on a weight already dequantized at load (the engine without FP8 weights).
Times: median of CUDA-graph replays (`bench_util.graph_ms`) over enough weight copies that they
exceed the 50 MB L2. Writes fp8_gemm.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os

import torch
import torch.nn.functional as F

from benchmarks.kernels.bench_util import graph_ms, poisoned_empty, rel_err
from pdserve_kernels import configs, ref_fp8
from pdserve_kernels.fp8_gemm import fp8_linear

# (name, N, K) of DeepSeek-V3.2's projections at tensor-parallel size 1
SHAPES = [
    ("q_a_proj", 1536, 7168),
    ("kv_a_proj_with_mqa", 576, 7168),
    ("q_b_proj", 24576, 1536),
    ("o_proj", 7168, 16384),
    ("mlp.gate_proj", 18432, 7168),
    ("mlp.down_proj", 7168, 18432),
    ("indexer.wq_b", 8192, 1536),
]
SMOKE_SHAPES = [("small", 96, 160), ("odd", 75, 300)]
L2_BYTES = 50 * 2**20
C = configs.Fp8GemmConfig
SWEEP = {  # candidates by M bucket, timed on o_proj and q_a_proj with --sweep (BN: the MMA's M side)
    "decode": [
        C(16, 64, 128, 4, 4),
        C(16, 128, 128, 4, 4),
        C(16, 128, 128, 8, 4),
        C(16, 64, 128, 4, 6),
        C(16, 128, 128, 4, 4, waves=4),
        C(16, 64, 128, 4, 4, waves=8),
        C(16, 128, 128, 4, 4, fp8_act=True),
        C(16, 256, 128, 8, 3),
    ],
    "mid": [
        C(64, 64, 128, 4, 4),
        C(64, 128, 128, 4, 3),
        C(64, 128, 128, 8, 3),
        C(32, 128, 128, 4, 4),
        C(64, 128, 128, 4, 3, fp8_act=True),
        C(64, 128, 128, 8, 3, dequant=True),
    ],
    "prefill": [
        C(128, 128, 128, 8, 3, fp8_act=True),
        C(128, 128, 128, 8, 3),
        C(128, 128, 64, 8, 4),
        C(64, 128, 128, 4, 3),
        C(128, 256, 128, 8, 3, fp8_act=True),
        C(128, 128, 128, 8, 3, dequant=True),
    ],
}


def _weights(N: int, K: int, dev: str, g: torch.Generator, copies: int):
    """`copies` independent random FP8 weights [N, K] with scales, and one bf16 dequantized."""
    out = []
    for _ in range(copies):
        w = torch.randn(N, K, device=dev, generator=g) * K**-0.5
        out.append(ref_fp8.quant_block_fp8(w))
    return out


def _bucket(M: int) -> str:
    return "decode" if M <= 16 else "mid" if M <= 256 else "prefill"


def run(args) -> dict:
    dev = "cpu" if args.smoke else "cuda"
    g = torch.Generator(device=dev).manual_seed(3)
    if args.smoke:
        bw, mm = 1e11, 1e12
    else:
        from benchmarks.kernels.bench import ceilings

        bw, mm = ceilings()
    print(f"copy {bw / 1e12:.3g} TB/s (read+write), bf16 matmul {mm / 1e12:.4g} TFLOP/s", flush=True)
    rows = []
    print("| shape | M | err | fp8 us | floor us | x floor | naive us | bf16 us | vs bf16 |", flush=True)
    for name, N, K in SMOKE_SHAPES if args.smoke else SHAPES:
        wbytes = N * K + 4 * -(-N // 128) * -(-K // 128)
        copies = 1 if args.smoke else max(1, -(-2 * L2_BYTES // wbytes))
        ws = _weights(N, K, dev, g, copies)
        w16 = [ref_fp8.dequant_block_fp8(q, s, (128, 128), torch.bfloat16) for q, s in ws]
        for M in args.rows:
            x = torch.randn(M, K, device=dev, generator=g).to(
                torch.float16 if args.smoke else torch.bfloat16
            )  # interpreter: no bf16 dots
            cfg = configs.fp8_gemm_config(90 if not args.smoke else 0, M, x.dtype)
            with poisoned_empty():
                y = fp8_linear(x, *ws[0])
            want = ref_fp8.fp8_linear_ref(x, *ws[0], act_quant=cfg.fp8_act)
            row = dict(
                shape=name,
                N=N,
                K=K,
                M=M,
                config=dataclasses.asdict(cfg),
                rel_err=rel_err(y, want),
                nan=bool(y.isnan().any()),
            )
            floor_s = max((wbytes + 2 * M * (K + N)) / bw, 2 * M * N * K / mm)  # bw: bytes moved a second
            row["floor_us"] = 1e6 * floor_s
            if not args.smoke:
                row["fp8_us"] = 1e3 * graph_ms([lambda q=q, s=s: fp8_linear(x, q, s) for q, s in ws])
                row["naive_us"] = 1e3 * graph_ms(
                    [
                        lambda q=q, s=s: x @ ref_fp8.dequant_block_fp8(q, s, (128, 128), torch.bfloat16).t()
                        for q, s in ws
                    ]
                )
                row["bf16_us"] = 1e3 * graph_ms([lambda w=w: F.linear(x, w) for w in w16])
                row["x_floor"] = row["fp8_us"] / row["floor_us"]
                if args.sweep and name in ("o_proj", "q_a_proj") and M in (1, 64, 2048):
                    row["sweep"] = [
                        dict(
                            config=dataclasses.asdict(c),
                            us=1e3 * graph_ms([lambda q=q, s=s, c=c: fp8_linear(x, q, s, config=c) for q, s in ws]),
                        )
                        for c in SWEEP[_bucket(M)]
                    ]
            rows.append(row)
            print(
                f"| {name} | {M} | {row['rel_err']:.1e} | {row.get('fp8_us', 0):.1f} | {row['floor_us']:.1f} | "
                f"{row.get('x_floor', 0):.2f} | {row.get('naive_us', 0):.1f} | {row.get('bf16_us', 0):.1f} | "
                f"{row.get('bf16_us', 0) / row.get('fp8_us', 1):.2f}x |",
                flush=True,
            )
            for sw in row.get("sweep", []):
                print(f"    sweep {sw['config']}: {sw['us']:.1f} us", flush=True)
        del ws, w16
    return dict(
        device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        torch=torch.__version__,
        copy_bytes_per_s=bw,
        matmul_flops_per_s=mm,
        rows=rows,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 2048])
    ap.add_argument(
        "--sweep", action="store_true", help="time other tile configs at o_proj / q_a_proj, M = 1, 64, 2048"
    )
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.smoke:
        args.rows = [1, 5]
    report = run(args)
    bad = [r for r in report["rows"] if r["nan"] or r["rel_err"] > 2e-2]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_gemm.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"{len(report['rows'])} rows, {len(bad)} over the error bound; wrote {args.out}/fp8_gemm.json")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
