"""Lightning indexer of DeepSeek Sparse Attention (V3.2): picks each query's top-k keys.

Legend: T tokens, Hi indexer heads, Di index_head_dim, R qk_rope_head_dim, C context width,
K index_topk, N KV slots.

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) over the causal candidates s of t, with
w = weights_proj(x) * Hi^-0.5 * Di^-0.5 (relu commutes with the positive softmax scale, so the
scale is folded into w). Rope is half-split (not interleaved) on the first R dims of q and k;
the key is LayerNorm'd. As in transformers, no Hadamard rotation and no FP8 here: the rotation
is orthogonal, so q.k is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import ops
from pdserve.model.batch import ForwardBatch
from pdserve.model.config import ModelConfig
from pdserve.model.fp8 import linear
from pdserve.model.rope import apply_rope


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.wq_b = linear(config.q_lora_rank, self.n_heads * self.head_dim, fp8_block=config.fp8_block)
        self.wk = linear(config.hidden_size, self.head_dim, fp8_block=config.fp8_block)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)  # kept float32
        self.weight_scale = self.n_heads**-0.5 * self.head_dim**-0.5

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        R = self.rope_dim
        return torch.cat([apply_rope(x[..., :R], cos, sin, interleaved=False), x[..., R:]], dim=-1)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], the layer's normed input
        q_resid: torch.Tensor,  # [T, q_lora_rank], q_a_layernorm(q_a_proj(x))
        cos: torch.Tensor,  # [T, R/2]
        sin: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,  # [N, Di], this layer's index_k region
    ) -> torch.Tensor:
        """Writes the new tokens' index keys, returns the chosen slots [T, min(K, C)] int32 (-1 pad),
        C the longest context (candidates: each token's positions 0..p, through the block table)."""
        T = x.shape[0]
        q = self._rope(self.wq_b(q_resid).view(T, self.n_heads, self.head_dim), cos, sin)  # [T, Hi, Di]
        k = self._rope(self.k_norm(self.wk(x)), cos, sin)  # [T, Di]
        k_cache[batch.slot_mapping] = k.to(k_cache.dtype)
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.weight_scale  # [T, Hi]
        return ops.indexer_topk_paged(
            q,
            k_cache,
            w,
            batch.block_tables,
            batch.seq_ids,
            batch.context_lens,
            batch.block_size,
            batch.max_context,
            self.topk,
        )
