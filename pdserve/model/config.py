"""ModelConfig: the architecture read from a Hugging Face config.json (DeepSeek-V3 / V3.2 / V4).

Defaults are transformers 5.24's (DeepseekV3Config / DeepseekV32Config), so a config.json that
omits a key means what it means to transformers. RoPE parameters come from `rope_parameters`
(transformers 5) or the older `rope_scaling` + top-level `rope_theta`. V4's own fields live in
`ModelConfig.v4` (see config_v4.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.model.config_base import ConfigError, RopeConfig, parse_rope_params
from pdserve.model.config_v4 import V4_DEFAULTS, parse_v4

if TYPE_CHECKING:
    from pdserve.model.config_v4 import V4Config


ARCHITECTURES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
}

# transformers' defaults where V3 and V3.2 differ
_ARCH_DEFAULTS = {
    "deepseek_v3": {"max_position_embeddings": 4096},
    "deepseek_v32": {"max_position_embeddings": 163840},
    "deepseek_v4": {},  # filled from config_v4.V4_DEFAULTS
}


@dataclass(frozen=True)
class QuantConfig:
    method: str  # only "fp8" (e4m3, block-scaled: kept FP8, or dequantized at load with --quantization none)
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"  # "float" (fp32 scales, V3) or "ue8m0" (power-of-two byte scales, V4)
    expert_dtype: str = "fp8"  # "fp8", or "fp4" (e2m1, one ue8m0 scale per 32 values: V4's routed experts)


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
    v4: "V4Config | None" = None  # DeepSeek-V4 only

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
        return self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return _parse(d)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
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
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"{source}: unsupported model_type {model_type!r}; pdserve runs {sorted(ARCHITECTURES)}"
        )
    archs = d.get("architectures") or [ARCHITECTURES[model_type]]
    if ARCHITECTURES[model_type] not in archs:
        raise ConfigError(
            f"{source}: unsupported architectures {archs} for model_type {model_type!r}; "
            f"expected {ARCHITECTURES[model_type]!r}"
        )
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: unsupported hidden_act {d['hidden_act']!r}; only 'silu'")

    defaults = {f: getattr(ModelConfig, f) for f in ModelConfig.__dataclass_fields__ if hasattr(ModelConfig, f)}
    defaults.update(_ARCH_DEFAULTS[model_type])
    if model_type == "deepseek_v4":

        defaults.update(V4_DEFAULTS)
    kw: dict[str, Any] = {key: d[key] if d.get(key) is not None else defaults[key] for key in _PLAIN_KEYS}
    # keys where null is meaningful: no q LoRA, no BOS
    kw["q_lora_rank"] = d.get("q_lora_rank", defaults["q_lora_rank"])
    kw["bos_token_id"] = d.get("bos_token_id", defaults["bos_token_id"])
    num_layers = kw["num_hidden_layers"]
    # absent: transformers' default; explicit null: no grouping
    kw["n_group"] = int(d.get("n_group", defaults["n_group"]) or 1)
    kw["topk_group"] = int(d.get("topk_group", defaults["topk_group"]) or kw["n_group"])
    if model_type == "deepseek_v4":
        return _parse_v4(d, kw, source)
    kw["mlp_layer_types"] = _mlp_layer_types(d, model_type, num_layers, source)
    kw["rope"] = _parse_rope(d, kw["max_position_embeddings"], source)
    # V3.2's MLA always uses interleaved rope (transformers ignores the flag there)
    kw["rope_interleave"] = True if model_type == "deepseek_v32" else bool(d.get("rope_interleave", True))
    kw["eos_token_ids"] = _eos_ids(d.get("eos_token_id", 1))
    kw["quant"] = _parse_quant(d.get("quantization_config"), source)
    if model_type == "deepseek_v32":
        kw["index_n_heads"] = int(d.get("index_n_heads", 64))
        kw["index_head_dim"] = int(d.get("index_head_dim", 128))
        kw["index_topk"] = int(d.get("index_topk", 2048))
        if kw["q_lora_rank"] is None:
            raise ConfigError(f"{source}: deepseek_v32 needs q_lora_rank (its indexer reads the q LoRA)")
    cfg = ModelConfig(model_type=model_type, **kw)
    _validate(cfg, source)
    return cfg


def _parse_v4(d: dict[str, Any], kw: dict[str, Any], source: str) -> ModelConfig:

    n = kw["num_hidden_layers"]
    v4, kw["qk_rope_head_dim"] = parse_v4(d, n, kw["max_position_embeddings"], source)
    kw.update(
        mlp_layer_types=("sparse",) * n,  # MoE everywhere; hash or routed: v4.mlp_layer_types
        intermediate_size=kw["moe_intermediate_size"],  # the shared expert's width
        n_group=1,
        topk_group=1,
        rope=v4.main_rope,
        eos_token_ids=_eos_ids(d.get("eos_token_id", 1)),
        quant=_parse_quant(d.get("quantization_config"), source, d.get("expert_dtype")),
        index_n_heads=int(d.get("index_n_heads") or 64),
        index_head_dim=int(d.get("index_head_dim") or 128),
        index_topk=int(d.get("index_topk") or 512),
        v4=v4,
    )
    if kw["q_lora_rank"] is None:
        raise ConfigError(f"{source}: deepseek_v4 needs q_lora_rank (queries and indexer read the q LoRA)")
    return ModelConfig(model_type="deepseek_v4", **kw)


_PLAIN_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "attention_bias", "rms_norm_eps", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "norm_topk_prob", "routed_scaling_factor", "max_position_embeddings", "tie_word_embeddings",
)  # fmt: skip


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


def _eos_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _parse_quant(q: dict[str, Any] | None, source: str, expert_dtype: str | None = None) -> QuantConfig | None:
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(
            f"{source}: unsupported quantization method {method!r}; pdserve loads 'fp8' (block-scaled e4m3)"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{source}: unsupported fp8 format {q['fmt']!r}; only 'e4m3'")
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise ConfigError(f"{source}: fp8 quantization needs weight_block_size [rows, cols], got {block!r}")
    scale_fmt = q.get("scale_fmt") or "float"
    expert_dtype = q.get("expert_dtype") or expert_dtype or "fp8"
    if scale_fmt not in ("float", "ue8m0") or expert_dtype not in ("fp8", "fp4"):
        raise ConfigError(
            f"{source}: unsupported fp8 scale_fmt {scale_fmt!r} / expert_dtype {expert_dtype!r}; "
            "pdserve reads scale_fmt 'float' or 'ue8m0' and expert_dtype 'fp8' or 'fp4'"
        )
    block_size = (int(block[0]), int(block[1]))
    return QuantConfig(method="fp8", weight_block_size=block_size, scale_fmt=scale_fmt, expert_dtype=expert_dtype)


def _validate(c: ModelConfig, source: str) -> None:
    if c.n_routed_experts % c.n_group:
        raise ConfigError(f"{source}: n_routed_experts {c.n_routed_experts} not divisible by n_group {c.n_group}")
    if c.topk_group > c.n_group:
        raise ConfigError(f"{source}: topk_group {c.topk_group} exceeds n_group {c.n_group}")
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim must be even, got {c.qk_rope_head_dim}")
    if c.has_indexer and c.index_head_dim < c.qk_rope_head_dim:
        raise ConfigError(f"{source}: index_head_dim {c.index_head_dim} < qk_rope_head_dim {c.qk_rope_head_dim}")
