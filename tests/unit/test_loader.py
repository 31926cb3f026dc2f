"""Checkpoint loading: sharded folders, transformers' and DeepSeek's names, FP8 block-scaled
weights, legacy rope_scaling, dtype choice, and the error messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM

from pdserve.model.config import ConfigError, ModelConfig
from pdserve.model.loader import CheckpointError, load_model
from tests.helpers.model import PagedHarness, Seq

pytestmark = pytest.mark.timeout(300)

# dims above 128 and not multiples of it, so FP8 blocks include partial ones
DIMS = dict(
    vocab_size=300, hidden_size=160, intermediate_size=200, moe_intermediate_size=136, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=144, q_lora_rank=136, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
    first_k_dense_replace=1, initializer_range=0.05,
)  # fmt: skip
ARCHS = {
    "v3": (DeepseekV3Config, DeepseekV3ForCausalLM, {}),
    "v32": (DeepseekV32Config, DeepseekV32ForCausalLM, dict(index_n_heads=4, index_head_dim=32, index_topk=4)),
}
PROMPT = [5, 77, 123, 9, 250, 31, 31, 8, 199, 64]


def _make(arch: str, path: Path, **extra) -> torch.nn.Module:
    cfg_cls, model_cls, arch_extra = ARCHS[arch]
    torch.manual_seed(0)
    ref = model_cls(cfg_cls(**{**DIMS, **arch_extra, **extra}, attn_implementation="eager")).eval()
    ref.save_pretrained(path)
    return ref


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base_v3")
    _make("v3", path)
    return path


@pytest.fixture(scope="module")
def base_v32(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base_v32")
    _make("v32", path)
    return path


def _logits(model) -> torch.Tensor:
    return PagedHarness(model).step([(Seq(), PROMPT)])[0]


def _load(path: Path, dtype=torch.float32, quantization=None):
    return load_model(path, dtype=dtype, device="cpu", progress=False, quantization=quantization)


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _write(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def _variant(base: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of `base` as one model.safetensors, with tensors and/or config edited."""
    tensors, config = load_file(str(base / "model.safetensors")), _config(base)
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    return _write(dst, tensors, config)


# ---------------------------------------------------------------- layouts and names


def test_sharded_checkpoint_matches_single_file(base, tmp_path):
    torch.manual_seed(0)
    ref = DeepseekV3ForCausalLM.from_pretrained(base)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="300KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file() and len(shards) >= 2
    assert torch.equal(_logits(_load(tmp_path / "sharded")), _logits(_load(base)))


def test_shards_without_index_are_found(base, tmp_path):
    tensors = load_file(str(base / "model.safetensors"))
    names = sorted(tensors)
    dst = tmp_path / "noindex"
    dst.mkdir()
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        save_file({n: tensors[n] for n in part}, str(dst / f"model-0000{i + 1}-of-00002.safetensors"))
    shutil.copy(base / "config.json", dst / "config.json")
    assert torch.equal(_logits(_load(dst)), _logits(_load(base)))


def _fuse_experts_and_add_mtp(t: dict[str, torch.Tensor]) -> None:
    """transformers' in-memory fused expert names, plus an MTP layer (index 2 of 2) to skip."""
    prefix = "model.layers.1.mlp.experts"
    gate_up = [torch.cat([t.pop(f"{prefix}.{e}.{p}_proj.weight") for p in ("gate", "up")]) for e in range(4)]
    t[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
    t[f"{prefix}.down_proj"] = torch.stack([t.pop(f"{prefix}.{e}.down_proj.weight") for e in range(4)])
    t["model.layers.2.eh_proj.weight"] = torch.zeros(160, 320)
    t["model.layers.2.mlp.experts.0.gate_proj.weight"] = torch.zeros(7, 7)
    t["model.layers.2.shared_head.head.weight"] = torch.zeros(300, 160)


def test_fused_expert_names_and_mtp_layers(base, tmp_path):
    fused = _variant(base, tmp_path / "fused", edit_tensors=_fuse_experts_and_add_mtp)
    assert torch.equal(_logits(_load(fused)), _logits(_load(base)))


def test_legacy_rope_scaling_matches_transformers(base, tmp_path):
    """DeepSeek's released configs use rope_scaling {"type": "yarn", ...} and a top-level rope_theta."""

    def legacy(c: dict) -> None:
        c.pop("rope_parameters")
        c["rope_theta"] = 5000.0
        c["max_position_embeddings"] = 512
        c["rope_scaling"] = {
            "type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7,
        }  # fmt: skip

    path = _variant(base, tmp_path / "legacy", edit_config=legacy)
    ref = DeepseekV3ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert ref.model.rotary_emb.rope_type == "yarn" and ref.config.rope_parameters["rope_theta"] == 5000.0
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    got = _logits(_load(path))
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_bfloat16_load_keeps_router_in_float32(base):
    model = _load(base, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert params["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert params["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert params["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert params["model.embed_tokens.weight"].dtype == torch.bfloat16
    ref = DeepseekV3ForCausalLM.from_pretrained(base, dtype=torch.bfloat16, attn_implementation="eager").eval()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0].float()
    got = _logits(model)
    assert got.dtype == torch.float32
    # against transformers in bf16, not our float32: bf16 rounding can flip a near-tied expert choice
    assert (got - want).abs().max() <= 3e-2 * want.abs().max()


def test_deepseek_release_config_fields():
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "eos_token_id": [1, 7],
            "q_lora_rank": 1536, "first_k_dense_replace": 3, "num_hidden_layers": 5, "rope_theta": 10000,
            "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [128, 128]},
        }
    )  # fmt: skip
    assert cfg.eos_token_ids == (1, 7)
    assert cfg.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 2
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 40 and cfg.rope.original_max_position_embeddings == 4096
    assert cfg.quant is not None and cfg.quant.weight_block_size == (128, 128)
    assert cfg.rope_interleave and not cfg.has_indexer


# ---------------------------------------------------------------- FP8 block-scaled weights


def _quantize_e4m3(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 block: scale = amax / 448, q = w / scale in e4m3; weight_scale_inv = scale."""
    N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    scale = torch.empty(nb, kb)
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _dequantize_reference(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block : (i + 1) * block, j * block : (j + 1) * block] *= scale[i, j]
    return out


def _is_quantized_in_release(name: str, t: torch.Tensor) -> bool:
    """DeepSeek ships linear weights of attention, MLPs and experts in FP8; not embeddings,
    norms, the router or the LM head."""
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "weights_proj")
    return t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip)


@pytest.mark.parametrize("arch", ["v3", "v32"])
def test_fp8_block_scaled_matches_dequantized_reference(arch, base, base_v32, tmp_path):
    src = base if arch == "v3" else base_v32
    tensors, config = load_file(str(src / "model.safetensors")), _config(src)
    fp8, deq = {}, {}
    for name, w in tensors.items():
        if _is_quantized_in_release(name, w):
            q, s = _quantize_e4m3(w)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = _dequantize_reference(q, s)
            assert (deq[name] - w).abs().max() <= 0.07 * w.abs().max(), name  # the scale convention
        else:
            fp8[name] = deq[name] = w
    assert any(s.shape[0] > 1 and s.shape[1] > 1 for n, s in fp8.items() if n.endswith("_scale_inv"))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    # dequantized at load (kept FP8: tests/unit/test_fp8_weights.py; moe_intermediate_size 136 is not
    # a multiple of the block, which FP8 experts need)
    m8 = _load(_write(tmp_path / "fp8", fp8, {**config, "quantization_config": quant}), quantization="none")
    md = _load(_write(tmp_path / "deq", deq, config))
    for (name, p8), (_, pd) in zip(m8.named_parameters(), md.named_parameters()):
        assert torch.equal(p8, pd), name
    assert torch.equal(_logits(m8), _logits(md))


# ---------------------------------------------------------------- errors


def test_missing_config(base, tmp_path):
    shutil.copy(base / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no config\.json in model folder"):
        _load(tmp_path)


def test_missing_weights(base, tmp_path):
    shutil.copy(base / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        _load(tmp_path)


def test_missing_shard(base, tmp_path):
    DeepseekV3ForCausalLM.from_pretrained(base).save_pretrained(tmp_path, max_shard_size="300KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{victim.name} listed in model\.safetensors\.index\.json"):
        _load(tmp_path)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.update(model_type="llama"), r"unsupported model_type 'llama'"),
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), r"unsupported architectures \['LlamaForCausalLM'\]"),
        (lambda c: c.update(quantization_config={"quant_method": "awq"}), r"unsupported quantization method 'awq'"),
        (lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0}), r"unsupported rope type 'llama3'"),
    ],
    ids=["model_type", "architectures", "quantization", "rope_type"],
)
def test_config_errors(base, tmp_path, edit, match):
    path = _variant(base, tmp_path / "bad", edit_config=edit)
    with pytest.raises(ConfigError, match=match):
        _load(path)


def _set(name: str, value: torch.Tensor):
    return lambda t: t.__setitem__(name, value)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            _set("model.layers.0.self_attn.kv_b_proj.weight", torch.zeros(64, 100)),
            r"shape mismatch for model\.layers\.0\.self_attn\.kv_b_proj\.weight in .*model\.safetensors: "
            r"expected \(64, 144\), got \(64, 100\)",
        ),
        (
            lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
            r"missing tensor\(s\) in .*: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight",
        ),
        (
            _set("model.layers.0.self_attn.foo.weight", torch.zeros(2)),
            r"unexpected tensor model\.layers\.0\.self_attn\.foo\.weight in .*model\.safetensors",
        ),
        (
            _set("model.layers.1.mlp.experts.9.up_proj.weight", torch.zeros(136, 160)),
            r"unexpected tensor model\.layers\.1\.mlp\.experts\.9\.up_proj\.weight .*n_routed_experts 4",
        ),
    ],
    ids=["shape", "missing", "unexpected", "expert_out_of_range"],
)
def test_tensor_errors(base, tmp_path, edit, match):
    path = _variant(base, tmp_path / "bad", edit_tensors=edit)
    with pytest.raises(CheckpointError, match=match):
        _load(path)


def _fp8_without_scale(t: dict[str, torch.Tensor]) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    t[name] = t[name].to(torch.float8_e4m3fn)


def test_fp8_weight_without_scale(base, tmp_path):
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    add_quant = lambda c: c.update(quantization_config=quant)  # noqa: E731
    path = _variant(base, tmp_path / "bad", edit_tensors=_fp8_without_scale, edit_config=add_quant)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight in .* but .*o_proj\.weight_scale_inv is missing"):
        _load(path, quantization="none")  # kept FP8: tests/unit/test_fp8_weights.py


def test_fp8_weight_without_quantization_config(base, tmp_path):
    path = _variant(base, tmp_path / "bad", edit_tensors=_fp8_without_scale)
    match = r"o_proj\.weight in .* is torch\.float8_e4m3fn but config\.json has no quantization_config"
    with pytest.raises(CheckpointError, match=match):
        _load(path)
