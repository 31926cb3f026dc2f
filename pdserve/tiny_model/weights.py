"""The tiny checkpoints' config.json and random weights: DeepSeek-V3 / V3.2 (4 layers and an MTP
layer) and V4 (5 layers), float32 and named as transformers 5.24 saves them; and the tiny V4
checkpoint in DeepSeek-V4-Flash's formats (`quantize_tiny_v4`: FP4 experts, FP8 projections)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# the config.json keys every tiny architecture shares (transformers' names and values)
_HF_COMMON = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": None,
    "use_cache": True,
    "dtype": "float32",
}


def tiny_config(arch: str, vocab_size: int) -> dict:
    """config.json for a 4-layer model: layer 0 dense, layers 1-3 MoE (8 experts, top-2)."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM" if arch == "deepseek_v3" else "DeepseekV32ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        # YaRN as DeepSeek ships it (factor 4 over a 1024-token original context).
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        **_HF_COMMON,
    }
    config["num_nextn_predict_layers"] = 1  # the MTP layer (tiny_mtp_weights), as DeepSeek ships it
    if arch == "deepseek_v3":
        config.update(rope_interleave=True)
    else:
        # index_topk < typical test prompts, so the sparse path differs from dense attention.
        # 16 index heads: with few heads every ReLU'd head score is 0 for a noticeable share of
        # keys, and those exact ties make top-k (hence tokens) differ between CPU and CUDA.
        config.update(index_n_heads=16, index_head_dim=32, index_topk=16)
    return config


def tiny_weights(config: dict, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Random float32 weights for `config` (drawn on `device`), named as transformers 5.24 saves them."""
    gen = torch.Generator(device).manual_seed(seed)
    std = config["initializer_range"]

    def normal(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32, device=device) * scale

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float32, device=device)

    hidden, vocab = config["hidden_size"], config["vocab_size"]
    w = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(hidden)
        w[p + "post_attention_layernorm.weight"] = ones(hidden)
        w.update({p + "self_attn." + k: v for k, v in _attention(config, normal, ones).items()})
        if i < config["first_k_dense_replace"]:
            w.update({p + "mlp." + k: v for k, v in _mlp(hidden, config["intermediate_size"], normal).items()})
        else:
            w.update({p + "mlp." + k: v for k, v in _moe(config, normal).items()})
    w["model.norm.weight"] = ones(hidden)
    w["lm_head.weight"] = normal(vocab, hidden)
    return w


# the MTP layer's weights are drawn from a generator of their own (seed + this), after the others,
# so adding the layer left every main-model tensor as it was
MTP_SEED_OFFSET = 0x3717


def tiny_mtp_weights(config: dict, main: dict[str, torch.Tensor], seed: int, device: str = "cpu") -> dict:
    """The MTP layer `model.layers.{num_hidden_layers}.*` for `config` under DeepSeek's names (a
    decoder layer, always MoE, plus enorm, hnorm, eh_proj, shared_head and embed_tokens; the
    last two copies of the main model's `lm_head` and embedding, as DeepSeek's releases store them)."""
    gen = torch.Generator(device).manual_seed(seed + MTP_SEED_OFFSET)

    def normal(*shape: int, scale: float = config["initializer_range"]) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32, device=device) * scale

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float32, device=device)

    hidden, p = config["hidden_size"], f"model.layers.{config['num_hidden_layers']}."
    w = {p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden)}
    w.update({p + "self_attn." + k: v for k, v in _attention(config, normal, ones).items()})
    w.update({p + "mlp." + k: v for k, v in _moe(config, normal).items()})
    w[p + "enorm.weight"] = ones(hidden)
    w[p + "hnorm.weight"] = ones(hidden)
    w[p + "eh_proj.weight"] = normal(hidden, 2 * hidden)
    w[p + "shared_head.norm.weight"] = ones(hidden)
    w[p + "shared_head.head.weight"] = main["lm_head.weight"].clone()
    w[p + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    return w


def _attention(config: dict, normal, ones) -> dict[str, torch.Tensor]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    w = {
        "q_a_proj.weight": normal(q_rank, hidden),
        "q_a_layernorm.weight": ones(q_rank),
        "q_b_proj.weight": normal(heads * (nope + rope), q_rank),
        "kv_a_proj_with_mqa.weight": normal(kv_rank + rope, hidden),
        "kv_a_layernorm.weight": ones(kv_rank),
        "kv_b_proj.weight": normal(heads * (nope + v), kv_rank),
        "o_proj.weight": normal(hidden, heads * v),
    }
    if config["model_type"] == "deepseek_v32":
        index_heads, index_dim = config["index_n_heads"], config["index_head_dim"]
        w["indexer.wq_b.weight"] = normal(index_heads * index_dim, q_rank)
        w["indexer.wk.weight"] = normal(index_dim, hidden)
        w["indexer.k_norm.weight"] = ones(index_dim)
        w["indexer.k_norm.bias"] = torch.zeros_like(w["indexer.k_norm.weight"])
        w["indexer.weights_proj.weight"] = normal(index_heads, hidden)
    return w


def _mlp(hidden: int, inter: int, normal) -> dict[str, torch.Tensor]:
    return {
        "gate_proj.weight": normal(inter, hidden),
        "up_proj.weight": normal(inter, hidden),
        "down_proj.weight": normal(hidden, inter),
    }


def _moe(config: dict, normal) -> dict[str, torch.Tensor]:
    hidden, inter, experts = config["hidden_size"], config["moe_intermediate_size"], config["n_routed_experts"]
    # A non-zero correction bias, so that routing by biased scores is exercised.
    w = {"gate.weight": normal(experts, hidden), "gate.e_score_correction_bias": normal(experts)}
    for e in range(experts):
        w.update({f"experts.{e}.{k}": v for k, v in _mlp(hidden, inter, normal).items()})
    shared = _mlp(hidden, inter * config["n_shared_experts"], normal)
    w.update({f"shared_experts.{k}": v for k, v in shared.items()})
    return w


def tiny_v4_config(vocab_size: int) -> dict:
    """config.json for a 5-layer DeepSeek-V4: sliding, HCA, CSA, HCA, CSA attention and a sliding
    MTP layer; the first two MoE layers hash-routed; 4 residual streams. A window of 8 and compress rates 4 (CSA) and 16
    (HCA) make short prompts cross the window and close entries of both compressors, and
    index_topk 4 makes the indexer drop entries from about 20 tokens on."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,  # 16 rope dims
        "q_lora_rank": 64,
        "o_groups": 2,
        "o_lora_rank": 32,
        "layer_types": [
            "sliding_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "sliding_attention",  # the MTP layer's (v4_mtp.py), as V4-Flash's last compress ratio 0
        ],  # fmt: skip
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
        "sliding_window": 8,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        # 16 index heads: with few heads an all-zero ReLU'd score is common and ties make top-k arbitrary
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 4,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        # YaRN on the compressed layers, as V4-Flash ships it (factor 4 over a 1024-token original context)
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },  # fmt: skip
        **_HF_COMMON,
    }


def tiny_v4_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 weights for a V4 `config`, named as transformers 5.24 saves them (pdserve's
    V4 module names are transformers', so the names come from the model built on meta)."""
    from pdserve.model.config import ModelConfig
    from pdserve.model.deepseek_v4.model import DeepseekV4ForCausalLM

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(ModelConfig.from_dict(config))
    gen = torch.Generator().manual_seed(seed)
    std, experts, top_k = config["initializer_range"], config["n_routed_experts"], config["num_experts_per_tok"]

    def normal(shape, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * scale

    w: dict[str, torch.Tensor] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("tid2eid"):  # k distinct experts per token id
            w[name] = torch.rand(config["vocab_size"], experts, generator=gen).argsort(-1)[:, :top_k].contiguous()
        elif name.endswith(("norm.weight", "scale", "hc_scale")):
            w[name] = torch.ones(t.shape)
        elif name.endswith(("sinks", "position_bias", "base", "hc_base", "e_score_correction_bias")):
            w[name] = normal(t.shape, 0.5)  # non-zero: sinks, position bias and routing bias matter
        else:
            w[name] = normal(t.shape)
    return w


# where DeepSeek-V4-Flash ships FP8: the 2-D projections, except the embedding, the head, norms,
# the routed experts (FP4), the router and the compressors' kv / gate and the indexer's weights
# (bf16: transformers' deepseek_v4 lists them)
_V4_NOT_FP8 = (
    "embed_tokens.", "lm_head.", "norm.", ".experts.", ".mlp.gate.", "compressor.kv_proj", "compressor.gate_proj",
    "indexer.kv_proj", "indexer.gate_proj", "weights_proj",
)  # fmt: skip


def quantize_tiny_v4(
    src: str | Path, quant_dir: str | Path, ref_dir: str | Path, block: tuple[int, int] = (128, 128)
) -> tuple[Path, Path]:
    """Two checkpoints from the float V4 checkpoint in `src` (its other files copied): `quant_dir`
    in DeepSeek-V4-Flash's formats - routed experts FP4 e2m1, one tensor per expert and projection
    (`model.layers.N.mlp.experts.E.w1.weight` int8 [I, hidden/2] with `.scale` float8_e8m0fnu
    [I, hidden/32]; w3, w2 alike), the other projections FP8 e4m3 with a ue8m0 scale per `block`
    (`.weight_scale_inv`; the release's is 128x128, a tiny model's tensor-parallel shards need
    32x32), config.json's quantization_config saying so - and `ref_dir` with those same values
    dequantized to float32 (transformers' checkpoint for the oracle)."""
    from safetensors.torch import load_file

    from pdserve.model.deepseek_v4.loader import hf_name
    from pdserve.model.fp4 import dequantize_fp4, quantize_fp4, scales_to_float
    from pdserve.model.fp8 import dequantize_block_fp8

    src, quant_dir, ref_dir = Path(src), Path(quant_dir), Path(ref_dir)
    quant, ref = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            projs = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
            ref[name] = torch.empty_like(t)
            for e in range(t.shape[0]):
                for proj, w, rows in zip(projs, t[e].chunk(len(projs)), ref[name][e].chunk(len(projs))):
                    base = f"{name.rsplit('.', 1)[0]}.{e}.{proj}"
                    quant[f"{base}.weight"], quant[f"{base}.scale"] = quantize_fp4(w)
                    rows.copy_(dequantize_fp4(quant[f"{base}.weight"], quant[f"{base}.scale"]))
        elif name.startswith("mtp.") and ".experts." in name:  # the MTP layer's, one per expert (release)
            quant[name], quant[name.removesuffix("weight") + "scale"] = q, scale = quantize_fp4(t)
            ref[name] = dequantize_fp4(q, scale)
        elif name.endswith(".weight") and t.dim() == 2 and not any(s in hf_name(name) for s in _V4_NOT_FP8):
            q, scale = _block_fp8(t, block)  # release names (mtp.*) take `.scale`
            quant[name] = q
            quant[name.removesuffix("weight") + "scale" if name.startswith("mtp.") else name + "_scale_inv"] = scale
            ref[name] = dequantize_block_fp8(q, scales_to_float(scale), block)
        else:
            quant[name] = ref[name] = t
    config = json.loads((src / "config.json").read_text())
    quant_config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": list(block),
        "expert_dtype": "fp4",
    }
    for out, tensors, extra in ((quant_dir, quant, {"quantization_config": quant_config}), (ref_dir, ref, {})):
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (out / f.name).write_bytes(f.read_bytes())
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
        )
        write_json(out / "config.json", {**config, **extra})
    return quant_dir, ref_dir


def _block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float8_e8m0fnu [ceil(N/bn), ceil(K/bk)]): per block the smallest
    power of two s with amax / s <= 448."""
    (N, K), (bn, bk) = w.shape, block
    gn, gk = -(-N // bn), -(-K // bk)
    blocks = torch.nn.functional.pad(w.float(), (0, gk * bk - K, 0, gn * bn - N)).view(gn, bn, gk, bk)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(dim=(1, 3)).clamp(min=2.0**-100) / 448.0)))
    q = (blocks / scale[:, None, :, None]).view(gn * bn, gk * bk)[:N, :K].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.to(torch.float8_e8m0fnu)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
