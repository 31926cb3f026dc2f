"""Every registry entry names a package that provides what the runner, the dummy builder, the
generic loader and the engine bench ask of it (pdserve/model/registry.py's docstring)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import registry
from pdserve.model.config import ModelConfig
from pdserve.model.dummy import dummy_model
from pdserve.model.loader import load_model
from pdserve.tiny_model import make_tiny_model


@pytest.mark.parametrize("model_type", sorted(registry.MODELS))
def test_entry_builds_loads_and_sizes_its_model(tmp_path, model_type):
    path = make_tiny_model(tmp_path, model_type, seed=0)
    config = ModelConfig.from_model_dir(path)
    entry = registry.entry(config)
    assert entry is registry.MODELS[model_type]
    model = load_model(path, dtype=torch.float32, progress=False)
    assert type(model) is entry.model_class and model.config == config
    assert model.kv_cache_specs() == entry.kv_cache_specs(config)
    assert type(dummy_model(config, torch.float32, "cpu")) is entry.model_class
    values, flops = entry.decode_attention_cost(config, context=40, itemsize=2)
    assert values > 0 and flops > 0
