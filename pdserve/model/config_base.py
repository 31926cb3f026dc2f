"""What the V3/V3.2 and V4 config parsers share: the error they raise and the rope parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
