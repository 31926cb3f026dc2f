"""DeepSeek MoE: sigmoid router with group-limited top-k, stacked routed experts, shared experts.

Legend: T tokens, E routed experts, G groups (n_group), k experts per token, I
moe_intermediate_size.

Routing (as transformers / DeepSeek-V3): scores = sigmoid(x W_g^T) in float32; selection uses
scores + e_score_correction_bias, first keeping the topk_group groups with the best sum of their
top-2 biased scores, then the top-k experts inside them; the weights are the unbiased scores of
the chosen experts, renormalized if norm_topk_prob, times routed_scaling_factor.
Experts are stacked in vLLM's layout: gate_up_proj [E, 2I, hidden] (gate rows, then up rows),
down_proj [E, hidden, I] - the same layout as transformers' fused expert parameters. FP8 experts
kept FP8 (config.fp8_block) are e4m3 with their block scales stacked the same way,
gate_up_proj_scale_inv [E, 2I/bn, ceil(hidden/bk)] and down_proj_scale_inv [E, ceil(hidden/bn),
I/bk], and run through ops.fused_moe_fp8 (I must be a multiple of the block: gate and up rows
must not share a scale block).

Tensor parallelism splits every expert by its intermediate dim (I below is this rank's I/tp):
each rank holds all E experts' slices, so every rank does the same share of work whatever the
routing (expert parallelism would leave a rank with hot experts behind the others), the fused-MoE
kernel runs unchanged, and the routed and shared partial sums leave with one all-reduce. The
router is replicated: every rank picks the same experts from the same input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model import ops
from pdserve.model.config import ModelConfig
from pdserve.model.fp8 import check_block_shard, fp8_params
from pdserve.model.layers import MLP
from pdserve.model.parallel import narrow_shard, shard_expert, shard_stacked_experts


class Gate(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E = config.n_routed_experts
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(E, config.hidden_size))  # kept float32
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E))  # kept float32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_weights [T, k] float32, topk_ids [T, k] int32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            T, E, G = scores.shape[0], scores.shape[1], self.n_group
            group_scores = choice.view(T, G, E // G).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~group_mask.repeat_interleave(E // G, dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids.to(torch.int32)


class Experts(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        E, hidden = config.n_routed_experts, config.hidden_size
        self.size = tp.size
        self.start, I = tp.shard(config.moe_intermediate_size, "moe_intermediate_size")
        self.inter = I  # this rank's share
        self.fp8_block = config.fp8_block
        if self.fp8_block is None:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, hidden))
            self.down_proj = nn.Parameter(torch.empty(E, hidden, I))
            self.gate_up_proj_scale_inv = self.down_proj_scale_inv = None
            return
        bn, bk = self.fp8_block
        if I % bn or I % bk:
            raise ValueError(
                f"FP8 experts: moe_intermediate_size per rank ({I}, tensor_parallel_size {tp.size}) must be a "
                f"multiple of the weight block {self.fp8_block} (gate and up rows stack); or use --quantization none"
            )
        check_block_shard(I, tp.size, bn, "moe_intermediate_size")
        self.gate_up_proj, self.gate_up_proj_scale_inv = fp8_params(2 * I, hidden, self.fp8_block, lead=(E,))
        self.down_proj, self.down_proj_scale_inv = fp8_params(hidden, I, self.fp8_block, lead=(E,))

    def shard_expert(self, proj: str, full: torch.Tensor, leaf: str = "weight") -> torch.Tensor:
        """One expert's checkpoint weight -> this rank's slice: gate/up [I, hidden], down [hidden, I];
        its weight_scale_inv -> the same slice in blocks."""
        if leaf == "weight":
            return shard_expert(proj, full, self.start, self.inter, self.size)
        b = self.fp8_block[1 if proj == "down_proj" else 0]
        return narrow_shard(full, 1 if proj == "down_proj" else 0, self.start // b, self.inter // b, self.size)

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Fused checkpoint tensors: gate_up_proj [E, 2I, hidden], down_proj [E, hidden, I], and
        their *_scale_inv (in blocks)."""
        if name.endswith("_scale_inv"):
            b = self.fp8_block[1 if name.startswith("down_proj") else 0]
            return shard_stacked_experts(
                name.removesuffix("_scale_inv"), full, self.start // b, self.inter // b, self.size
            )
        return shard_stacked_experts(name, full, self.start, self.inter, self.size)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.gate = Gate(config)
        self.experts = Experts(config, self.tp)
        n_shared = config.n_shared_experts
        inter = config.moe_intermediate_size * n_shared
        self.shared_experts = (
            MLP(config.hidden_size, inter, self.tp, reduce=False, fp8_block=config.fp8_block) if n_shared else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        ex = self.experts
        if ex.fp8_block is None:
            y = ops.fused_moe(x, ex.gate_up_proj, ex.down_proj, weights, ids)  # [T, hidden], partial
        else:
            y = ops.fused_moe_fp8(
                x,
                ex.gate_up_proj,
                ex.down_proj,
                ex.gate_up_proj_scale_inv,
                ex.down_proj_scale_inv,
                weights,
                ids,
                ex.fp8_block,
            )
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return self.tp.all_reduce(y)
