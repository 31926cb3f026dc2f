"""What every model's config parser shares: the error they raise, the rope parameters, the FP8
quantization_config and the EOS ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class QuantConfig:
    method: str  # only "fp8" (e4m3, block-scaled: kept FP8, or dequantized at load with --quantization none)
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"  # "float" (fp32 scales, V3) or "ue8m0" (power-of-two byte scales, V4)
    expert_dtype: str = "fp8"  # "fp8", or "fp4" (e2m1, one ue8m0 scale per 32 values: V4's routed experts)
    # FP4 experts' kernel path, not the checkpoint's: the engine's fp4_moe_backend (model_config_for)
    fp4_moe_backend: str = "auto"


class ConfigError(ValueError):
    """config.json describes something pdserve cannot run (or is malformed)."""


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"  # "default" or "yarn"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # explicit cos/sin scale; inferred from mscales when None
    truncate: bool = True


def parse_rope_params(p: dict[str, Any], max_pos: int, source: str, orig: int | None = None) -> RopeConfig:
    """One rope parameter dict (rope_type / type, rope_theta, YaRN keys) -> RopeConfig."""
    rope_type = p.get("rope_type", p.get("type", "default"))
    theta = float(p.get("rope_theta", 10000.0))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type != "yarn":
        raise ConfigError(f"{source}: unsupported rope type {rope_type!r}; pdserve supports 'default' and 'yarn'")
    orig = int(orig or p.get("original_max_position_embeddings") or max_pos)
    factor = p.get("factor")
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=float(factor) if factor is not None else max_pos / orig,
        original_max_position_embeddings=orig,
        beta_fast=float(p.get("beta_fast") or 32),
        beta_slow=float(p.get("beta_slow") or 1),
        mscale=p.get("mscale"),
        mscale_all_dim=p.get("mscale_all_dim"),
        attention_factor=p.get("attention_factor"),
        truncate=bool(p.get("truncate", True)),
    )


def eos_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def parse_quant(q: dict[str, Any] | None, source: str, expert_dtype: str | None = None) -> QuantConfig | None:
    """config.json's quantization_config -> QuantConfig (None: unquantized)."""
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
