"""DeepSeek-V4's fused glue on a GPU: each kernel against the PyTorch code the model runs on the
CPU (kernels/ref_glue.py, step.py), at V4-Flash's shapes (hidden 4096, 4 streams, 256 experts,
top-6, 64 heads of 512, bf16; the decode and verify steps' metadata at window 128, block 64,
rates 4 and 128, contexts to 4K), with the time of each in a CUDA graph (kernel vs torch); and the
launches cut since (`launch_cut_cases`: the shared expert's fused gate + up + SwiGLU, the joined bf16
GEMMs, the MoE's top-k sum) against the code they replaced.

    python scripts/gpu_v4_glue_check.py [--tokens 1,16,64,128] [--out DIR]

Low-precision outputs must be within one unit in the last place and at least 99% equal bit for
bit (98% for a compressor's entries; the bars of tests/kernels/test_kernels_v4_glue.py and
test_kernels_v4_compress.py); the router must choose the same experts (ties
aside); the decode step's integers equal (cos / sin within float32's ulp), the indexer the same slots. Writes v4_glue_check.json to --out (default $OUT or the working directory); exit status 1
if a check fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from pdserve.model import ops
from pdserve.model.deepseek_v4.compressor import CompressedKV
from pdserve.model.deepseek_v4.layers import join_rows
from pdserve.model.deepseek_v4.step import decode_group_plan, group_plan
from pdserve_kernels import ref_glue as ref
from pdserve_kernels.glue import rms_norm_rope, route, swiglu
from pdserve_kernels.mhc import hc_post, hc_pre

D, N, ITERS, E, K, HEADS, HEAD_DIM, R, Q = 4096, 4, 20, 256, 6, 64, 512, 64, 1024
# bf16: two units in the last place. The torch path rounds some intermediates to bf16 (e.g. the
# norm's x * rsqrt(ms) before its weight) where a kernel keeps float32, so a rare element sits
# two ulps away (first H100 run: at most 0.05% of elements, only from T = 64)
ULP = {torch.bfloat16: 2**-6, torch.float32: 1e-5}


def graph_us(fn, reps: int = 50) -> float:
    """Microseconds a call of fn, replayed `reps` times in one CUDA graph (launch gaps included)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (5 * reps)


def compare(name: str, got, want, dtype, share: float = 0.01) -> dict:
    got, want = got.float(), want.float()
    # atol: a sum with cancellation (the compressors' gated pooling) can land near 0 where a relative
    # bound means nothing, so an element may also be off by ULP of the output's largest magnitude
    finite = want[want.isfinite()]
    atol = max(1e-5, ULP[dtype] * finite.abs().max().item()) if dtype != torch.float32 and finite.numel() else 1e-5
    ok = not got.isnan().any() and torch.allclose(got, want, rtol=ULP[dtype], atol=atol)  # -inf gates in states
    differ = (got != want).float().mean().item()
    ok = ok and (dtype == torch.float32 or differ <= share)
    return {"check": name, "ok": ok, "max_abs": (got - want).abs().max().item(), "share_differing": differ}


def compressor_case(T: int, g: torch.Generator, dev: str, dim: int, m: int, overlap: bool, verify: int = 0):
    """(kernel call, torch call): a V4-Flash compressor's decode update on the Triton path
    (compress_decode) and on the torch path, each on its own copy of the pool; both return the
    entries written and the state records. verify = k > 0: T sequences' verify chunks of k + 1
    tokens instead (step.group_plan; compress_chunk's two kernels), the records to spare slots."""
    comp = CompressedKV(D, dim, m, overlap, 1e-6)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 and p.shape[-1] == D else 1.0))
    comp = comp.to(dev, torch.bfloat16)
    comp.position_bias.data, comp.kv_norm.weight.data = (
        comp.position_bias.data.float(),
        comp.kv_norm.weight.data.float(),
    )
    C = 2 * dim if overlap else dim
    state_dim = 2 * (m - 1) * C + (2 * m * dim if overlap else 0)
    starts = torch.randint(0, 4096, (T,), generator=g)
    starts[: min(T, 4)] = torch.tensor([0, m - 1, m, 2 * m + 1])[: min(T, 4)]
    x = torch.randn(T * (verify + 1), D, generator=g).to(dev, torch.bfloat16)
    states = torch.randn(2 * T + 3, state_dim, generator=g).to(dev, torch.bfloat16)
    perm = torch.randperm(2 * T + 3, generator=g).to(dev)
    slots, dst = perm[:T], (perm[T : 2 * T] if verify else None)
    table = (torch.arange(T * 80).view(T, 80) + 1).to(dev, torch.int32)
    page = max(64 // m, 1)
    cs = torch.randn(T, R // 2, generator=g).to(dev)
    if verify:
        inv = torch.rand(R // 2, generator=g).to(dev) / 64
        lens = torch.full((T,), verify + 1, device=dev)
        batch = SimpleNamespace(starts=starts.to(dev), lens=lens, num_tokens=T * (verify + 1))
        plan = group_plan(batch, m, table, page, False, lambda p: ((p[:, None] * inv).cos(), (p[:, None] * inv).sin()))
    else:
        batch = SimpleNamespace(starts=starts.to(dev), decode_rows=torch.arange(T, device=dev))
        plan = decode_group_plan(batch, m, table, page, lambda p: (cs, cs.flip(0)))
    ix = SimpleNamespace(groups=plan)
    entries = torch.zeros(T * 80 * page + page, dim, device=dev, dtype=torch.bfloat16)
    rows = ix.groups.slot.long()
    joined = copy.deepcopy(comp)  # the loader's layout: kv_proj and gate_proj rows of one weight
    join_rows(joined.kv_proj, joined.gate_proj)

    def run(backend: str, module: CompressedKV):
        st, en = states.clone(), entries.clone()
        ops.set_backend(backend)
        try:
            with torch.no_grad():
                module.update(x, ix, slots, en, st, dst=dst)
        finally:
            ops.set_backend(None)
        return en[rows], st[slots if dst is None else torch.cat([slots, dst])]

    return lambda: run("triton", joined), lambda: run("torch", comp)


def cases(T: int, g: torch.Generator, dev: str):
    """(name, kernel call, torch call, compare(out_kernel, out_torch) -> [checks])."""
    bf = torch.bfloat16
    M = (2 + N) * N
    h = torch.randn(T, N, D, generator=g).to(dev, bf)
    fn, base = (0.02 * torch.randn(M, N * D, generator=g)).to(dev), (0.5 * torch.randn(M, generator=g)).to(dev)
    scale, w = (1 + torch.rand(3, generator=g)).to(dev), (1 + 0.2 * torch.randn(D, generator=g)).to(dev)
    out, post = torch.randn(T, D, generator=g).to(dev, bf), (2 * torch.rand(T, N, generator=g)).to(dev)
    comb = torch.rand(T, N, N, generator=g).to(dev)
    q = (3 * torch.randn(T, HEADS, HEAD_DIM, generator=g)).to(dev, bf)
    cos, sin = torch.randn(T, R // 2, generator=g).to(dev), torch.randn(T, R // 2, generator=g).to(dev)
    qa, wq = torch.randn(T, Q, generator=g).to(dev, bf), (1 + 0.2 * torch.randn(Q, generator=g)).to(dev)
    logits, bias = (3 * torch.randn(T, E, generator=g)).to(dev, bf), (0.3 * torch.randn(E, generator=g)).to(dev)
    table, ids = torch.randint(E, (1000, K), generator=g).to(dev), torch.randint(1000, (T,), generator=g).to(dev)
    gate, up = (6 * torch.randn(T, 2048, generator=g)).to(dev, bf), (6 * torch.randn(T, 2048, generator=g)).to(dev, bf)
    pre_args = (h, fn, base, scale, ITERS, 1e-6, 1e-6, w, 1e-6)

    def pre_cmp(a, b):
        return [
            compare(f"hc_pre.{n}", x, y, dt)
            for n, x, y, dt in zip(("post", "comb", "input"), a, b, (torch.float32, torch.float32, bf))
        ]

    def route_cmp(a, b):
        same = torch.equal(a[1].sort(1).values, b[1].sort(1).values)
        checks = [{"check": "route.ids", "ok": same}]
        wa, wb = a[0].gather(1, a[1].argsort(1)), b[0].gather(1, b[1].argsort(1))
        return checks + [compare("route.weights", wa, wb, bf)]

    one = lambda n: lambda a, b: [compare(n, a, b, bf)]  # noqa: E731

    def comp_cmp(a, b):
        return [compare("compressor.entries", a[0], b[0], bf, 0.02), compare("compressor.states", a[1], b[1], bf)]

    return [
        ("hc_pre (mHC pre-mix + input RMSNorm)", lambda: hc_pre(*pre_args), lambda: ref.hc_pre_ref(*pre_args), pre_cmp),
        ("hc_post (mHC post-mix residual)", lambda: hc_post(h, out, post, comb), lambda: ref.hc_post_ref(h, out, post, comb), one("hc_post")),
        ("rms_norm (q heads, unweighted) + rope", lambda: rms_norm_rope(q, None, 1e-6, rope=(cos, sin)),
         lambda: ref.rope_tail_ref(ref.rms_norm_ref(q, None, 1e-6), cos, sin), one("rms_norm_rope")),
        ("rms_norm (q_a_norm, weighted)", lambda: rms_norm_rope(qa, wq, 1e-6), lambda: ref.rms_norm_ref(qa, wq, 1e-6), one("rms_norm")),
        ("rope (attention output, undo)", lambda: rms_norm_rope(q, None, 0.0, norm=False, rope=(cos, sin)),
         lambda: ref.rope_tail_ref(q, cos, sin), one("rope")),
        ("router top-k (sqrt-softplus + bias)", lambda: route(logits, K, "sqrtsoftplus", 1.5, bias=bias),
         lambda: ref.route_ref(logits, K, "sqrtsoftplus", 1.5, bias=bias), route_cmp),
        ("router hash", lambda: route(logits, K, "sqrtsoftplus", 1.5, table=table, input_ids=ids),
         lambda: ref.route_ref(logits, K, "sqrtsoftplus", 1.5, table=table, input_ids=ids), route_cmp),
        ("swiglu (shared expert)", lambda: swiglu(gate, up, 10.0), lambda: ref.swiglu_ref(gate, up, 10.0), one("swiglu")),
        ("CSA compressor decode (Dc 512, rate 4)", *compressor_case(T, g, dev, 512, 4, True), comp_cmp),
        ("HCA compressor decode (Dc 512, rate 128)", *compressor_case(T, g, dev, 512, 128, False), comp_cmp),
        ("CSA compressor verify k=2 (Dc 512, rate 4)", *compressor_case(T, g, dev, 512, 4, True, 2), comp_cmp),
        ("HCA compressor verify k=2 (Dc 512, rate 128)", *compressor_case(T, g, dev, 512, 128, False, 2), comp_cmp),
    ]  # fmt: skip


def launch_cut_cases(T: int, g: torch.Generator, dev: str):
    """Launches cut from the step (docs/kernels.md's launch table) against the code they replaced:
    the shared expert's gate + up + SwiGLU as one FP8 GEMV (two GEMVs and the SwiGLU kernel before;
    past 16 rows both are the same code) or, bf16, one GEMM on the joined [gate; up] rows and the
    SwiGLU on its halves; a CSA compressor's kv_proj + gate_proj as one GEMM; a bf16 MoE's router
    and shared gate + up as one GEMM; the routed experts' top-k sum and cast (after an FP4 MoE's
    2-way split w2) in one kernel."""
    from pdserve_kernels.fp8_gemm import fp8_linear, fp8_swiglu
    from pdserve_kernels.fused_moe import sum_pairs

    bf, I, block, limit = torch.bfloat16, 2048, (128, 128), 10.0
    x = torch.randn(T, D, generator=g).to(dev, bf)
    w8 = [ops.quant_block_fp8((D**-0.5 * torch.randn(I, D, generator=g)).to(dev), block) for _ in "gu"]
    wg, wu = ((D**-0.5 * torch.randn(I, D, generator=g)).to(dev, bf) for _ in "gu")
    wgu = torch.cat([wg, wu])
    wkv = (0.02 * torch.randn(2 * 1024, D, generator=g)).to(dev, bf)  # CSA: kv_proj rows, then gate_proj rows
    wr, bias = (D**-0.5 * torch.randn(E, D, generator=g)).to(dev, bf), (0.3 * torch.randn(E, generator=g)).to(dev)
    wrgu = torch.cat([wr, wg, wu])  # bf16 MoE: the router's rows, then the shared expert's gate and up
    part = torch.randn(2, T * K, D, generator=g).to(dev)
    one = lambda n: lambda a, b: [compare(n, a, b, bf)]  # noqa: E731
    # on a GPU the fused GEMV's sums and roundings are the two GEMVs' (the same splits, round to
    # nearest): equal bits but for a rare contraction; the interpreter's casts truncate in the
    # GEMVs it replaced, so on the CPU smoke run only the two-ulp bound holds
    pair = lambda a, b: [compare("fp8_swiglu", a, b, bf, 1.0 if dev == "cpu" else 0.01)]  # noqa: E731

    def moe_in(y_r, y_g, y_u):
        return (*route(y_r, K, "sqrtsoftplus", 1.5, bias=bias), swiglu(y_g, y_u, limit))

    def moe_in_cmp(a, b):
        same = torch.equal(a[1].sort(1).values, b[1].sort(1).values)
        wa, wb = a[0].gather(1, a[1].argsort(1)), b[0].gather(1, b[1].argsort(1))
        return [{"check": "router+shared.ids", "ok": same}, compare("router+shared.weights", wa, wb, bf),
                compare("router+shared.swiglu", a[2], b[2], bf)]  # fmt: skip

    def kv_gate_cmp(a, b):
        return [compare("compressor.kv", a[0], b[0], bf), compare("compressor.gate", a[1], b[1], bf)]

    return [
        ("shared expert FP8 gate + up + SwiGLU (one GEMV at T <= 16)", lambda: fp8_swiglu(x, *w8, limit, block),
         lambda: swiglu(fp8_linear(x, *w8[0], block), fp8_linear(x, *w8[1], block), limit), pair),
        ("shared expert bf16 gate + up: one GEMM on [gate; up] + SwiGLU",
         lambda: (lambda y: swiglu(y[:, :I], y[:, I:], limit))(F.linear(x, wgu)),
         lambda: swiglu(F.linear(x, wg), F.linear(x, wu), limit), one("joined_swiglu")),
        ("CSA compressor kv_proj + gate_proj: one GEMM", lambda: (lambda y: (y[:, :1024], y[:, 1024:]))(F.linear(x, wkv)),
         lambda: (F.linear(x, wkv[:1024]), F.linear(x, wkv[1024:])), kv_gate_cmp),
        ("bf16 router + shared gate + up: one GEMM, route + SwiGLU on its slices",
         lambda: (lambda y: moe_in(y[:, :E], y[:, E : E + I], y[:, E + I :]))(F.linear(x, wrgu)),
         lambda: moe_in(F.linear(x, wr), F.linear(x, wg), F.linear(x, wu)), moe_in_cmp),
        ("MoE top-k sum + cast (2 splits, k 6)", lambda: sum_pairs(part, K, bf),
         lambda: part.view(2, T, K, D).sum((0, 2)).to(bf), one("sum_pairs")),
    ]  # fmt: skip


def step_cases(T: int, g: torch.Generator, dev: str):
    """The decode and verify steps' fused pieces (kernels/v4_step.py, v4_chunk_step.py, the norm's
    store, the inverse rope, the MoE's add in hc_post, the indexer's slots and weight scale) against
    the torch code they replaced."""
    from pdserve.model.batch import ForwardBatch, StepInputs
    from pdserve.model.config_base import RopeConfig
    from pdserve.model.deepseek_v4.chunk_step import build_chunk_step
    from pdserve.model.deepseek_v4.decode_step import build_decode_step
    from pdserve.model.deepseek_v4.step import build_step
    from pdserve.model.rope import RotaryEmbedding
    from pdserve_kernels.indexer import index_scores, indexer_topk_paged

    bf, bs, W, ctx = torch.bfloat16, 64, 128, 4096
    starts = torch.randint(0, ctx, (T,), generator=g)
    starts[: min(T, 3)] = torch.tensor([ctx - 1, 5, 130])[: min(T, 3)]
    cols = ctx // bs + 1
    tables = torch.randperm(T * cols * 2, generator=g)[: T * cols].view(T, cols)
    batch = ForwardBatch.build(
        StepInputs(torch.zeros(T, dtype=torch.int64), torch.ones(T, dtype=torch.int64), starts,
                   torch.ones(T, dtype=torch.bool), tables, tables.flip(1).clone(), torch.arange(T)), bs,
    ).to(dev)  # fmt: skip
    yarn = RopeConfig(rope_type="yarn", theta=160000.0, factor=16.0, original_max_position_embeddings=65536)
    rotary = {"main": RotaryEmbedding(RopeConfig(), R), "compress": RotaryEmbedding(yarn, R)}

    def flat(step) -> list:
        out = [step.window, step.window_write, *step.rope["main"], *step.rope["compress"]]
        out += [t for t in (step.window_src, step.window_old) if t is not None]
        for m in sorted(step.entries):
            ix, gp = step.entries[m], step.entries[m].groups
            out += [
                ix.table,
                ix.seen,
                gp.seq,
                gp.last,
                gp.src,
                gp.present,
                gp.first,
                gp.prev,
                gp.has_prev,
                gp.slot,
                gp.pending,
                *gp.rope,
            ]
            out += [ix.visible] if ix.visible is not None else []
        return out

    # a verify step of k = 2: T chunks of 3 tokens (kernels/v4_chunk_step.py), every window block there
    vstarts = torch.randint(0, ctx - 3, (T,), generator=torch.Generator().manual_seed(T + 1))
    vstarts[: min(T, 3)] = torch.tensor([ctx - 3, 1, 126])[: min(T, 3)]
    verify = ForwardBatch.build(
        StepInputs(torch.zeros(3 * T, dtype=torch.int64), torch.full((T,), 3), vstarts, torch.ones(T, dtype=torch.bool),
                   tables, tables.flip(1).clone(), torch.arange(T), torch.arange(T, 2 * T)), bs,
    ).to(dev)  # fmt: skip

    def step_cmp(a, b):
        same = all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b) if not x.is_floating_point())
        floats = [compare("step.cos_sin", x, y, torch.float32) for x, y in zip(a, b) if x.is_floating_point()]
        return [{"check": "step.ints", "ok": same and len(a) == len(b)}, *floats]

    kv, wk = torch.randn(T, HEAD_DIM, generator=g).to(dev, bf), (1 + 0.2 * torch.randn(HEAD_DIM, generator=g)).to(dev)
    cos, sin = torch.randn(T, R // 2, generator=g).to(dev), torch.randn(T, R // 2, generator=g).to(dev)
    region, rows = (
        torch.zeros(4 * T + 8, HEAD_DIM, device=dev, dtype=bf),
        torch.randperm(4 * T + 8, generator=g)[:T].to(dev),
    )

    def store_kernel():
        return rms_norm_rope(kv, wk, 1e-6, rope=(cos, sin), store=(region, rows)), region[rows]

    def store_torch():
        out = ref.rope_tail_ref(ref.rms_norm_ref(kv, wk, 1e-6), cos, sin)
        region.index_copy_(0, rows, out)
        return out, region[rows]

    q = (3 * torch.randn(T, HEADS, HEAD_DIM, generator=g)).to(dev, bf)
    h, out, out2 = (
        torch.randn(T, N, D, generator=g).to(dev, bf),
        *(torch.randn(T, D, generator=g).to(dev, bf) for _ in "ab"),
    )
    post, comb = (2 * torch.rand(T, N, generator=g)).to(dev), torch.rand(T, N, N, generator=g).to(dev)
    Hi, Di, n_keys, k = 64, 128, T * 65 * 16 + 64, 512  # 65 blocks of 16 entries a query
    iq, keys = torch.randn(T, Hi, Di, generator=g).to(dev, bf), torch.randn(n_keys, Di, generator=g).to(dev, bf)
    iw, scale = torch.randn(T, Hi, generator=g).to(dev, bf), Hi**-0.5 * Di**-0.5
    itable = torch.randperm(n_keys // 16, generator=g)[: T * (ctx // 64 + 1)].view(T, -1).to(dev, torch.int32)
    seq, seen = torch.arange(T, device=dev, dtype=torch.int32), ((batch.positions + 1) // 4).to(torch.int32)
    paged = (itable, seq, seen, 16, ctx // 4)

    def topk_torch():  # the paged indexer's code before its slots kernel and weight scale
        top = index_scores(iq, keys, iw.float() * scale, None, paged).topk(k, dim=-1)
        pages = itable.long()[seq.long()].gather(1, top.indices // 16)
        slots = (pages * 16 + top.indices % 16).to(torch.int32)
        return torch.where(torch.isinf(top.values), torch.full_like(slots, -1), slots)

    def topk_cmp(a, b):
        return [{"check": "indexer.slots", "ok": torch.equal(a.sort(1).values, b.sort(1).values)}]

    two = lambda n: lambda a, b: [compare(f"{n}.out", a[0], b[0], bf), compare(f"{n}.stored", a[1], b[1], bf)]  # noqa: E731
    one = lambda n: lambda a, b: [compare(n, a, b, bf)]  # noqa: E731
    return [
        ("decode-step metadata (W 128, rates 4 + 128)", lambda: flat(build_decode_step(batch, rotary, W, {4}, {128})),
         lambda: flat(build_step(batch, rotary, W, {4}, {128})), step_cmp),
        ("verify-step metadata (T chunks of 3, W 128, rates 4 + 128)",
         lambda: flat(build_chunk_step(verify, rotary, W, {4}, {128})),
         lambda: flat(build_step(verify, rotary, W, {4}, {128})), step_cmp),
        ("kv_norm + rope + window store", store_kernel, store_torch, two("kv_store")),
        ("rope by -angle (attention output, undo)", lambda: rms_norm_rope(q, None, 0.0, norm=False, rope=(cos, sin), inverse=True),
         lambda: ref.rope_tail_ref(q, cos, -sin), one("rope_inverse")),
        ("hc_post + the MoE's routed + shared add", lambda: hc_post(h, out, post, comb, out2),
         lambda: ref.hc_post_ref(h, out + out2, post, comb), one("hc_post2")),
        ("indexer top-k -> slots (weights scaled in the kernel)",
         lambda: indexer_topk_paged(iq, keys, iw, *paged, k, weight_scale=scale), topk_torch, topk_cmp),
    ]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,64,128")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", help="cpu: the checks only, under TRITON_INTERPRET=1 (a smoke test)")
    args = ap.parse_args()
    gpu = args.device != "cpu"
    device = torch.cuda.get_device_name() if gpu else "cpu (interpreter)"
    rows, failed = [], 0
    print(f"{device}: V4-Flash glue, fused kernel vs torch (us a call in a CUDA graph)")
    print("| T | op | kernel us | torch us | checks |")
    print("| ---: | --- | ---: | ---: | --- |")
    for T in [int(t) for t in args.tokens.split(",")]:
        g = torch.Generator().manual_seed(T)
        every = cases(T, g, args.device) + step_cases(T, g, args.device) + launch_cut_cases(T, g, args.device)
        for name, kernel, torch_fn, cmp in every:
            checks = cmp(kernel(), torch_fn())
            failed += sum(not c["ok"] for c in checks)
            us = (graph_us(kernel), graph_us(torch_fn)) if gpu else (0.0, 0.0)
            row = {"T": T, "op": name, "kernel_us": us[0], "torch_us": us[1], "checks": checks}
            rows.append(row)
            verdict = ", ".join(f"{c['check']} {'ok' if c['ok'] else 'FAILED'}" for c in checks)
            print(f"| {T} | {name} | {row['kernel_us']:.1f} | {row['torch_us']:.1f} | {verdict} |", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "v4_glue_check.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    print(f"{failed} checks failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
