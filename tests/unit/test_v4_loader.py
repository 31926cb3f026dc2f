"""DeepSeek-V4 checkpoint loading: release names, FP8 block-scaled and FP4 expert weights against
transformers' own dequantization, MTP tensors skipped, and the error messages."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from pdserve.distributed.group import TPGroup
from pdserve.model.config import ConfigError, ModelConfig
from pdserve.model.deepseek_v3.loader import load_v3_model as load_model
from pdserve.model.deepseek_v4.loader import load_v4_model
from pdserve.model.fp4 import dequantize_fp4, quantize_fp4, scales_to_float
from pdserve.model.fp8 import dequantize_block_fp8
from pdserve.model.loader import CheckpointError
from pdserve.tiny_model import make_tiny_model
from tests.helpers.v4 import V4_SCALES, V4_SPLIT, cache_bytes, split_params
from tests.helpers.v4_pool import PoolRunner

pytestmark = pytest.mark.timeout(120)

ORACLE = Fp8Dequantize(None)  # transformers' dequantization of FP8 / FP4 (with ue8m0 scales)
E4M3_MAX = 448.0
BLOCK = 32  # FP8 blocks: V4-Flash's are 128, the tiny model's TP2 shards need 32 to hold whole ones
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [BLOCK, BLOCK]}
IDS = torch.arange(4, 44)


def _ue8m0(n: int, m: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(120, 134, (n, m), generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def test_fp4_known_values():
    packed = torch.tensor([[0x21, 0xF9] * 16], dtype=torch.uint8).view(torch.int8)  # 64 values, 2 blocks
    scale = torch.tensor([[128, 125]], dtype=torch.uint8)  # 2.0, 0.25
    out = dequantize_fp4(packed, scale)
    assert out[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0]  # low nibble first: 0.5, 1.0, -0.5, -6.0 times 2
    assert out[0, 32:36].tolist() == [0.125, 0.25, -0.125, -1.5]


@pytest.mark.parametrize("scale_as_bytes", [False, True])
def test_fp4_and_fp8_dequant_match_transformers(scale_as_bytes):
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(-128, 128, (48, 96), generator=gen, dtype=torch.int8)  # [N, K/2]: K = 192
    s4 = _ue8m0(48, 6, gen)
    s4 = s4.view(torch.uint8) if scale_as_bytes else s4
    assert torch.equal(dequantize_fp4(packed, s4), ORACLE._dequantize_one(packed, s4, torch.float32))
    w8 = (torch.randn(256, 384, generator=gen) * 100).to(torch.float8_e4m3fn)
    s8 = _ue8m0(2, 3, gen)
    expected = ORACLE._dequantize_one(w8, s8, torch.float32)
    got = dequantize_block_fp8(w8, scales_to_float(s8.view(torch.uint8) if scale_as_bytes else s8), (128, 128))
    assert torch.equal(got, expected)


def test_fp4_quantize_round_trips_representable_values():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 64, generator=gen)
    packed, scale = quantize_fp4(w)
    once = dequantize_fp4(packed, scale)
    assert torch.equal(dequantize_fp4(*quantize_fp4(once)), once)
    assert (once - w).abs().max() <= w.abs().max() / 4  # e2m1 is coarse, but not wrong


# ---------------------------------------------------------------- a quantized release-format checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_v4"), arch="deepseek_v4", seed=0)


# transformers' in-memory names -> DeepSeek's release names, in order
TO_RELEASE = (
    (r"^model\.", ""), (r"^embed_tokens\.", "embed."), (r"^lm_head\.", "head."), (r"^hc_head\.hc_", "hc_head_"),
    (r"\.attn_hc\.", ".hc_attn_"), (r"\.ffn_hc\.", ".hc_ffn_"), (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."), (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."), (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."),
    (r"\.sinks$", ".attn_sink"), (r"\.kv_norm\.", ".norm."), (r"\.q_a_norm\.", ".q_norm."), (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."), (r"\.q_b_proj\.", ".wq_b."), (r"\.kv_proj\.", ".wkv."), (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."), (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."), (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.gate_proj\.", ".wgate."), (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
)  # fmt: skip


def _release_names(tiny: Path) -> dict[str, torch.Tensor]:
    """The tiny model's tensors under DeepSeek's release names, experts one tensor each."""
    out = {}
    for name, t in load_file(str(tiny / "model.safetensors")).items():
        for pattern, repl in TO_RELEASE:
            name = re.sub(pattern, repl, name)
        if name.endswith(".experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.w1.weight")] = t[e, :inter]
                out[name.replace("gate_up_proj", f"{e}.w3.weight")] = t[e, inter:]
        elif name.endswith(".experts.down_proj"):
            out.update({name.replace("down_proj", f"{e}.w2.weight"): t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> e4m3 [N, K] and one power-of-two scale per BLOCK x BLOCK block (partial ones too)."""
    N, K = w.shape
    bn, bk = -(-N // BLOCK), -(-K // BLOCK)
    padded = torch.zeros(bn * BLOCK, bk * BLOCK)
    padded[:N, :K] = w
    amax = padded.view(bn, BLOCK, bk, BLOCK).abs().amax(dim=(1, 3)).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))  # [bn, bk]
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:N, :K]
    return (w / full).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def _is_fp8_linear(name: str, t: torch.Tensor) -> bool:
    """Where V4-Flash ships FP8: 2-D linear weights, except embeddings, head, norms, the routed
    experts (FP4) and the compressor / indexer projections (bf16, as transformers notes)."""
    skip = ("embed.", "head.", "norm", ".experts.", "compressor.", "weights_proj")
    return name.endswith(".weight") and t.dim() == 2 and not any(s in name for s in skip)


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory) -> tuple[Path, Path]:
    """(quantized release checkpoint with MTP tensors, float reference of the same values)."""
    tmp = tmp_path_factory.mktemp("quant")
    tensors = _release_names(tiny)
    quant, ref = {}, {}
    for name, t in tensors.items():
        if ".experts." in name:
            packed, scale = quantize_fp4(t)
            quant[name], quant[name[: -len("weight")] + "scale"] = packed, scale
            ref[name] = ORACLE._dequantize_one(packed, scale, torch.float32)
        elif _is_fp8_linear(name, t):
            w8, scale = _fp8(t)
            quant[name], quant[name[: -len("weight")] + "scale"] = w8, scale
            N, K = t.shape  # transformers' dequant needs whole blocks: pad, dequantize, cut
            padded = torch.zeros(scale.shape[0] * BLOCK, scale.shape[1] * BLOCK, dtype=torch.float8_e4m3fn)
            padded[:N, :K] = w8
            ref[name] = ORACLE._dequantize_one(padded, scale, torch.float32)[:N, :K]
        else:
            quant[name] = ref[name] = t
    quant["mtp.0.eh_proj.weight"] = torch.zeros(128, 256, dtype=torch.bfloat16)
    quant["mtp.0.ffn.experts.0.w1.weight"] = torch.zeros(64, 64, dtype=torch.int8)
    quant["mtp.0.ffn.experts.0.w1.scale"] = torch.zeros(64, 4, dtype=torch.uint8)
    config = json.loads((tiny / "config.json").read_text())
    paths = []
    for kind, tensors, extra in (
        ("quant", quant, {"quantization_config": QUANT, "expert_dtype": "fp4"}),
        ("ref", ref, {}),
    ):
        _write(tmp / kind, tensors, {**config, **extra})
        paths.append(tmp / kind)
    return paths[0], paths[1]


def _write(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def _logits(model) -> torch.Tensor:
    pool = PoolRunner(model)
    return pool.compute_logits(pool(IDS, [len(IDS)], [pool.new_sequence()]))


def test_quantized_release_checkpoint_matches_float_reference(quantized, caplog):
    """Everything dequantized at load (quantization "none"; tests/unit/test_v4_fp4.py keeps the formats)."""
    quant_dir, ref_dir = quantized
    with caplog.at_level(logging.INFO, logger="pdserve.model.deepseek_v4.loader"):
        model = load_v4_model(quant_dir, dtype=torch.float32, quantization="none")
    mtp = sum(k.startswith("mtp.") for k in load_file(str(quant_dir / "model.safetensors")))  # tiny's and 3 more
    assert mtp > 3 and f"skipping {mtp} MTP tensors" in caplog.text
    assert ModelConfig.from_model_dir(quant_dir).quant.expert_dtype == "fp4"
    reference = load_v4_model(ref_dir, dtype=torch.float32)
    got, want = dict(model.named_parameters()), dict(reference.named_parameters())
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name], want[name]), name
    # transformers reads the same release names to the same model
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    hf.eval()
    with torch.no_grad():
        expected = hf(IDS[None]).logits[0]
    logits = _logits(model)
    assert float((logits - expected).abs().max() / expected.abs().max()) < 1e-4


@pytest.mark.parametrize("quantization", ["none", None], ids=["dequantized", "kept"])
def test_tensor_parallel_ranks_load_slices_of_the_release_checkpoint(quantized, quantization):
    """Release names, FP8 projections and per-expert FP4 w1 / w3 / w2: each TP2 rank's tensors are
    its slices of the TP1 load (every tensor dequantized whole, then sliced; or, kept, the weights
    and their scales sliced together: FP8 on 32x32 block edges, FP4 on 32-value groups)."""
    full = load_v4_model(quantized[0], dtype=torch.float32, quantization=quantization)
    for rank in range(2):
        part = load_v4_model(
            quantized[0], dtype=torch.float32, tp=TPGroup(rank=rank, size=2), quantization=quantization
        )
        assert split_params(full, part, rank) == (V4_SPLIT | V4_SCALES if quantization is None else V4_SPLIT)


def test_bfloat16_load_keeps_float32_parameters(tiny):
    model = load_v4_model(tiny, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert params["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    for name in ("model.layers.0.attn_hc.fn", "model.layers.0.self_attn.sinks", "model.hc_head.hc_fn",
                 "model.layers.2.self_attn.compressor.position_bias", "model.layers.3.mlp.gate.e_score_correction_bias",
                 "model.norm.weight", "model.layers.1.self_attn.kv_norm.weight"):  # fmt: skip
        assert params[name].dtype == torch.float32, name
    assert torch.isfinite(_logits(model)).all()


# ---------------------------------------------------------------- errors


def _variant(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    tensors, config = load_file(str(src / "model.safetensors")), json.loads((src / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    return _write(dst, tensors, config)


def _drop(name):
    return lambda t: t.pop(name)


def _reshape(name, shape):
    def edit(t):
        t[name] = torch.zeros(shape, dtype=t[name].dtype)

    return edit


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            _drop("layers.1.attn.wq_a.scale"),
            r"layers\.1\.attn\.wq_a\.weight in .*float8_e4m3fn but its scale .* is missing",
        ),
        (_reshape("layers.3.ffn.experts.2.w3.scale", (64, 3)), r"experts\.2\.w3\.weight .*fp4 scale shape \(64, 3\)"),
        (_reshape("layers.0.attn.wq_a.scale", (2, 2)), r"wq_a\.weight .*weight_scale_inv shape \(2, 2\)"),
        (_drop("layers.4.ffn.experts.7.w2.weight"), r"has no weight it scales"),
        (_drop("layers.4.ffn.experts.7.w2.scale"), r"experts\.7\.w2\.weight in .*int8 but its scale"),
        (_drop("layers.2.attn.compressor.ape"), r"missing tensor\(s\) .*compressor\.position_bias"),
        (_reshape("layers.2.attn.attn_sink", (5,)), r"shape mismatch for model\.layers\.2\.self_attn\.sinks"),
        (lambda t: t.update({"layers.0.attn.bogus.weight": torch.zeros(2)}), r"unexpected tensor .*bogus"),
        (lambda t: t.update({"layers.0.ffn.experts.9.w1.weight": torch.zeros(2)}), r"expert 9 >= 8 experts"),
    ],
)
def test_malformed_checkpoints_fail_clearly(quantized, tmp_path, edit, match):
    bad = _variant(quantized[0], tmp_path / "bad", edit_tensors=edit)
    with pytest.raises(CheckpointError, match=match):
        load_v4_model(bad, dtype=torch.float32)


def test_quantized_weights_without_quantization_config(quantized, tmp_path):
    bad = _variant(quantized[0], tmp_path / "bad", edit_config=lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_v4_model(bad, dtype=torch.float32)


def test_unreadable_tensor_file(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "m")
    data = (tmp_path / "m" / "model.safetensors").read_bytes()
    (tmp_path / "m" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cannot read the weight files of .*m"):
        load_v4_model(tmp_path / "m", dtype=torch.float32)


def test_v3_loader_refuses_v4(tiny):
    with pytest.raises(CheckpointError, match="deepseek_v4 checkpoint: load it with .*load_v4_model"):
        load_model(tiny, dtype=torch.float32, progress=False)


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"compress_ratios": [0, 4, 128, 4, 8], "layer_types": None}, "compress_ratios entries must be 0, 4 or 128"),
        ({"scoring_func": "softmax"}, "unsupported scoring_func 'softmax'"),
        ({"num_key_value_heads": 4}, "one shared K=V head"),
        ({"o_groups": 3}, "not divisible by o_groups 3"),
        ({"mlp_layer_types": ["moe"] * 4}, "mlp_layer_types must list"),
        ({"quantization_config": {**QUANT, "expert_dtype": "fp6"}}, "expert_dtype 'fp6'"),
    ],
)
def test_config_errors(tiny, edit, match):
    config = {**json.loads((tiny / "config.json").read_text()), **edit}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(config)


def test_release_config_fields():
    """V4-Flash's config.json as released: legacy per-layer compress_ratios, num_hash_layers,
    qk_rope_head_dim, flat yarn rope_scaling, expert_dtype at the top level."""
    c = ModelConfig.from_dict({
        "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 43,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4], "num_hash_layers": 3, "qk_rope_head_dim": 64,
        "rope_theta": 10000, "compress_rope_theta": 160000, "expert_dtype": "fp4", "quantization_config": QUANT,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    })  # fmt: skip
    v4 = c.v4
    assert v4.layer_types.count("sliding_attention") == 2 and v4.layer_types.count("compressed_sparse_attention") == 21
    assert v4.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
    assert (c.qk_rope_head_dim, v4.head_dim, v4.hc_mult, v4.sliding_window) == (64, 512, 4, 128)
    assert v4.main_rope.rope_type == "default" and v4.main_rope.theta == 10000
    r = v4.compress_rope
    assert (r.rope_type, r.theta, r.factor, r.attention_factor, r.original_max_position_embeddings) == (
        "yarn", 160000, 16, 1.0, 65536)  # fmt: skip
    assert (c.quant.scale_fmt, c.quant.expert_dtype, c.index_topk) == ("ue8m0", "fp4", 512)
    # the cache-state sizes deepseek_v4/model.py's docstring quotes (bf16)
    assert cache_bytes(c) == {"per_token": 6880, "window": 5_592_064, "running_max": 5_739_520}
