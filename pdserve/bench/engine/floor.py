"""The floor of one decode step: the bytes it must read and the flops it must do.

Legend: B sequences decoding one token each, n = C + 1 positions each attends (C cached + its
own), E routed experts, k experts a token, s bytes per KV value, H heads, Hi / Di indexer heads /
dim, W sliding window, m a compressor's rate.

Bytes:
  - weights: every parameter once (attention, dense MLP, shared experts, routers, norms,
    lm_head), except the embedding (B rows) and the routed experts: per MoE layer, only the
    experts the batch's top-k touched (counted in the run, or expected: E (1 - (1 - k/E)^B));
    as stored: FP8 weights 1 byte a value plus their float32 block scales (`*_scale_inv`, bytes
    only: no flops), FP4 experts (packed uint8) 0.5 byte a value plus a 1-byte scale per 32;
  - KV, per layer and sequence: what the model's package counts (`decode_attention_cost` in
    deepseek_v3/cache.py: all n latent records, or V3.2's indexer keys and top-k records;
    deepseek_v4/cache.py: the window, CSA's indexer keys and top-k entries, HCA's entries).
Flops: 2 B x (parameters read, embedding and routed experts aside) + 2 B k x (one expert's
parameters) per MoE layer + attention (2 H x keys x (qk dims + v dims) per token, the indexer 2
Hi x candidates x Di).
floor = max(bytes / copy rate, flops / matmul rate), rates measured in the same run.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from pdserve.model import registry
from pdserve.model.config import ModelConfig

_LAYER = re.compile(r"layers\.(\d+)\.")
_EXPERTS = (
    "experts.gate_up_proj",
    "experts.down_proj",
    "experts.gate_up_proj_scale_inv",
    "experts.down_proj_scale_inv",
)
_SCALE = "_scale_inv"
# FP4 experts re-laid for the kernel (buffers made at the first CUDA forward): 16 value bytes to 1 scale byte
_TILES = ("experts.w13_tiles", "experts.w2_tiles", "experts.w13_tile_scales", "experts.w2_tile_scales")


@dataclass(frozen=True)
class StepCost:
    weight_bytes: int  # everything but the routed experts (embedding: B rows)
    expert_bytes: int  # the routed experts touched
    kv_bytes: int
    flops: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.expert_bytes + self.kv_bytes

    def floor_ms(self, copy_bytes_per_s: float, flops_per_s: float) -> dict[str, float]:
        bytes_ms, flops_ms = 1e3 * self.total_bytes / copy_bytes_per_s, 1e3 * self.flops / flops_per_s
        return {"bytes_ms": bytes_ms, "flops_ms": flops_ms, "floor_ms": max(bytes_ms, flops_ms)}

    def as_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts B tokens touch when each picks k of E uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_cost(
    model: nn.Module,
    config: ModelConfig,
    batch: int,
    context: int,
    kv_itemsize: float,
    experts_touched: dict[int, float] | None = None,
    param_bytes: Callable[[str, torch.Tensor], float] | None = None,
    record_bytes: int | None = None,
) -> StepCost:
    """The cost of one decode step of `batch` sequences with `context` tokens cached each.
    experts_touched: MoE layer -> distinct routed experts the step used (None: expected).
    param_bytes(name, p): bytes of a parameter as stored (default: as it is in `model`).
    record_bytes: bytes of one attention KV record when it is a byte format (FP8: V3 / V3.2's latent
    record, 656; V4's window and entry record, 584)."""
    E, k = config.n_routed_experts, config.num_experts_per_tok
    dense = experts = flops = 0
    tiles = [(n, b) for n, b in model.named_buffers() if n.endswith(_TILES)]
    for name, p in [*model.named_parameters(), *tiles]:
        nbytes = param_bytes(name, p) if param_bytes else p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight"):
            dense += round(batch * nbytes / p.shape[0])
        elif name.endswith(_EXPERTS + _TILES):
            layer = int(_LAYER.search(name).group(1))
            touched = (experts_touched or {}).get(layer, expected_distinct_experts(E, k, batch))
            experts += round(touched * nbytes / E)
            values = p.numel() * (2 if p.dtype == torch.uint8 else 1)  # packed FP4: two values a byte
            values = values * 16 // 17 if name.endswith(_TILES) else values
            flops += 0 if name.endswith(_SCALE) else 2 * batch * k * values // E
        else:
            dense += round(nbytes)
            flops += 0 if name.endswith(_SCALE) else 2 * batch * p.numel()
    kv, attn_flops = attention_cost(config, batch, context, kv_itemsize, record_bytes)
    return StepCost(weight_bytes=dense, expert_bytes=experts, kv_bytes=kv, flops=flops + attn_flops)


def attention_cost(
    config: ModelConfig, batch: int, context: int, itemsize: float, record_bytes: int | None = None
) -> tuple[int, int]:
    """(KV bytes read, attention flops) of one decode step, all layers (what each model reads: its
    package's cache.py). itemsize: bytes of a record value; record_bytes: an attention record's
    bytes when it is a byte format (V3 / V3.2's latent, V4's window and entries; the indexer keys
    stay values)."""
    values, flops = registry.entry(config).decode_attention_cost(config, context, itemsize, record_bytes)
    return round(batch * values * itemsize), batch * flops
