"""MLA prefill attention on the GPU: the Triton kernel (pdserve_kernels.mla_prefill) against its
flop floor, PyTorch SDPA's backends, and the decode kernel run one query at a time.

    python -m benchmarks.engine.bench_prefill [--tokens 8192] [--heads 128,16] [--json out.json]

Dims are DeepSeek-V3 / V3.2's (their attention is the same): qk head dim 192 = 128 nope + 64 rope,
v head dim 128, kv_lora_rank 512; 128 heads (one GPU) and 16 (one rank of TP8). Floor = causal
attention flops (2 * H * T(T+1)/2 * (192 + 128)) / the bf16 matmul rate measured in this run.
Times: triton.testing.do_bench medians (ms). Checks first: each variant against a float32
reference at 1024 tokens (relative L2), outputs poisoned with NaN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from pdserve_kernels import configs  # noqa: E402
from pdserve_kernels.mla_prefill import mla_prefill_attention  # noqa: E402

DN, R, DV, C = 128, 64, 128, 512
VARIANTS = {  # (block_m, block_n, warps, stages)
    "m128n64w8s2": configs.PrefillConfig(128, 64, 8, 2),
    "m128n64w8s3": configs.PrefillConfig(128, 64, 8, 3),
    "m128n128w8s2": configs.PrefillConfig(128, 128, 8, 2),
    "m64n64w4s3": configs.PrefillConfig(64, 64, 4, 3),
    "m128n32w4s3": configs.PrefillConfig(128, 32, 4, 3),
}


def ceilings() -> tuple[float, float]:
    """bf16 matmul TFLOP/s (8192^3, random data) and copy TB/s (read + written)."""  # ms: 1e9 B/ms = TB/s
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    ms_c = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * n**3 / ms / 1e9, 2 * x.numel() / ms_c / 1e9


def inputs(T: int, H: int, prefix: int = 0, dtype=torch.bfloat16):
    """q [T, H, 192]; k_nope / v strided views of one [S, H, 256] (kv_b_proj's output); k_rope [S, 64]."""
    S = prefix + T
    q = torch.randn(T, H, DN + R, device="cuda", dtype=dtype)
    kv = torch.randn(S, H, DN + DV, device="cuda", dtype=dtype)
    k_rope = torch.randn(S, R, device="cuda", dtype=dtype)
    cu_q = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, S], dtype=torch.int32, device="cuda")
    return q, kv[..., :DN], k_rope, kv[..., DN:], cu_q, cu_k


def reference(q, k_nope, k_rope, v, prefix: int) -> torch.Tensor:
    """float32 causal attention with the chunk's queries at positions prefix.. (math SDPA)."""
    H, T, S = q.shape[1], q.shape[0], k_nope.shape[0]
    k = torch.cat([k_nope, k_rope[:, None].expand(-1, H, -1)], -1).float()
    mask = torch.arange(S, device="cuda")[None, :] <= (prefix + torch.arange(T, device="cuda"))[:, None]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            q.float().transpose(0, 1),
            k.transpose(0, 1),
            v.float().transpose(0, 1),
            attn_mask=mask,
            scale=(DN + R) ** -0.5,
        )
    return out.transpose(0, 1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.isnan().any():
        return float("nan")
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def triton_call(args, T: int, S: int, cfg):
    q, k_nope, k_rope, v, cu_q, cu_k = args
    return lambda: mla_prefill_attention(q, k_nope, k_rope, v, cu_q, cu_k, T, (DN + R) ** -0.5, config=cfg)[0]


def sdpa_calls(args, H: int):
    """Each SDPA backend on [1, H, T, D] views, whole-prompt causal (no prefix: SDPA's causal mask
    is top-left aligned). flash needs equal qk / v dims: v padded to 192 there (and sliced)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k_nope, k_rope, v, _, _ = args
    k = torch.cat([k_nope, k_rope[:, None].expand(-1, H, -1)], -1)
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    vpad = F.pad(v, (0, DN + R - DV)).transpose(0, 1)[None]
    calls = {}
    for name, backend in (
        ("sdpa flash (v padded)", SDPBackend.FLASH_ATTENTION),
        ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("sdpa flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa cudnn (v padded)", SDPBackend.CUDNN_ATTENTION),
    ):
        vv = vpad if "padded" in name else vh

        def call(backend=backend, vv=vv, pad="padded" in name):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(qh, kh, vv, is_causal=True, scale=(DN + R) ** -0.5)
            return (o[..., :DV] if pad else o)[0].transpose(0, 1)

        calls[name] = call
    return calls


def decode_path_call(args, T: int):
    """Prefill through the decode kernel: absorbed queries [T, 1, H, 576] through sparse_mla_decode, each over its
    causal context (slot ids 0..t, -1 after) in a [T, 576] latent cache."""
    from pdserve_kernels import sparse_mla_decode

    H = args[0].shape[1]
    q = torch.randn(T, 1, H, C + R, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(T, C + R, device="cuda", dtype=torch.bfloat16)
    col = torch.arange(T, device="cuda", dtype=torch.int32)
    idx = torch.where(col[None, :] <= col[:, None], col[None, :], -1)[:, None]  # [T, 1, T]
    return lambda: sparse_mla_decode(q, kv, idx, (DN + R) ** -0.5, C)[0]


def check(H: int, rows: list) -> None:
    """Every variant against the float32 reference at 1024 tokens, whole and after a 700-token prefix."""
    for prefix in (0, 700):
        args = inputs(1024 - prefix if prefix else 1024, H, prefix)
        want = reference(*args[:4], prefix)
        for name, cfg in VARIANTS.items():
            out = triton_call(args, args[0].shape[0], args[1].shape[0], cfg)()
            rows.append(dict(check=f"triton {name}", H=H, prefix=prefix, rel=rel(out, want)))
        if prefix == 0:
            for name, call in sdpa_calls(args, H).items():
                try:
                    rows.append(dict(check=name, H=H, prefix=0, rel=rel(call(), want)))
                except RuntimeError as e:
                    rows.append(dict(check=name, H=H, prefix=0, error=str(e).splitlines()[0][:160]))


def timings(T: int, H: int, peak: float, naive: bool) -> list[dict]:
    pairs = T * (T + 1) / 2
    flops = 2 * H * pairs * (DN + R + DV)
    floor_ms = flops / peak / 1e9
    rows = []

    def add(name, fn, note=""):
        try:
            ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        except Exception as e:  # a backend that refuses the shapes is a finding
            rows.append(dict(T=T, H=H, variant=name, error=str(e).splitlines()[0][:160]))
            return
        rows.append(
            dict(
                T=T,
                H=H,
                variant=name,
                ms=ms,
                floor_ms=floor_ms,
                x_floor=ms / floor_ms,
                tflops=flops / ms / 1e9,
                note=note,
            )
        )

    args = inputs(T, H)
    for name, cfg in VARIANTS.items():
        add(f"triton {name}", triton_call(args, T, T, cfg))
    for name, call in sdpa_calls(args, H).items():
        add(name, call)
    # chunked: the second half of the prompt over the first half (its own flop floor)
    half = T // 2
    cargs = inputs(half, H, prefix=half)
    c_flops = 2 * H * (half * half + half * (half + 1) / 2) * (DN + R + DV)
    ms = do_bench(triton_call(cargs, half, T, configs.prefill_config(90)), warmup=25, rep=200, return_mode="median")
    rows.append(
        dict(
            T=T,
            H=H,
            variant="triton default, chunk 2 of 2 (prefix T/2)",
            ms=ms,
            floor_ms=c_flops / peak / 1e9,
            x_floor=ms / (c_flops / peak / 1e9),
            tflops=c_flops / ms / 1e9,
        )
    )
    # the expansion a chunk costs: latent [S, 512] @ kv_b_proj^T [512, H * 256]
    lat = torch.randn(T, C, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H * (DN + DV), C, device="cuda", dtype=torch.bfloat16)
    e_flops = 2 * T * C * H * (DN + DV)
    ms = do_bench(lambda: lat @ w.t(), warmup=25, rep=200, return_mode="median")
    rows.append(
        dict(
            T=T,
            H=H,
            variant="kv_b_proj expansion (matmul)",
            ms=ms,
            floor_ms=e_flops / peak / 1e9,
            x_floor=ms / (e_flops / peak / 1e9),
            tflops=e_flops / ms / 1e9,
        )
    )
    if naive:
        absorbed = 2 * H * pairs * (C + R + C)
        fn = decode_path_call(args, T)
        fn()  # compile
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        one_ms = (time.perf_counter() - t0) * 1e3
        ms = do_bench(fn, warmup=1, rep=max(50, int(one_ms * 5)), return_mode="median")
        rows.append(
            dict(
                T=T,
                H=H,
                variant="decode kernel: sparse_mla_decode per token (absorbed)",
                ms=ms,
                floor_ms=floor_ms,
                x_floor=ms / floor_ms,
                tflops=absorbed / ms / 1e9,
                note="absorbed flops 3.4x",
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", default="128,16")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    peak, copy = ceilings()
    print(f"{torch.cuda.get_device_name(0)}: bf16 matmul {peak:.0f} TFLOP/s, copy {copy:.2f} TB/s", flush=True)
    checks, rows = [], []
    heads = [int(h) for h in a.heads.split(",")]
    for H in heads:
        check(H, checks)
    for r in checks:
        print(
            f"check H={r['H']} prefix={r['prefix']} {r['check']}: "
            + (f"rel {r['rel']:.2e}" if "rel" in r else r["error"])
        )
    for i, H in enumerate(heads):
        rows += timings(a.tokens, H, peak, naive=i == 0)
        torch.cuda.empty_cache()
    print(
        "\n| T | H | variant | ms | floor ms | x floor | TFLOP/s |\n| ---: | ---: | --- | ---: | ---: | ---: | ---: |"
    )
    for r in rows:
        if "error" in r:
            print(f"| {r['T']} | {r['H']} | {r['variant']} | refused: {r['error']} | | | |")
        else:
            print(
                f"| {r['T']} | {r['H']} | {r['variant']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | {r['x_floor']:.2f} | {r['tflops']:.0f} |"
            )
    if a.json:
        meta = dict(
            device=torch.cuda.get_device_name(0),
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            torch=torch.__version__,
            triton=triton.__version__,
            matmul_tflops=peak,
            copy_tbs=copy,
        )
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, checks=checks, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
