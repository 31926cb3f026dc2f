"""ModelConfig: the architecture read from a Hugging Face config.json (DeepSeek-V3 / V3.2 / V4).

The fields every model has are parsed here; the model's package (found through registry.py by
`model_type`) fills in its own: deepseek_v3/config.py (dense / MoE layer mix, rope, V3.2's
indexer), deepseek_v4/config.py (`ModelConfig.v4`). Defaults are transformers 5.24's, so a
config.json that omits a key means what it means to transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.model import registry
from pdserve.model.config_base import ConfigError, QuantConfig, RopeConfig

if TYPE_CHECKING:
    from pdserve.model.deepseek_v4.config import V4Config

__all__ = ["ConfigError", "ModelConfig", "QuantConfig", "RopeConfig"]


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    mlp_layer_types: tuple[str, ...] = ()  # "dense" | "sparse" per layer
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    # DeepSeek Sparse Attention (V3.2 only)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    quant: QuantConfig | None = None
    num_nextn_predict_layers: int = 0  # MTP layers the checkpoint holds (V3 / V3.2; V4's are in v4)
    v4: V4Config | None = None  # DeepSeek-V4 only: deepseek_v4/config.py

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The block of the FP8 weights the model keeps FP8; None when it has none (the loader
        builds from a config whose quant is None to dequantize at load: model/fp8.py)."""
        return None if self.quant is None else tuple(self.quant.weight_block_size)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_indexer(self) -> bool:
        return self.model_type == "deepseek_v32"

    def is_moe_layer(self, layer: int) -> bool:
        """Layers past num_hidden_layers (the MTP layer) are MoE."""
        return layer >= self.num_hidden_layers or self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return _parse(d)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {model_dir}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return _parse(d, source=str(path))


def _parse(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    model_type = d.get("model_type")
    if model_type not in registry.MODELS:
        raise ConfigError(f"{source}: unsupported model_type {model_type!r}; pdserve runs {sorted(registry.MODELS)}")
    entry = registry.MODELS[model_type]
    archs = d.get("architectures") or [entry.architecture]
    if entry.architecture not in archs:
        raise ConfigError(
            f"{source}: unsupported architectures {archs} for model_type {model_type!r}; "
            f"expected {entry.architecture!r}"
        )
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: unsupported hidden_act {d['hidden_act']!r}; only 'silu'")

    defaults = {f: getattr(ModelConfig, f) for f in ModelConfig.__dataclass_fields__ if hasattr(ModelConfig, f)}
    defaults.update(entry.config_defaults(model_type))
    kw: dict[str, Any] = {key: d[key] if d.get(key) is not None else defaults[key] for key in _PLAIN_KEYS}
    # keys where null is meaningful: no q LoRA, no BOS
    kw["q_lora_rank"] = d.get("q_lora_rank", defaults["q_lora_rank"])
    kw["bos_token_id"] = d.get("bos_token_id", defaults["bos_token_id"])
    # absent: transformers' default; explicit null: no grouping
    kw["n_group"] = int(d.get("n_group", defaults["n_group"]) or 1)
    kw["topk_group"] = int(d.get("topk_group", defaults["topk_group"]) or kw["n_group"])
    return ModelConfig(model_type=model_type, **entry.parse_config(d, model_type, kw, source))


_PLAIN_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "attention_bias", "rms_norm_eps", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "norm_topk_prob", "routed_scaling_factor", "max_position_embeddings", "tie_word_embeddings",
)  # fmt: skip
