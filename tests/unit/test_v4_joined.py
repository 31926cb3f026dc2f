"""Projections of one input joined at load (`layers.join_rows`): the weights (and FP8 scales) of
linears that read the same x become row slices of one tensor, so one GEMM runs them. The
parameters keep their names, shapes and values, writes into them in place (the loaders, dummy
fills) reach the joined tensor, and the outputs equal the separate linears'; where the rows
cannot join (FP8 scale blocks that would not line up, a weight replaced later) each linear runs
alone. A materialized V4 model joins its compressors' (a CSA's with its indexer's three),
attention's and shared experts' projections."""

import torch
from torch import nn

from pdserve.bench.engine.models import bench_config, write_config
from pdserve.model import ops
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v4.compressor import CompressedKV, CSACompressor
from pdserve.model.deepseek_v4.layers import join_rows, joined_outputs, joined_rows, joined_weights
from pdserve.model.dummy import dummy_model
from pdserve.model.fp8 import Fp8Linear
from tests.helpers.kernels import seed_of


def _fill(gen, *mods):
    with torch.no_grad():
        for m in mods:
            for p in m.parameters():
                if p.dtype == torch.float8_e4m3fn:
                    q, s = ops.quant_block_fp8(torch.randn(p.shape, generator=gen) * 0.1, m.fp8_block)
                    p.copy_(q)
                    m.weight_scale_inv.copy_(s)
                elif p.dtype != torch.float32 or p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))


def test_joined_linears_keep_names_values_and_outputs():
    gen = torch.Generator().manual_seed(seed_of("joined", "float"))
    a, b = nn.Linear(24, 10, bias=False).double(), nn.Linear(24, 7, bias=False).double()
    _fill(gen, a, b)
    before = [a.weight.clone(), b.weight.clone()]
    x = torch.randn(5, 24, generator=gen, dtype=torch.float64)
    want = [a(x), b(x)]
    join_rows(a, b)
    assert [n for n, _ in a.named_parameters()] == ["weight"] and a.weight.shape == (10, 24)
    assert torch.equal(a.weight, before[0]) and torch.equal(b.weight, before[1])
    w = joined_rows(a.weight, b.weight)
    assert w is not None and w.shape == (17, 24)
    got = joined_outputs(x, a, b)
    assert [g.shape for g in got] == [(5, 10), (5, 7)]
    for g, v in zip(got, want):
        torch.testing.assert_close(g, v, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # a loader's in-place copy reaches the joined tensor
        b.weight.copy_(2 * before[1])
    torch.testing.assert_close(joined_outputs(x, a, b)[1], 2 * want[1], rtol=1e-12, atol=1e-12)
    b.weight = nn.Parameter(before[1].clone())  # replaced: the sharing ends, each runs alone
    assert joined_rows(a.weight, b.weight) is None and joined_weights(a, b) is None
    torch.testing.assert_close(joined_outputs(x, a, b)[1], want[1], rtol=0, atol=0)


def test_fp8_linears_join_weights_and_scales_only_on_block_edges():
    gen = torch.Generator().manual_seed(seed_of("joined", "fp8"))
    block = (32, 32)
    a, b = Fp8Linear(64, 64, block), Fp8Linear(64, 40, block)  # 64 rows: the scales line up
    _fill(gen, a, b)
    x = torch.randn(3, 64, generator=gen)
    ops.set_backend("torch")
    try:
        want = [a(x), b(x)]
        join_rows(a, b)
        w, s = joined_weights(a, b)
        assert w.shape == (104, 64) and s.shape == (2 + 2, 2)
        for g, v in zip(joined_outputs(x, a, b), want):
            torch.testing.assert_close(g, v, rtol=1e-6, atol=1e-6)
        c, d = Fp8Linear(64, 40, block), Fp8Linear(64, 64, block)  # 40 rows end mid-block: apart
        _fill(gen, c, d)
        join_rows(c, d)
        assert joined_weights(c, d) is None and joined_rows(c.weight, d.weight) is None
    finally:
        ops.set_backend(None)


def test_materialized_v4_joins_its_pairs(tmp_path):
    for quant in (None, "fp8"):
        folder = write_config(bench_config("tiny-v4", 3, quant), tmp_path / str(quant))
        model = dummy_model(ModelConfig.from_model_dir(folder), torch.float32, "cpu")
        comps = [m for m in model.modules() if isinstance(m, CompressedKV)]
        assert comps and all(joined_weights(c.kv_proj, c.gate_proj) is not None for c in comps)
        csa = [c for c in comps if isinstance(c, CSACompressor)]  # with its indexer's three: one GEMM
        assert csa and all(joined_weights(*(c.get_submodule(n) for n in c.joined[0])) is not None for c in csa)
        attn = next(a for a in (layer.self_attn for layer in model.model.layers) if a.compressor in csa)
        assert joined_weights(attn.q_b_proj, attn.compressor.indexer.q_b_proj) is not None
        layer = model.model.layers[1]
        assert joined_weights(layer.self_attn.q_a_proj, layer.self_attn.kv_proj) is not None
        shared = layer.mlp.shared_experts
        assert joined_weights(shared.gate_proj, shared.up_proj) is not None
        fp8 = layer.self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
        assert fp8 == (quant == "fp8")
        # bf16 shared experts join the router's rows too (one GEMM: logits, gate, up); FP8 ones cannot
        router_joined = joined_weights(layer.mlp.gate, shared.gate_proj, shared.up_proj) is not None
        assert router_joined == (not fp8)
