"""Sizes decided before anything is allocated: the KV blocks the rows need and how many layers
fit on the device (`--num-layers` left out): weights (counted on the meta device, at the
weight dtype's size) + the KV pool must fit in the memory budget."""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.bench.engine.models import bench_config, engine_quantization, real_num_layers
from pdserve.model import registry
from pdserve.model.config import ModelConfig
from pdserve.model.kv_cache import STATE, TOKENS, WINDOW, KVCache


def meta_model(config: ModelConfig) -> nn.Module:
    """The model of `config` (its registry entry's class) on the meta device: shapes only."""
    with torch.device("meta"):
        return registry.entry(config).model_class(config)


def pool_blocks(rows: list[tuple[int, int]], block_size: int, extra: int) -> int:
    """KV blocks for the largest row: (batch, context) rows, `extra` decode steps each."""
    return max(b * math.ceil((c + 1 + extra) / block_size) for b, c in rows)


def footprint(
    name: str,
    num_layers: int,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    quantization: str | None = None,
) -> dict[str, int]:
    """Bytes of the weights and of the KV pool (token blocks, and the window blocks and state
    slots the runner sizes for max_num_seqs) of model `name` at num_layers layers."""
    from pdserve.engine.model_runner import _side_spaces
    from pdserve.model.fp8 import model_config_for

    config = ModelConfig.from_dict(bench_config(name, num_layers, quantization))
    model = meta_model(model_config_for(config, engine_quantization(quantization), dummy=True))
    itemsize = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() * param_itemsize(n, p, itemsize) for n, p in model.named_parameters())
    specs = model.kv_cache_specs(kv_cache_dtype)
    _, window_blocks, state_slots = _side_spaces(specs, max_num_seqs, block_size)
    pool = sum(
        n * KVCache.bytes_per_block(specs, num_layers, block_size, dtype, space)
        for n, space in ((num_blocks + 1, TOKENS), (window_blocks, WINDOW), (state_slots, STATE))
    )  # + 1: the CUDA graphs' scratch block
    return {"weights": weights, "kv_pool": pool}


def param_itemsize(name: str, p: torch.Tensor, itemsize: int) -> int:
    """Bytes a value of a meta parameter will take: the weights' dtype, unless the model chose its
    storage (FP8 values and packed FP4 bytes: 1 byte; block scales `*_scale_inv`: float32, ue8m0
    bytes for FP4)."""
    if name.endswith("_scale_inv"):
        return p.element_size()
    return p.element_size() if p.dtype != torch.get_default_dtype() else itemsize


def fit_layers(
    name: str,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    budget: float,
    quantization: str | None = None,
) -> int:
    """The most layers (up to the released count) whose weights + pool fit in budget bytes."""

    def fits(n: int) -> bool:
        parts = footprint(name, n, dtype, kv_cache_dtype, block_size, num_blocks, max_num_seqs, quantization)
        return sum(parts.values()) <= budget

    lo, hi = 0, real_num_layers(name)
    while lo < hi:  # fits(lo) or lo == 0; the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    if lo == 0:
        one = footprint(name, 1, dtype, kv_cache_dtype, block_size, num_blocks, max_num_seqs)
        raise ValueError(f"not even one layer of {name} fits: {one} bytes against a budget of {budget:.3g}")
    return lo
