"""DeepSeek-V3 / V3.2 / V4 in plain PyTorch: one package per model (deepseek_v3/, deepseek_v4/),
found through registry.py by config.json's model_type, over shared modules (config, batch,
kv_cache, layers, parallel, rope, fp8 / fp4, ops, dummy weights, the generic loader).

Exports load lazily, so importing pdserve.model.batch does not pull in safetensors or the model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ModelConfig": "pdserve.model.config",
    "ConfigError": "pdserve.model.config",
    "DeepseekForCausalLM": "pdserve.model.deepseek_v3.model",
    "load_model": "pdserve.model.loader",
    "CheckpointError": "pdserve.model.loader",
    "DeepseekV4ForCausalLM": "pdserve.model.deepseek_v4.model",
    "load_v3_model": "pdserve.model.deepseek_v3.loader",
    "load_v4_model": "pdserve.model.deepseek_v4.loader",
}

__all__ = [
    "ModelConfig",
    "ConfigError",
    "DeepseekForCausalLM",
    "load_model",
    "CheckpointError",
    "DeepseekV4ForCausalLM",
    "load_v3_model",
    "load_v4_model",
]

if TYPE_CHECKING:
    from pdserve.model.config import ConfigError, ModelConfig
    from pdserve.model.deepseek_v3.loader import load_v3_model
    from pdserve.model.deepseek_v3.model import DeepseekForCausalLM
    from pdserve.model.deepseek_v4.loader import load_v4_model
    from pdserve.model.deepseek_v4.model import DeepseekV4ForCausalLM
    from pdserve.model.loader import CheckpointError, load_model


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdserve.model' has no attribute {name!r}")
