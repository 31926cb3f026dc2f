"""DeepSeek-V3 / V3.2 fields of ModelConfig, parsed from config.json as transformers 5.24's
DeepseekV3Config / DeepseekV32Config do.

The dense / MoE layer mix comes from `mlp_layer_types` (V3.2) or `first_k_dense_replace`; RoPE
parameters from `rope_parameters` (transformers 5) or the older `rope_scaling` + top-level
`rope_theta`. V3.2 adds the indexer of DeepSeek Sparse Attention (`index_*`).
"""

from __future__ import annotations

from typing import Any

from pdserve.model.config_base import ConfigError, RopeConfig, eos_ids, parse_quant, parse_rope_params

# transformers' defaults where V3 and V3.2 differ
_DEFAULTS = {
    "deepseek_v3": {"max_position_embeddings": 4096},
    "deepseek_v32": {"max_position_embeddings": 163840},
}


def defaults(model_type: str) -> dict[str, Any]:
    """ModelConfig defaults of `model_type` where they differ from ModelConfig's own."""
    return _DEFAULTS[model_type]


def parse(d: dict[str, Any], model_type: str, kw: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelConfig fields of config.json `d`: the shared ones parsed in `kw`, plus V3's."""
    kw["mlp_layer_types"] = _mlp_layer_types(d, model_type, kw["num_hidden_layers"], source)
    kw["rope"] = _parse_rope(d, kw["max_position_embeddings"], source)
    # V3.2's MLA always uses interleaved rope (transformers ignores the flag there)
    kw["rope_interleave"] = True if model_type == "deepseek_v32" else bool(d.get("rope_interleave", True))
    kw["eos_token_ids"] = eos_ids(d.get("eos_token_id", 1))
    kw["quant"] = parse_quant(d.get("quantization_config"), source)
    kw["num_nextn_predict_layers"] = int(d.get("num_nextn_predict_layers") or 0)
    if model_type == "deepseek_v32":
        kw["index_n_heads"] = int(d.get("index_n_heads", 64))
        kw["index_head_dim"] = int(d.get("index_head_dim", 128))
        kw["index_topk"] = int(d.get("index_topk", 2048))
        if kw["q_lora_rank"] is None:
            raise ConfigError(f"{source}: deepseek_v32 needs q_lora_rank (its indexer reads the q LoRA)")
    _validate(kw, model_type == "deepseek_v32", source)
    return kw


def _mlp_layer_types(d: dict[str, Any], model_type: str, num_layers: int, source: str) -> tuple[str, ...]:
    types = d.get("mlp_layer_types") if model_type == "deepseek_v32" else None
    if types is None:
        k = d.get("first_k_dense_replace")
        k = 3 if k is None else int(k)
        n_dense = min(k, num_layers)
        types = ["dense"] * n_dense + ["sparse"] * (num_layers - n_dense)
    if len(types) != num_layers or any(t not in ("dense", "sparse") for t in types):
        raise ConfigError(f"{source}: mlp_layer_types must list 'dense'/'sparse' for each of {num_layers} layers")
    return tuple(types)


def _parse_rope(d: dict[str, Any], max_pos: int, source: str) -> RopeConfig:
    p = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    p.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    return parse_rope_params(p, max_pos, source, d.get("original_max_position_embeddings"))


def _validate(c: dict[str, Any], has_indexer: bool, source: str) -> None:
    n_experts, n_group, topk_group, rope = c["n_routed_experts"], c["n_group"], c["topk_group"], c["qk_rope_head_dim"]
    if n_experts % n_group:
        raise ConfigError(f"{source}: n_routed_experts {n_experts} not divisible by n_group {n_group}")
    if topk_group > n_group:
        raise ConfigError(f"{source}: topk_group {topk_group} exceeds n_group {n_group}")
    if rope % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim must be even, got {rope}")
    if has_indexer and c["index_head_dim"] < rope:
        raise ConfigError(f"{source}: index_head_dim {c['index_head_dim']} < qk_rope_head_dim {rope}")
