"""DeepSeek-V4 fields of ModelConfig, parsed from config.json as transformers 5.24's DeepseekV4Config does.

Modern fields (`layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters` nested by rope
kind "main" / "compress", `partial_rotary_factor`) and the legacy ones the DeepSeek release ships
(`compress_ratios` per layer with 0 / 4 / 128, `compress_rate_csa` / `compress_rate_hca`,
`num_hash_layers`, `qk_rope_head_dim`, a flat `rope_parameters` / `rope_scaling` that applies to
the compressed layers) mean what they mean to transformers. Defaults are V4-Flash's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.model.config_base import ConfigError, RopeConfig, eos_ids, parse_quant, parse_rope_params

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # transformers' fixed map for legacy compress_ratios


@dataclass(frozen=True)
class V4Config:
    """What V4 adds to ModelConfig (shared fields - hidden size, heads, q LoRA, experts, indexer
    sizes, quantization - stay on ModelConfig)."""

    head_dim: int = 512  # one shared K=V head: [nope | rope]
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    csa_rate: int = 4
    hca_rate: int = 128
    main_rope: RopeConfig = RopeConfig()  # sliding-only layers
    compress_rope: RopeConfig = RopeConfig()  # CSA / HCA layers: attention, compressors, indexer
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    swiglu_limit: float = 10.0
    scoring_func: str = "sqrtsoftplus"
    num_nextn_predict_layers: int = 1
    mtp_layer_types: tuple[str, ...] = ()  # the entries of layer_types past the main layers (the MTP layers')

    def compress_rate(self, layer: int) -> int:
        """Source tokens per compressed entry of `layer` (0: sliding-only)."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[layer]]


V4_DEFAULTS = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
    q_lora_rank=1024, qk_rope_head_dim=64, num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1,
    routed_scaling_factor=1.5, max_position_embeddings=1048576, index_n_heads=64, index_head_dim=128,
    index_topk=512,
)  # fmt: skip


def defaults(model_type: str) -> dict[str, Any]:
    """ModelConfig defaults of deepseek_v4 where they differ from ModelConfig's own: V4-Flash's."""
    return V4_DEFAULTS


def parse(d: dict[str, Any], model_type: str, kw: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelConfig fields of config.json `d`: the shared ones parsed in `kw`, V4's in `v4`."""
    n = kw["num_hidden_layers"]
    v4, kw["qk_rope_head_dim"] = parse_v4(d, n, kw["max_position_embeddings"], source)
    kw.update(
        mlp_layer_types=("sparse",) * n,  # MoE everywhere; hash or routed: v4.mlp_layer_types
        intermediate_size=kw["moe_intermediate_size"],  # the shared expert's width
        n_group=1,
        topk_group=1,
        rope=v4.main_rope,
        eos_token_ids=eos_ids(d.get("eos_token_id", 1)),
        quant=parse_quant(d.get("quantization_config"), source, d.get("expert_dtype")),
        index_n_heads=int(d.get("index_n_heads") or 64),
        index_head_dim=int(d.get("index_head_dim") or 128),
        index_topk=int(d.get("index_topk") or 512),
        v4=v4,
    )
    if kw["q_lora_rank"] is None:
        raise ConfigError(f"{source}: deepseek_v4 needs q_lora_rank (queries and indexer read the q LoRA)")
    return kw


def parse_v4(d: dict[str, Any], num_layers: int, max_pos: int, source: str) -> tuple[V4Config, int]:
    """The V4Config and qk_rope_head_dim of config.json `d`."""
    head_dim = int(d.get("head_dim") or 512)
    if d.get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * float(d["partial_rotary_factor"]))
    else:
        rope_dim = int(d.get("qk_rope_head_dim") or 64)
    rates = {CSA: 4, HCA: 128, **(d.get("compress_rates") or {})}
    if d.get("compress_rate_csa") is not None:
        rates[CSA] = int(d["compress_rate_csa"])
    if d.get("compress_rate_hca") is not None:
        rates[HCA] = int(d["compress_rate_hca"])
    main, compress = _ropes(d, max_pos, source)
    cfg = V4Config(
        head_dim=head_dim,
        layer_types=_layer_types(d, num_layers, source),
        mtp_layer_types=_layer_types(d, None, source)[num_layers:],
        mlp_layer_types=_mlp_layer_types(d, num_layers, source),
        csa_rate=int(rates[CSA]),
        hca_rate=int(rates[HCA]),
        main_rope=main,
        compress_rope=compress,
        **{k: type(getattr(V4Config, k))(d[k]) for k in _PLAIN_V4_KEYS if d.get(k) is not None},
    )
    _validate(cfg, d, rope_dim, source)
    return cfg, rope_dim


_PLAIN_V4_KEYS = (
    "hc_mult", "hc_sinkhorn_iters", "hc_eps", "o_groups", "o_lora_rank", "sliding_window", "swiglu_limit",
    "scoring_func", "num_nextn_predict_layers",
)  # fmt: skip


def _layer_types(d: dict[str, Any], n: int | None, source: str) -> tuple[str, ...]:
    """The first n entries (n None: all the config lists, those of the MTP layers included)."""
    types = d.get("layer_types")
    if types is None and d.get("compress_ratios") is not None:
        bad = [r for r in d["compress_ratios"] if r not in _RATIO_TO_TYPE]
        if bad:
            raise ConfigError(f"{source}: compress_ratios entries must be 0, 4 or 128 (got {bad}); use layer_types")
        types = [_RATIO_TO_TYPE[r] for r in d["compress_ratios"]]
    if types is None and n is None:
        return ()
    if types is None:  # transformers' default: 2 HCA, then HCA / CSA interleaved
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types[:n])
    if len(types) != (len(types) if n is None else n) or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"{source}: layer_types must list one of {LAYER_TYPES} for each of {n} layers")
    return tuple(types)


def _mlp_layer_types(d: dict[str, Any], n: int, source: str) -> tuple[str, ...]:
    types = d.get("mlp_layer_types")
    if types is None:
        n_hash = d.get("num_hash_layers")
        n_hash = 3 if n_hash is None else int(n_hash)
        types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    types = list(types[:n])
    if len(types) != n or any(t not in MLP_LAYER_TYPES for t in types):
        raise ConfigError(f"{source}: mlp_layer_types must list one of {MLP_LAYER_TYPES} for each of {n} layers")
    return tuple(types)


def _ropes(d: dict[str, Any], max_pos: int, source: str) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress) rope. A flat rope_parameters / rope_scaling is the compressed layers' (YaRN
    there, with attention factor 1.0 unless given); sliding layers get plain rope at rope_theta."""
    p = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if isinstance(p.get("main"), dict) and isinstance(p.get("compress"), dict):
        return parse_rope_params(p["main"], max_pos, source), parse_rope_params(p["compress"], max_pos, source)
    flat = {k: v for k, v in p.items() if k not in ("main", "compress", "rope_theta", "partial_rotary_factor")}
    flat["rope_type"] = flat.pop("type", None) or flat.get("rope_type") or "default"
    flat["rope_theta"] = float(d.get("compress_rope_theta") or 160000.0)
    if flat["rope_type"] == "yarn":
        flat.setdefault("attention_factor", 1.0)
    main = {"rope_type": "default", "rope_theta": float(d.get("rope_theta") or 10000.0)}
    return parse_rope_params(main, max_pos, source), parse_rope_params(flat, max_pos, source)


def _validate(c: V4Config, d: dict[str, Any], rope_dim: int, source: str) -> None:
    heads = int(d.get("num_attention_heads") or V4_DEFAULTS["num_attention_heads"])
    if c.scoring_func not in SCORING_FUNCS:
        raise ConfigError(f"{source}: unsupported scoring_func {c.scoring_func!r}; pdserve runs {SCORING_FUNCS}")
    if rope_dim % 2 or not 0 < rope_dim <= c.head_dim:
        raise ConfigError(f"{source}: rope dims {rope_dim} must be even and within head_dim {c.head_dim}")
    if int(d.get("num_key_value_heads") or 1) != 1:
        kv_heads = d["num_key_value_heads"]
        raise ConfigError(f"{source}: DeepSeek-V4 has one shared K=V head; got num_key_value_heads={kv_heads}")
    if heads % c.o_groups:
        raise ConfigError(f"{source}: num_attention_heads {heads} not divisible by o_groups {c.o_groups}")
    if CSA in c.layer_types and c.csa_rate < 1 or HCA in c.layer_types and c.hca_rate < 1:
        raise ConfigError(f"{source}: compress rates must be >= 1, got CSA {c.csa_rate}, HCA {c.hca_rate}")
    if c.sliding_window < 1 or c.hc_mult < 1:
        raise ConfigError(f"{source}: sliding_window and hc_mult must be >= 1")
