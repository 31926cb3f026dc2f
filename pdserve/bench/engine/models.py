"""The models `pdserve bench-engine` builds: the layer dimensions of DeepSeek-V3.2 and
DeepSeek-V4-Flash as their released config.json give them (bf16; --dtype fp8 / fp4 add the
quantization_config: `bench_config`), and the tiny test models.

`--num-layers N` keeps the released proportions of layer kinds, at least one of each:
  - V3.2 (61 layers, the first 3 dense MLP, then MoE): max(1, round(3N/61)) dense, the rest MoE;
  - V4-Flash (43 layers: 2 sliding-window-only, then CSA and HCA alternating from CSA: 21 CSA,
    20 HCA; the first 3 MoE hash-routed): max(1, round(2N/43)) sliding, then CSA / HCA
    alternating, and max(1, round(3N/43)) hash-routed MoE layers first.
So N = 8 is V3.2 1 dense + 7 MoE and V4 1 sliding + 4 CSA + 3 HCA, 1 hash-routed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pdserve.model.deepseek_v4.config import CSA, HCA, SLIDING
from pdserve.tiny_model import tiny_config, tiny_v4_config

V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "first_k_dense_replace": 3, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip

V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "compress_ratios": [0, 0] + [4, 128] * 20 + [4], "num_hash_layers": 3,
    "sliding_window": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "num_nextn_predict_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1048576, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip

TINY_VOCAB = 512
# FP8 weights (--quantization fp8): DeepSeek's 128 x 128 blocks; the tiny models' experts are 64
# wide, and FP8 experts need their width a multiple of the block
FP8_BLOCK = {"v3.2": 128, "v4-flash": 128, "tiny-v3.2": 32, "tiny-v4": 32}
MODELS = {
    "v3.2": lambda: dict(V32),
    "v4-flash": lambda: dict(V4_FLASH),
    "tiny-v3.2": lambda: tiny_config("deepseek_v32", TINY_VOCAB),
    "tiny-v4": lambda: tiny_v4_config(TINY_VOCAB),
}


def engine_quantization(quantization: str | None) -> str | None:
    """The engine's --quantization for a bench one: "fp4" is an FP8 quantization_config (with FP4
    experts), which the engine keeps as it is."""
    return "fp8" if quantization == "fp4" else quantization


def real_num_layers(name: str) -> int:
    return MODELS[name]()["num_hidden_layers"]


# what pdserve's tensor parallelism splits (model/parallel.py): attention heads (V4: and its
# o_groups), every routed and shared expert's intermediate dim, the dense MLP's; the rest
# (the low-rank q/kv projections, the indexer, compressors, router, embedding, lm_head) is
# replicated on every rank
TP_SPLIT = {
    "deepseek_v4": ("num_attention_heads", "o_groups", "moe_intermediate_size"),
    "deepseek_v32": ("num_attention_heads", "num_key_value_heads", "moe_intermediate_size", "intermediate_size"),
}


def tp_shard(d: dict, size: int) -> dict:
    """One rank's share of a tensor-parallel-`size` worker as a model of its own: the split
    dimensions divided by size. Its step is one rank's compute; the all-reduces are not in it."""
    if size == 1:
        return d
    d = dict(d)
    for key in TP_SPLIT[d["model_type"]]:
        if d[key] % size:
            raise ValueError(f"--tp-shard {size}: {key} ({d[key]}) does not split {size} ways")
        d[key] //= size
    return d


def bench_config(
    name: str, num_layers: int | None = None, quantization: str | None = None, tp_shard_size: int = 1
) -> dict:
    """config.json of model `name` with `num_layers` layers (None: all of them), kinds mixed as
    the module docstring says; quantization "fp8": with an FP8 quantization_config; "fp4"
    (DeepSeek-V4): the same with FP4 routed experts (expert_dtype fp4), as V4-Flash ships;
    tp_shard_size > 1: one rank's share of a tensor-parallel worker of that size (tp_shard)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    d = tp_shard(MODELS[name](), tp_shard_size)
    if quantization in ("fp8", "fp4"):
        block = [FP8_BLOCK[name]] * 2
        d["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": block,
        }
    if quantization == "fp4":
        d["quantization_config"].update(scale_fmt="ue8m0", expert_dtype="fp4")
    full = d["num_hidden_layers"]
    n = full if num_layers is None else num_layers
    if n < 1:
        raise ValueError(f"--num-layers must be >= 1, got {n}")
    d["num_hidden_layers"] = n
    if d["model_type"] == "deepseek_v4":
        types, mlp = v4_layer_mix(n)
        for key in ("compress_ratios", "num_hash_layers"):
            d.pop(key, None)
        d.update(layer_types=types, mlp_layer_types=mlp)
    else:
        d.pop("mlp_layer_types", None)
        d["first_k_dense_replace"] = _share(d.get("first_k_dense_replace", 3), full, n)
    return d


def v4_layer_mix(n: int) -> tuple[list[str], list[str]]:
    """(layer_types, mlp_layer_types) of an n-layer V4-Flash."""
    sliding, hashed = _share(2, 43, n), _share(3, 43, n)
    types = [SLIDING] * sliding + [CSA if i % 2 == 0 else HCA for i in range(n - sliding)]
    return types, ["hash_moe"] * hashed + ["moe"] * (n - hashed)


def _share(count: int, of: int, n: int) -> int:
    """count layers of `of`, scaled to n layers and rounded half up: at least one, at most n."""
    return min(n, max(1, math.floor(count * n / of + 0.5)))


def write_config(d: dict, folder: Path) -> Path:
    """A model folder holding only config.json (what load_format dummy needs)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d, indent=1) + "\n")
    return folder
