"""`pdserve bench-engine` on the CPU with tiny models: a well-formed report with positive numbers,
the floor arithmetic against byte counts done by hand, the layer mixes, the dummy load format,
and the refusals of what the engine does not run. Nothing about speed is asserted."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from pdserve.bench.engine import plan
from pdserve.bench.engine.cli import main
from pdserve.bench.engine.floor import StepCost, attention_cost, expected_distinct_experts, step_cost
from pdserve.bench.engine.models import V4_FLASH, bench_config, write_config
from pdserve.bench.engine.profile import ORDER, classify
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v4.config import CSA, HCA, SLIDING

# context 130: V4's window (8) then spans blocks 1 and 2 of 64 tokens, the new token's block another
TINY_RUN = ["--num-layers", "2", "--batch-sizes", "1,2", "--context", "130", "--long-context", "200", "--warmup", "0",
            "--steps", "2", "--baseline-steps", "1", "--dtype", "float32", "--device", "cpu"]  # fmt: skip


@pytest.mark.parametrize("model", ["tiny-v3.2", "tiny-v4"])
def test_report_is_well_formed(model, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["--model", model, *TINY_RUN, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["environment"]) >= {"device", "date", "torch", "triton"}
    assert report["settings"]["num_layers"] == 2 and report["settings"]["model"] == model
    assert report["ceilings"]["copy_bytes_per_s"] > 0 and report["ceilings"]["matmul_flops_per_s"] > 0
    assert [(r["batch"], r["context"]) for r in report["rows"]] == [(1, 130), (2, 130), (1, 200)]
    for row in report["rows"]:
        assert "error" not in row
        assert row["step_ms"] > 0 and row["tok_s"] > 0 and row["floor_ms"] > 0 and row["ratio"] > 0
        assert row["floor_ms"] == max(row["bytes_ms"], row["flops_ms"])
        assert len(row["step_ms_all"]) == 2
        assert list(row["profile"]["ms"]) == ORDER and row["profile"]["kernel_ms"] > 0
        assert row["experts_touched"] and all(1 <= n <= 8 for n in row["experts_touched"].values())
        assert min(row["cost"].values()) > 0
    assert report["rows"][0]["baseline"]["step_ms"] > 0
    text = capsys.readouterr().out
    assert "| 2 | 130 |" in text and "| 1 | 200 |" in text and "naive baseline" in text


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--model", "tiny-v4", "--dtype", "fp8"], "for DeepSeek-V4 use --dtype fp4"),
        (["--dtype", "fp4"], "FP4 routed experts are DeepSeek-V4's"),
        (["--load-format", "auto"], "only 'dummy'"),
        (["--kv-cache-dtype", "bfloat16"], "auto (the weights' dtype) or fp8"),
        (["--tp-shard", "2"], "a shard needs --num-layers"),
        (["--tp-shard", "3", "--num-layers", "2"], "does not split 3 ways"),
    ],
)
def test_refuses_what_is_not_built(flags, says, capsys):
    assert (
        main(
            [
                "--model",
                "tiny-v3.2",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--context",
                "16",
                "--long-context",
                "0",
                *flags,
            ]
        )
        == 2
    )
    assert says in capsys.readouterr().err


def test_floor_of_tiny_v32_by_hand():
    """2 layers of tiny V3.2 (hidden 128, 4 heads, q_lora 64, kv_lora 64 + rope 16, nope 32, v 32,
    indexer 16 x 32 top-16, MLP 256, 8 experts of 64, top-2, 1 shared, vocab 512): layer 0 dense,
    layer 1 MoE. Meta parameters are float32 (4 bytes); KV bf16 (2 bytes)."""
    config = ModelConfig.from_dict(bench_config("tiny-v3.2", 2))
    model = plan.meta_model(config)
    attention = (
        128 * 64 + 64  # q_a_proj, q_a_layernorm
        + 64 * 4 * (32 + 16)  # q_b_proj
        + 128 * (64 + 16) + 64  # kv_a_proj_with_mqa, kv_a_layernorm
        + 64 * 4 * (32 + 32)  # kv_b_proj
        + 4 * 32 * 128  # o_proj
        + 64 * 16 * 32 + 128 * 32 + 2 * 32 + 128 * 16  # indexer wq_b, wk, k_norm (weight, bias), weights_proj
    )  # fmt: skip
    norms = 2 * 128
    dense_mlp = 3 * 128 * 256
    moe_rest = 8 * 128 + 8 + 3 * 128 * 64  # router weight, bias, shared expert
    per_expert = 3 * 128 * 64
    params = 2 * (attention + norms) + dense_mlp + moe_rest + 128 + 512 * 128  # + final norm, lm_head
    B, C = 4, 40  # n = 41 positions
    cost = step_cost(model, config, B, C, kv_itemsize=2, experts_touched={1: 5})
    assert cost.weight_bytes == 4 * params + 4 * B * 128  # + B embedding rows
    assert cost.expert_bytes == 4 * 5 * per_expert
    # per layer and sequence: top-16 latent records (80 values) + index keys of 41 positions (32)
    assert cost.kv_bytes == 2 * B * 2 * (16 * 80 + 41 * 32)
    attention_flops = 2 * 4 * 16 * (80 + 64) + 2 * 16 * 41 * 32
    assert cost.flops == 2 * B * params + 2 * B * 2 * per_expert + 2 * B * attention_flops
    assert cost.floor_ms(1e9, 1e12) == {
        "bytes_ms": cost.total_bytes / 1e6,
        "flops_ms": cost.flops / 1e9,
        "floor_ms": cost.total_bytes / 1e6,
    }


def _one_step(tmp_path, model: str, dtype: str) -> dict:
    """The report of one timed step of `model` (2 layers, B=2, context 40) with weights `dtype`."""
    out = tmp_path / f"{dtype}.json"
    assert main(["--model", model, "--num-layers", "2", "--batch-sizes", "2", "--context", "40", "--long-context", "0",
                 "--warmup", "0", "--steps", "1", "--profile-steps", "0", "--baseline-steps", "0", "--device", "cpu",
                 "--dtype", dtype, "--out", str(out)]) == 0  # fmt: skip
    return json.loads(out.read_text())


def test_fp8_run_and_floor_by_hand(tmp_path):
    """--dtype fp8 (FP8 e4m3 weights kept FP8, bf16 activations; tiny models: 32 x 32 blocks) runs,
    and its floor counts each FP8 value as 1 byte plus a float32 scale per block (bytes, no
    flops), kv_b_proj (absorbed, dequantized) and everything else as before (meta float32)."""
    report = _one_step(tmp_path, "tiny-v3.2", "fp8")
    assert report["settings"]["quantization"] == "fp8" and "error" not in report["rows"][0]
    config = ModelConfig.from_dict(bench_config("tiny-v3.2", 2, "fp8"))
    model = plan.meta_model(config)
    assert model.model.layers[1].mlp.experts.down_proj.dtype == torch.float8_e4m3fn

    def fp8(n, k):  # (values, scale blocks) of an [n, k] FP8 weight, 32 x 32 blocks
        return n * k, -(-n // 32) * -(-k // 32)

    attn = [
        fp8(64, 128),
        fp8(192, 64),
        fp8(80, 128),
        fp8(128, 128),
        fp8(512, 64),
        fp8(32, 128),
    ]  # q_a q_b kv_a o wq_b wk
    attn_f32 = 64 + 64 + 256 * 64 + 2 * 32 + 128 * 16  # the two norms, kv_b_proj, k_norm, weights_proj
    mlp = [fp8(256, 128), fp8(256, 128), fp8(128, 256)]
    shared = [fp8(64, 128), fp8(64, 128), fp8(128, 64)]
    expert = [fp8(128, 128), fp8(128, 64)]  # gate_up, down of one expert
    size = lambda ws: sum(v + 4 * b for v, b in ws)  # noqa: E731
    values = lambda ws: sum(v for v, _ in ws)  # noqa: E731
    B = 4
    layer = size(attn) + 4 * (attn_f32 + 2 * 128)  # + the two layer norms
    weight_bytes = 2 * layer + size(mlp) + size(shared) + 4 * (8 * 128 + 8) + 4 * (128 + 512 * 128) + 4 * B * 128
    cost = step_cost(model, config, B, 40, kv_itemsize=2, experts_touched={1: 5})
    assert cost.weight_bytes == weight_bytes
    assert cost.expert_bytes == 5 * size(expert)
    dense_params = (
        2 * (values(attn) + attn_f32 + 2 * 128) + values(mlp) + values(shared) + 8 * 128 + 8 + 128 + 512 * 128
    )
    attention_flops = 2 * 4 * 16 * (80 + 64) + 2 * 16 * 41 * 32
    assert cost.flops == 2 * B * dense_params + 2 * B * 2 * values(expert) + 2 * B * attention_flops


def test_fp4_run_and_floor_by_hand(tmp_path):
    """--dtype fp4 on tiny V4 (FP4 routed experts and FP8 projections kept, bf16 activations) runs,
    and its floor counts an expert at 0.5 byte a value plus a 1-byte scale per 32 values; its flops
    are the float model's (scales: bytes only)."""
    report = _one_step(tmp_path, "tiny-v4", "fp4")
    assert report["settings"]["quantization"] == "fp4" and "error" not in report["rows"][0]
    config = ModelConfig.from_dict(bench_config("tiny-v4", 2, "fp4"))
    model = plan.meta_model(config)
    layer = model.model.layers[1]
    assert layer.mlp.experts.fp4 and layer.mlp.experts.down_proj.dtype == torch.uint8
    assert layer.self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    hidden, inter = 128, 64
    per_expert = 2 * inter * hidden // 2 + 2 * inter * hidden // 32 + hidden * inter // 2 + hidden * inter // 32
    cost = step_cost(model, config, 4, 40, kv_itemsize=2, experts_touched={0: 3, 1: 5})
    assert cost.expert_bytes == (3 + 5) * per_expert
    floats = plan.meta_model(ModelConfig.from_dict(bench_config("tiny-v4", 2)))
    assert cost.flops == step_cost(floats, config, 4, 40, kv_itemsize=2, experts_touched={0: 3, 1: 5}).flops


def test_v4_kv_read_by_hand():
    """tiny V4, 3 layers: sliding, CSA (rate 4, top-4), HCA (rate 16); D 64, index keys 32, window 8,
    4 heads, 16 index heads. Context 39: n = 40 positions, 10 CSA entries, 2 HCA entries."""
    config = ModelConfig.from_dict(bench_config("tiny-v4", 3))
    assert config.v4.layer_types == (SLIDING, CSA, HCA)
    values = 8 * 64 + ((8 + 4) * 64 + 10 * 32) + (8 + 2) * 64
    flops = 4 * 4 * 8 * 64 + (4 * 4 * 12 * 64 + 2 * 16 * 10 * 32) + 4 * 4 * 10 * 64
    assert attention_cost(config, 2, 39, 4) == (2 * values * 4, 2 * flops)


def test_v4_fp8_kv_read_by_hand(tmp_path):
    """--kv-cache-dtype fp8 on tiny V4 runs, and its floor reads each window / entry record as one
    88-byte fp8_ds_v4 record (48 e4m3 + 16 bf16 rope + 8 scale bytes); index keys stay values."""
    config = ModelConfig.from_dict(bench_config("tiny-v4", 3))
    values = 8 * 64 + ((8 + 4) * 64 + 10 * 32) + (8 + 2) * 64
    records = 8 + (8 + 4) + (8 + 2)
    assert attention_cost(config, 2, 39, 2, record_bytes=88) == (
        2 * (2 * (values - 64 * records) + 88 * records),
        attention_cost(config, 2, 39, 2)[1],
    )
    out = tmp_path / "fp8kv.json"
    assert main(["--model", "tiny-v4", *TINY_RUN[:8], "--warmup", "0", "--steps", "1", "--baseline-steps", "0", "--dtype", "float32", "--device", "cpu",
                 "--kv-cache-dtype", "fp8", "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    two = ModelConfig.from_dict(bench_config("tiny-v4", 2))
    for r in rows:  # float32 index keys (4 bytes a value), 88-byte records
        assert "error" not in r and r["step_ms"] > 0
        assert r["cost"]["kv_bytes"] == attention_cost(two, r["batch"], r["context"], 4, record_bytes=88)[0]


def test_fp8_v4_pages_filled_finite():
    """The bench's random fp8_ds_v4 pages (V4-Flash's 584-byte records) dequantize to finite values."""
    from pdserve.bench.engine.decode import _fill_fp8_v4_pages
    from pdserve_kernels.kv_fp8 import unpack_kv_fp8_v4

    pages = torch.zeros(3, 16, 584, dtype=torch.uint8)
    _fill_fp8_v4_pages(pages, 64, torch.Generator().manual_seed(0))
    kv = unpack_kv_fp8_v4(pages)
    assert kv.shape == (48, 512) and torch.isfinite(kv).all()
    assert kv[:, :448].abs().max() <= 1.0 and kv[:, :448].std() > 0.1 and 0.5 < kv[:, 448:].std() < 2


def test_expected_distinct_experts():
    assert expected_distinct_experts(256, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(256, 8, 10_000) == pytest.approx(256)
    assert 8 < expected_distinct_experts(256, 8, 16) < 16 * 8
    assert StepCost(10, 20, 30, 5).total_bytes == 60


def test_layer_mixes_keep_the_released_proportions():
    full = ModelConfig.from_dict(bench_config("v4-flash")).v4
    released = ModelConfig.from_dict(V4_FLASH).v4
    assert (full.layer_types, full.mlp_layer_types) == (released.layer_types, released.mlp_layer_types)
    eight = bench_config("v4-flash", 8)
    assert [eight["layer_types"].count(k) for k in (SLIDING, CSA, HCA)] == [1, 4, 3]
    assert eight["mlp_layer_types"].count("hash_moe") == 1
    assert bench_config("v3.2", 5)["first_k_dense_replace"] == 1
    assert bench_config("v3.2")["first_k_dense_replace"] == 3
    assert ModelConfig.from_dict(bench_config("v3.2", 5)).mlp_layer_types == ("dense",) + ("sparse",) * 4


def test_fit_layers_counts_weights_and_pool():
    fit = functools.partial(plan.fit_layers, "tiny-v4", torch.bfloat16, "auto", 64, 10, 4)
    three = sum(plan.footprint("tiny-v4", 3, torch.bfloat16, "auto", 64, 10, 4).values())
    assert fit(three) == 3 and fit(three - 1) == 2
    assert fit(1e12) == 5  # capped at the released depth
    with pytest.raises(ValueError, match="not even one layer"):
        fit(1000)
    v32 = plan.footprint("tiny-v3.2", 2, torch.bfloat16, "auto", 64, 10, 4)
    assert v32["kv_pool"] == 11 * 2 * 64 * (64 + 16 + 32) * 2  # (10 + scratch) blocks, 2 layers, latent + index key
    assert plan.pool_blocks([(2, 100), (1, 300)], 64, 10) == max(2 * 2, 1 * 5)


def test_classify_kernel_names():
    assert classify("_mla_split_kernel") == "attention" and classify("_index_scores_kernel") == "attention"
    assert classify("_w13_kernel") == "moe" and classify("_align_kernel") == "moe"
    assert classify("nvjet_tst_128x64_64x8") == "gemm" and classify("aten::mm") == "gemm"
    assert classify("_fp8_gemv_kernel") == "gemm" and classify("_fp8_gemm_kernel") == "gemm"
    assert classify("Memcpy HtoD (Pageable -> Device)") == "copy"
    assert classify("triton_red_fused_rms_norm_0") == "norms/rope/other"


@pytest.mark.parametrize("arch", ["tiny-v3.2", "tiny-v4"])
def test_load_format_dummy_needs_only_config_json(arch, tmp_path):
    folder = write_config(bench_config(arch, 2), tmp_path / "m")

    def params(seed: int) -> dict[str, torch.Tensor]:
        cfg = EngineConfig(model=str(folder), load_format="dummy", num_kv_blocks=4, seed=seed)
        model = ModelRunner(cfg).model
        return {**dict(model.named_parameters()), **dict(model.named_buffers())}

    a, b, c = params(0), params(0), params(1)
    assert all(torch.equal(a[n], b[n]) for n in a)  # seeded: every rank of a TP group fills the same
    assert any(not torch.equal(a[n], c[n]) for n in a if a[n].dim() >= 2)
    assert all(torch.isfinite(t.float()).all() for t in a.values())
    norms = [n for n in a if n.endswith(("layernorm.weight", "model.norm.weight"))]
    assert norms and all(bool((a[n] == 1).all()) for n in norms)
    for name, table in a.items():
        if name.endswith("tid2eid"):  # k distinct experts a token
            assert table.max() < 8 and all(len(set(row)) == table.shape[1] for row in table.tolist())


def test_serve_flag_reaches_the_engine(tmp_path):
    import argparse

    from pdserve.serve import add_serve_args, config_from_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    cfg = config_from_args(p.parse_args(["--role", "colocated", "--model", "m", "--load-format", "dummy"]))
    folder = write_config(bench_config("tiny-v3.2", 1), tmp_path / "m")
    assert cfg.worker.engine_config(str(folder)).load_format == "dummy"


def test_baseline_is_eager_on_the_reference_kernels(tmp_path):
    from pdserve.bench.engine.decode import DecodeBench
    from pdserve.model import ops

    folder = write_config(bench_config("tiny-v3.2", 1), tmp_path / "m")
    bench = DecodeBench(EngineConfig(model=str(folder), load_format="dummy", num_kv_blocks=4, max_num_seqs=2))
    captured = object()  # stands for the runner's CUDA graphs: a replay would run the captured kernels
    bench.runner.graphs = captured
    with bench.reference_kernels():
        assert bench.runner.graphs is None and ops._use_triton(torch.zeros(1, device="meta")) is False
    assert bench.runner.graphs is captured and ops._forced is None


def test_fp8_records_filled_finite():
    """The bench's random FP8 KV records (V3.2 layout) dequantize to finite values."""
    from pdserve.bench.engine.decode import _fill_fp8_records
    from pdserve_kernels.kv_fp8 import unpack_kv_fp8

    rows = torch.zeros(64, 656, dtype=torch.uint8)
    _fill_fp8_records(rows, torch.Generator().manual_seed(0))
    kv = unpack_kv_fp8(rows, 512, 576)
    assert torch.isfinite(kv).all() and kv[:, :512].abs().max() <= 1.0 and kv[:, :512].std() > 0.1


def test_floor_counts_fp4_experts_once_relaid():
    """On a GPU the FP4 experts are re-laid (fragment layout) at their first forward and the
    checkpoint layout freed: the floor then counts the tiles (64 x 128 values: 4096 value bytes +
    256 scale bytes each)."""
    from pdserve.model import registry

    config = ModelConfig.from_dict(bench_config("tiny-v4", 2, "fp4"))
    model = plan.meta_model(config)
    registry.entry(config).materialize(model, torch.bfloat16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if p.dtype == torch.uint8:  # packed values random, ue8m0 scales 2**0
            p.data = torch.full_like(p, 127) if "scale" in name else torch.randint(0, 256, p.shape, generator=gen).to(p)
    for layer in model.model.layers:
        layer.mlp.experts._tile()
    hidden, inter, tile = 128, 64, 64 * 128 // 2 + 64 * 128 // 32
    per_expert = 2 * tile * -(-inter // 64) * -(-hidden // 128) + tile * -(-hidden // 64) * -(-inter // 128)
    cost = step_cost(model, config, 4, 40, kv_itemsize=2, experts_touched={0: 3, 1: 5})
    assert cost.expert_bytes == (3 + 5) * per_expert


@pytest.mark.parametrize("model", ["tiny-v3.2", "tiny-v4"])
def test_tp_shard_is_one_ranks_share(model, tmp_path):
    """--tp-shard 2: the dimensions pdserve's tensor parallelism splits are halved, nothing else,
    and the shard runs as a model of its own; the same dimensions the TP model's rank 0 builds."""
    full, half = bench_config(model, 2), bench_config(model, 2, tp_shard_size=2)
    changed = {k for k in full if full[k] != half[k]}
    split = {"tiny-v4": {"num_attention_heads", "o_groups", "moe_intermediate_size"}}.get(
        model, {"num_attention_heads", "num_key_value_heads", "moe_intermediate_size", "intermediate_size"}
    )
    assert changed == split and all(half[k] * 2 == full[k] for k in split)
    out = tmp_path / "shard.json"
    assert main(["--model", model, *TINY_RUN[:6], "--long-context", "0", "--warmup", "0", "--steps", "1",
                 "--baseline-steps", "0", "--profile-steps", "0", "--dtype", "float32", "--device", "cpu",
                 "--tp-shard", "2", "--out", str(out)]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    assert report["settings"]["tp_shard"] == 2 and report["rows"][0]["step_ms"] > 0


def test_host_phases_time_the_runs_phases(capsys):
    """benchmarks/engine/host_phases.py: the bench's rows with ModelRunner.run's phases timed (CPU:
    no graphs, so no fits / fill / replay); the run's own median covers prepare and sampling, and
    the wrapped methods are put back afterwards."""
    from benchmarks.engine import host_phases
    from pdserve.engine.model_runner import ModelRunner

    before = (ModelRunner.run, ModelRunner.prepare)
    out = host_phases.main(
        ["--model", "tiny-v4", "--batch-sizes", "1,2", "--context", "40", "--long-context", "0", "--warmup", "0",
         "--steps", "2", "--profile-steps", "0", "--baseline-steps", "0", "--dtype", "float32", "--device", "cpu"]
    )  # fmt: skip
    assert (ModelRunner.run, ModelRunner.prepare) == before
    assert set(out["phases"]) == {"1x40", "2x40"}
    for p in out["phases"].values():
        assert set(p) == {"prepare", "draw", "read", "run"} and 0 < p["prepare"] + p["draw"] + p["read"] < p["run"]
    assert "B=2 context=40: phases (median ms) prepare" in capsys.readouterr().out
