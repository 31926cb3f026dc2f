"""DeepSeek-V3 / V3.2 / V4 in plain PyTorch: config, layers, models and checkpoint loaders.

Exports load lazily, so importing pdserve.model.batch does not pull in safetensors or the model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ModelConfig": "pdserve.model.config",
    "ConfigError": "pdserve.model.config",
    "DeepseekForCausalLM": "pdserve.model.deepseek",
    "load_model": "pdserve.model.loader",
    "CheckpointError": "pdserve.model.loader",
    "DeepseekV4ForCausalLM": "pdserve.model.deepseek_v4",
    "load_v4_model": "pdserve.model.v4_loader",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from pdserve.model.config import ConfigError, ModelConfig
    from pdserve.model.deepseek import DeepseekForCausalLM
    from pdserve.model.deepseek_v4 import DeepseekV4ForCausalLM
    from pdserve.model.loader import CheckpointError, load_model
    from pdserve.model.v4_loader import load_v4_model


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdserve.model' has no attribute {name!r}")
