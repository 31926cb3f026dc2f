"""Checkpoint loading shared by every model: the error a bad checkpoint raises, the weight files
of a folder, and `load_model`, which loads any checkpoint pdserve runs (the model's loader is
found through registry.py by config.json's model_type).

Accepted layouts: model.safetensors, sharded with model.safetensors.index.json, or several
*.safetensors without an index.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model import registry
from pdserve.model.config import ModelConfig


class CheckpointError(ValueError):
    """The weight files do not fit the model their config.json describes."""


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    progress: bool = True,
    tp: TPGroup | None = None,
    quantization: str | None = None,
) -> nn.Module:
    """The model in model_dir, loaded by its package's loader. quantization: None follows the
    checkpoint, "none" dequantizes at load (model/fp8.py)."""
    config = ModelConfig.from_model_dir(model_dir)
    return registry.entry(config).load(model_dir, dtype, device, tp=tp, quantization=quantization, progress=progress)


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        files = {name: model_dir / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise FileNotFoundError(f"weight file {f.name} listed in {index.name} is missing from {model_dir}")
        return files
    single = model_dir / "model.safetensors"
    shards = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    files: dict[str, Path] = {}
    for f in shards:
        with safe_open(str(f), framework="pt") as h:
            files.update({name: f for name in h.keys()})
    return files
