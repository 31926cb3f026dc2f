"""Decode-kernel benchmark:
`python -m benchmarks.kernels.bench [--quick] [--only mla|moe] [--batch B ...]
[--sweep [mla moe moe_fp8 merge latency]] [--out DIR]`.

Measures the two ceilings first (device-to-device copy bandwidth counting bytes read + written,
and an 8192^3 bf16 matmul rate), checks every kernel at tiny model dims, then for each shape
times the Triton kernel from CUDA-graph replays over rotated input sets (the headline number: no
launch overhead, no warm L2) and with `triton.testing.do_bench` ("eager"), the per-head baseline
(sparse MLA) and the torch reference with `do_bench`, checks each against the fp32 reference
(relative L2 error), and prints time, floor = max(bytes / bandwidth, flops / matmul rate) and
time / floor. Rows: `bench_mla.py` (sparse MLA, bf16 and FP8 KV) and `bench_moe.py` (fused MoE,
bf16 and FP8 weights). `--sweep` also times candidate configs: tiles ("mla", "moe", "moe_fp8")
split counts with the merge fused or in a second launch ("merge"), B = 1 tiles and splits
("latency"); bare `--sweep` runs all.
Writes bench.md and bench.json to --out (default $OUT, else the working directory).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch

from benchmarks.kernels.bench_mla import mla_rows
from benchmarks.kernels.bench_moe import moe_rows
from benchmarks.kernels.bench_util import ms, poisoned_empty, rel_err
from pdserve_kernels import kv_fp8, ref, ref_fp8
from pdserve_kernels.fused_moe import fused_moe
from pdserve_kernels.fused_moe_fp8 import fused_moe_fp8
from pdserve_kernels.indexer import indexer_topk
from pdserve_kernels.sparse_mla import sparse_mla_decode, sparse_mla_decode_fp8

SWEEPS = ("mla", "moe", "moe_fp8", "merge", "latency")


def ceilings() -> tuple[float, float]:
    """(copy bytes/s counting read + write, bf16 matmul flop/s)."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src)) * 1e-3
    bw = 2 * src.numel() * 4 / t
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = ms(lambda: a @ b, rep=200) * 1e-3
    return bw, 2 * 8192**3 / t


def check_tiny(dev: str) -> list[str]:
    """Tiny model dims on the GPU: non-power-of-two D and d_v, sinks, padding, fp8, MoE, indexer."""
    lines = []
    g = torch.Generator(device=dev).manual_seed(1)
    for dt in (torch.bfloat16, torch.float16):
        B, S, H, D, dv, K, N = 3, 2, 4, 80, 64, 37, 500
        q = torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g)
        kv = torch.randn(N, D + 16, device=dev, dtype=dt, generator=g)[:, :D]
        idx = torch.randint(0, N, (B, S, K), device=dev, dtype=torch.int32, generator=g)
        idx[0, 0, ::4] = -1
        idx[2, 1] = -1
        sink = torch.randn(H, device=dev, generator=g)
        for sk in (None, sink):
            with poisoned_empty():
                out, lse = sparse_mla_decode(q, kv, idx, D**-0.5, dv, sink=sk)
            r_out, r_lse = ref.sparse_mla_decode_ref(
                q.double(), kv.double(), idx, D**-0.5, dv, sink=None if sk is None else sk.double()
            )
            fin = torch.isfinite(r_lse)
            lse_ok = torch.equal(fin, torch.isfinite(lse)) and bool(
                ((lse.double() - r_lse.double())[fin].abs() < 2e-2).all()
            )
            lines.append(
                f"tiny sparse_mla {dt} sink={sk is not None}: rel {rel_err(out, r_out):.2e}"
                f" lse_ok {lse_ok} nan {bool(out.isnan().any())}"
            )
    q = torch.randn(2, 1, 16, 576, device=dev, dtype=torch.bfloat16, generator=g)
    kvf = torch.randn(300, 576, device=dev, generator=g)
    rec = kv_fp8.pack_kv_fp8(kvf, 512)
    idx = torch.randint(0, 300, (2, 1, 100), device=dev, dtype=torch.int32, generator=g)
    idx[1, 0, 50:] = -1
    with poisoned_empty():
        out, lse = sparse_mla_decode_fp8(q, rec, idx, 576**-0.5, 512)
    r_out, _ = kv_fp8.sparse_mla_decode_fp8_ref(q.double(), rec, idx, 576**-0.5, 512)
    lines.append(f"fp8 sparse_mla 576/512: rel {rel_err(out, r_out):.2e}")
    T, E, k, hid, inter = 5, 8, 2, 128, 64
    x = torch.randn(T, hid, device=dev, dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(E, 2 * inter, hid, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
    w2 = torch.randn(E, hid, inter, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
    ids = torch.stack([torch.randperm(E - 1, device=dev)[:k] for _ in range(T)]).int()
    tw = torch.rand(T, k, device=dev, generator=g)
    with poisoned_empty():
        y = fused_moe(x, w13, w2, tw, ids)
    r = ref.fused_moe_ref(x.double(), w13.double(), w2.double(), tw.double(), ids)
    lines.append(f"tiny fused_moe E=8 hidden=128 I=64 bf16: rel {rel_err(y, r):.2e}")
    hid, inter = 384, 256
    x = torch.randn(T, hid, device=dev, dtype=torch.bfloat16, generator=g)
    (q13, s13), (q2, s2) = (
        ref_fp8.quant_block_fp8(torch.randn(E, n, k, device=dev, generator=g) * k**-0.5)
        for n, k in ((2 * inter, hid), (hid, inter))
    )
    with poisoned_empty():
        y = fused_moe_fp8(x, q13, q2, s13, s2, tw, ids)
    r = ref_fp8.fused_moe_fp8_ref(x.double(), q13, q2, s13, s2, tw.double(), ids, act_dtype=x.dtype)
    lines.append(f"tiny fused_moe_fp8 E=8 hidden=384 I=256 128x128 blocks bf16: rel {rel_err(y, r):.2e}")
    qi = torch.randn(4, 8, 64, device=dev, dtype=torch.bfloat16, generator=g)
    kc = torch.randn(200, 64, device=dev, dtype=torch.bfloat16, generator=g)
    wi = torch.randn(4, 8, device=dev, generator=g)
    cand = torch.randint(0, 200, (4, 90), device=dev, dtype=torch.int32, generator=g)
    cand[3, 30:] = -1
    got = indexer_topk(qi, kc, wi, cand, 40)
    want_scores = torch.einsum(
        "th,thc->tc",
        wi.double(),
        torch.relu(torch.einsum("thd,tcd->thc", qi.double(), kc.double()[cand.clamp(min=0).long()])),
    )
    want_scores = want_scores.masked_fill(cand < 0, float("-inf"))
    pos = {}
    ok = True
    for t in range(4):
        pos = {int(c): i for i, c in enumerate(cand[t].tolist()) if c >= 0}
        picked = [pos[int(c)] for c in got[t].tolist() if c >= 0]
        top = want_scores[t].topk(40).values
        ok &= torch.allclose(
            want_scores[t, picked].sort(descending=True).values, top[torch.isfinite(top)], rtol=2e-2, atol=2e-2
        )
    lines.append(f"tiny indexer_topk bf16: scores match {ok}")
    return lines


def table(rows) -> str:
    lines = [
        "| kernel | shape | impl | median us | floor us | x floor | rel err | note |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    lines += [row_line(r) for r in rows]
    return "\n".join(lines)


def row_line(r: dict) -> str:
    return (
        f"| {r['kernel']} | {r['shape']} | {r['impl']} | {r['ms'] * 1e3:.1f} | "
        f"{r['floor_ms'] * 1e3:.1f} | {r['ms'] / r['floor_ms']:.2f} | {r['rel_err']:.1e} | "
        f"{r['note']} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep", nargs="*", choices=SWEEPS, help="candidate configs to time too")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8-KV sparse MLA rows")
    ap.add_argument("--only", choices=["mla", "moe"], help="one kernel family")
    ap.add_argument("--batch", type=int, nargs="+", help="only these B (sparse MLA) / T (MoE)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    sweeps = set(SWEEPS if args.sweep == [] else args.sweep or ())
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA device")
    prop = torch.cuda.get_device_properties(0)
    head = (
        f"{prop.name}, {prop.multi_processor_count} SMs, cc {prop.major}.{prop.minor}, "
        f"torch {torch.__version__}, {datetime.date.today()}"
    )
    print(head, flush=True)
    bw, peak = ceilings()
    head += f"\ncopy {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {peak / 1e12:.0f} TFLOP/s"
    print(head, flush=True)
    checks = check_tiny("cuda")
    print("\n".join(checks), flush=True)
    t0 = time.time()
    rows, prof = [], []
    emit = lambda r: print(row_line(r), flush=True)  # noqa: E731  (rows as they come: a cut-off run keeps them)
    os.makedirs(args.out, exist_ok=True)

    def save() -> None:
        text = f"{head}\n\n" + "\n".join(checks + prof) + f"\n\n{table(rows)}\n"
        with open(os.path.join(args.out, "bench.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(dict(head=head, checks=checks, profile=prof, rows=rows), f, indent=1)

    if args.only in (None, "mla"):
        rows += mla_rows(bw, peak, args.quick, sweeps, not args.no_fp8, prof, emit, args.batch)
        save()
    if args.only in (None, "moe"):
        rows += moe_rows(bw, peak, args.quick, sweeps, prof, emit, args.batch)
    print("\n".join(prof), flush=True)
    save()
    print(f"\n{table([r for r in rows if r['impl'].startswith(('triton', 'per-head', 'torch'))])}")
    print(f"done in {time.time() - t0:.0f}s; wrote {args.out}/bench.md", flush=True)


if __name__ == "__main__":
    main()
