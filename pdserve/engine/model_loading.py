"""Which model an engine runs: the checkpoint (or `load_format: dummy`) loaded through the model
registry, and the check, before any rank process starts, that its dims split into the tensor
parallel size.
"""

from __future__ import annotations

import torch

from pdserve.distributed.group import TPGroup
from pdserve.engine.config import EngineConfig


def load_for_engine(config: EngineConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup) -> torch.nn.Module:
    """The checkpoint in config.model (or, load_format dummy, its config.json with random
    weights), as the model its registry entry names (model/registry.py)."""
    from pdserve.model import registry
    from pdserve.model.config import ModelConfig
    from pdserve.model.dummy import dummy_model
    from pdserve.model.fp8 import model_config_for

    model_config = ModelConfig.from_model_dir(config.model)
    mtp = config.speculative_config is not None and config.speculative_config.method == "mtp"
    if config.load_format == "dummy":
        build = model_config_for(model_config, config.quantization, dummy=True, fp4_moe_backend=config.fp4_moe_backend)
        return dummy_model(build, dtype, device, tp, seed=config.seed, mtp=mtp)
    entry = registry.entry(model_config)
    return entry.load(
        config.model, dtype, device, tp=tp, quantization=config.quantization, progress=tp.is_driver,
        fp4_moe_backend=config.fp4_moe_backend, mtp=mtp,
    )  # fmt: skip


def check_shardable(config: EngineConfig) -> None:
    """Fail before starting processes if the model's dims do not split into tensor_parallel_size
    (builds rank 0's shards on the meta device: the same checks the real build makes)."""
    from pdserve.model import registry
    from pdserve.model.config import ModelConfig
    from pdserve.model.fp8 import model_config_for

    model_config = ModelConfig.from_model_dir(config.model)
    model_class = registry.entry(model_config).model_class
    build = model_config_for(model_config, config.quantization, dummy=config.load_format == "dummy")
    with torch.device("meta"):
        model_class(build, TPGroup(rank=0, size=config.tensor_parallel_size))
    if config.device.startswith("cuda"):
        first = torch.device(config.device).index or 0
        need = first + config.tensor_parallel_size
        if torch.cuda.device_count() < need:
            raise ValueError(
                f"tensor_parallel_size {config.tensor_parallel_size} on {config.device} needs GPUs {first}..{need - 1} "
                f"but {torch.cuda.device_count()} are visible (CUDA_VISIBLE_DEVICES)"
            )
