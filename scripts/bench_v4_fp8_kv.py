"""DeepSeek-V4-Flash sparse decode over FP8 KV pages ("fp8_ds_v4", 584 B a token) against the
bf16-record kernel (1024 B a token) on one GPU: error against the fp32 reference, time, bytes floor.

Shapes: D = d_v = 512 (K = V), K = 640 keys a query (window 128 + top-512 CSA entries), float32
sinks, 5% of the indices -1, a pool of 262144 tokens (bf16: [N, 512]; fp8: pages of 64 records,
the pool's, and of 1, gathered records). Time: the median of CUDA-graph replays over 16 index sets
(a decode step under graphs; rotating sets keep the gathered rows out of a warm L2) and
`triton.testing.do_bench` of the eager call (Python launch included). Floor: bytes / measured
copy rate, bytes = gathered records + q + out + indices.

    python scripts/bench_v4_fp8_kv.py [--json PATH] [--sweep]
    TRITON_INTERPRET=1 python scripts/bench_v4_fp8_kv.py --cpu  # checks only, tiny pool, no timing
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess

import torch
import triton
from triton.runtime.errors import OutOfResources

from pdserve_kernels import configs, kv_fp8, ref, sparse_mla
from pdserve_kernels._launch import capability, sm_count
from pdserve_kernels.bench_util import graph_ms, ms, poisoned_empty, rel_err
from pdserve_kernels.sparse_mla import sparse_mla_decode, sparse_mla_decode_fp8_v4

N, D, ROPE, K = 262144, 512, 64, 640
SHAPES = [(64, 64), (64, 16), (64, 1), (16, 64), (16, 1)]  # (H, B): all heads; 16 a TP4 rank
C = configs.MLAConfig
SWEEP = [C(16, 32, 4, 1, min_tiles=1), C(64, 32, 8, 1)]
SWEEP_SHAPES = [(64, 1), (64, 16), (64, 64), (16, 64)]


def copy_rate() -> float:
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (ms(lambda: dst.copy_(src)) * 1e-3)


def rotating(calls):
    """One callable that runs the next of `calls` each time (do_bench over fresh index sets)."""
    state = {"i": 0}

    def run():
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="docs/bench/v4_fp8_kv_h200.json")
    ap.add_argument("--sweep", action="store_true", help="also time a few tiles of the fp8 kernel")
    ap.add_argument("--cpu", action="store_true", help="interpreter dry run: 4096 tokens, H=16 B=1, no timing")
    a = ap.parse_args()
    dev, n, shapes = ("cpu", 4096, [(16, 1)]) if a.cpu else ("cuda", N, SHAPES)
    dtype = torch.float16 if a.cpu else torch.bfloat16  # the interpreter's bf16 dot is wrong
    g = torch.Generator(device=dev).manual_seed(0)
    bw = 1e12 if a.cpu else copy_rate()
    kv = torch.randn(n, D, device=dev, generator=g).to(dtype)
    pages64 = kv_fp8.pack_kv_fp8_v4(kv, page=64)
    pages1 = kv_fp8.gather_kv_fp8_v4(pages64, torch.arange(n, device=dev))
    keys_fp8 = kv_fp8.unpack_kv_fp8_v4(pages64)  # [N, D] float32, what both fp8 layouts hold
    assert torch.equal(keys_fp8, kv_fp8.unpack_kv_fp8_v4(pages1))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = dict(device="cpu (interpreter)" if a.cpu else torch.cuda.get_device_name(0), date=datetime.date.today().isoformat(),
                commit=commit or None, torch=torch.__version__, triton=triton.__version__, copy_tb_s=round(bw / 1e12, 3),
                shapes=f"D = d_v = {D} (rope {ROPE}), K = {K}, pool {n} tokens, sinks, 5% -1")
    rows = []
    for H, B in shapes:
        q = torch.randn(B, 1, H, D, device=dev, generator=g).to(dtype)
        sink = torch.randn(H, device=dev, generator=g)
        sets = []
        for _ in range(16):
            idx = torch.randint(0, n, (B, 1, K), device=dev, dtype=torch.int32, generator=g)
            sets.append(torch.where(torch.rand(B, 1, K, device=dev, generator=g) < 0.05, -1, idx).to(torch.int32))
        idx, scale = sets[0], D**-0.5
        want_bf16 = ref.sparse_mla_decode_ref(q.float(), kv.float(), idx, scale, D, sink=sink)[0]
        want_fp8 = ref.sparse_mla_decode_ref(q.float(), keys_fp8, idx, scale, D, sink=sink)[0]
        small = B * H * D * 2 * 2 + B * K * 4  # q + out + indices
        impls = [("bf16", 1024, lambda i, c=None: sparse_mla_decode(q, kv, i, scale, D, sink=sink, config=c), want_bf16),
                 ("fp8_v4 P=64", 584, lambda i, c=None: sparse_mla_decode_fp8_v4(q, pages64, i, scale, ROPE, sink=sink, config=c), want_fp8),
                 ("fp8_v4 P=1", 584, lambda i, c=None: sparse_mla_decode_fp8_v4(q, pages1, i, scale, ROPE, sink=sink, config=c), want_fp8)]
        cfgs = {"bf16": [None], "fp8_v4 P=64": [None] + (SWEEP if a.sweep and (H, B) in SWEEP_SHAPES else []), "fp8_v4 P=1": [None]}
        for name, rec, fn, want in impls:
            for cfg in cfgs[name]:
                try:
                    with poisoned_empty():
                        out, lse = fn(idx, cfg)
                except OutOfResources as e:  # a sweep tile may not fit: a finding
                    print(f"H={H} B={B} {name} {cfg}: {e}", flush=True)
                    continue
                info = sparse_mla.LAST_COMPILED.get("split")
                floor_us = (B * K * rec + small) / bw * 1e6
                graph_us = float("nan") if a.cpu else graph_ms([lambda i=i: fn(i, cfg) for i in sets]) * 1e3
                eager_us = float("nan") if a.cpu else ms(rotating([lambda i=i: fn(i, cfg) for i in sets])) * 1e3
                cc = capability(q.device)
                used = cfg or configs.mla_config(cc, "bf16" if name == "bf16" else "fp8_v4", H, B, has_tail=False)
                splits = sparse_mla.num_splits(B, triton.cdiv(H, used.block_h), triton.cdiv(K, used.block_n),
                                               sm_count(q.device), used)
                row = dict(kernel=name, H=H, B=B, K=K, config="default" if cfg is None else dataclasses.asdict(cfg),
                           tile=f"BH{used.block_h} BN{used.block_n} w{used.num_warps} s{used.num_stages} P={splits}",
                           graph_us=round(graph_us, 2), do_bench_us=round(eager_us, 2), floor_us=round(floor_us, 2),
                           x_floor=round(graph_us / floor_us, 2), rel_err=rel_err(out, want),
                           rel_err_vs_bf16_keys=rel_err(out, want_bf16), nan=bool(out.isnan().any()),
                           regs=getattr(info, "n_regs", None), spills=getattr(info, "n_spills", None),
                           smem=getattr(info, "metadata", None) and info.metadata.shared)
                rows.append(row)
                print(f"H={H:3d} B={B:3d} {name:12s} {row['tile']:22s} graph {graph_us:7.1f} us  do_bench {eager_us:7.1f} us  "
                      f"floor {floor_us:6.1f} us ({row['x_floor']:5.2f}x)  rel {row['rel_err']:.1e} (vs bf16 keys "
                      f"{row['rel_err_vs_bf16_keys']:.1e})  regs {row['regs']} spills {row['spills']} smem {row['smem']}", flush=True)
        with open(a.json, "w") as f:  # after every shape: a run cut short keeps what it measured
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"copy {bw / 1e12:.2f} TB/s; JSON {a.json}")


if __name__ == "__main__":
    main()
