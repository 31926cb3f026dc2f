"""Multi-head Latent Attention (DeepSeek-V2/V3/V3.2) in the absorbed form.

Legend: T tokens, H heads, C kv_lora_rank, R qk_rope_head_dim, Dn qk_nope_head_dim,
Dv v_head_dim, K keys attended per query, N KV slots.

The cache holds one record per token: [normalized latent (C) | roped key (R)]. kv_b_proj
[H*(Dn+Dv), C] splits per head into W_UK [H, Dn, C] and W_UV [H, Dv, C]; absorbing W_UK into
the query (q_lat = q_nope @ W_UK) makes q_lat . latent == q_nope . k_nope, so attention runs in
the latent space over the records themselves (V = the latent), and W_UV lifts the result back.

Which form runs where (dense MLA, V3): one-token chunks (decode) run absorbed over the paged
pool (`ops.paged_mla_decode`: the kernel walks the sequence's block table). Chunks of more than
one token (prefill) run non-absorbed (`_expanded`): the records of the chunk's context (cached
prefix + the chunk) are expanded through kv_b_proj into per-head K_nope [S, H, Dn] and V
[S, H, Dv], K = [K_nope | roped key, shared by the heads] (Dn + R = 192), and a causal
FlashAttention kernel (pdserve_kernels.mla_prefill) attends: 3.4x fewer flops than the absorbed
form and tensor-core tiles of many queries, instead of one query at a time. Sparse layers (V3.2)
run absorbed over the indexer's top-k for every token. `MLA.expand_prefill = False` runs prefill
absorbed too (tests compare the two). A step whose chunks are all short (at most
`absorb_chunks_up_to` tokens) runs absorbed as well: each query over its own positions 0..p
through the block table, as a decode token. Speculative decoding's verify chunks come as decode
rows already (`ForwardBatch.build(as_decode_rows=True)`, and so replay a CUDA graph).

Tensor parallelism splits the heads: q_proj/q_b_proj and kv_b_proj are column-parallel by head
(H below is this rank's H/tp heads), o_proj is row-parallel (one all-reduce). q_a_proj,
kv_a_proj_with_mqa, their norms and the indexer are replicated, so every rank computes and caches
the same full latent record for every token: the KV cache is replicated, not split.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model import ops
from pdserve.model.batch import ForwardBatch, PrefillChunks
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v3.indexer import Indexer
from pdserve.model.fp8 import linear
from pdserve.model.kv_cache import KVCache
from pdserve.model.layers import RMSNorm
from pdserve.model.parallel import ColumnParallelLinear, RowParallelLinear
from pdserve.model.rope import apply_rope, softmax_scale


class MLA(nn.Module):
    expand_prefill = True  # prefill chunks in the non-absorbed form (dense MLA)
    # a step whose chunks are all this short runs absorbed: expanding a chunk's whole context for a
    # few queries costs more
    absorb_chunks_up_to = 9

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        c, tp = config, tp or TPGroup.single()
        self.layer_idx = layer_idx
        _, self.n_heads = tp.shard(c.num_attention_heads, "num_attention_heads")  # this rank's heads
        self.kv_lora_rank, self.rope_dim = c.kv_lora_rank, c.qk_rope_head_dim
        self.nope_dim, self.v_dim = c.qk_nope_head_dim, c.v_head_dim
        self.interleave = c.rope_interleave
        self.scale = softmax_scale(c.rope, c.qk_head_dim)
        H, bias, fp8 = c.num_attention_heads, c.attention_bias, c.fp8_block
        self.q_lora = c.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = ColumnParallelLinear(c.hidden_size, H * c.qk_head_dim, tp, what="q heads", fp8_block=fp8)
        else:
            self.q_a_proj = linear(c.hidden_size, c.q_lora_rank, bias=bias, fp8_block=fp8)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, H * c.qk_head_dim, tp, what="q heads", fp8_block=fp8)
        self.kv_a_proj_with_mqa = linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=bias, fp8_block=fp8)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        # kept in the model dtype (dequantized at load, as vLLM does): absorbed into the queries
        # and the output per head (W_UK, W_UV), not multiplied as one linear layer
        self.kv_b_proj = ColumnParallelLinear(
            c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), tp, what="kv heads"
        )
        self.o_proj = RowParallelLinear(
            H * c.v_head_dim, c.hidden_size, tp, bias=bias, what="o_proj heads", fp8_block=fp8
        )
        self.indexer = Indexer(c) if c.has_indexer else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, R/2]
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Attention of every token of the batch (see the module docstring for which form runs where)."""
        T, H = x.shape[0], self.n_heads
        q_nope, q_pe, q_resid, kv = self._project(x, cos, sin, batch.slot_mapping, kv_cache)
        if self.indexer is not None:
            k_idx = kv_cache.layer("index_k", self.layer_idx)
            indices = self.indexer(x, q_resid, cos, sin, batch, k_idx)  # [T, K] slots
            out = self._absorbed(q_nope, q_pe, kv, batch, indices=indices)
        elif batch.prefill is None or not self.expand_prefill or batch.prefill.max_q <= self.absorb_chunks_up_to:
            out = self._absorbed(q_nope, q_pe, kv, batch)
        else:
            out = q_nope.new_empty(T, H, self.v_dim)
            rows, chunks = batch.decode_rows, batch.prefill
            if rows.numel():
                out[rows] = self._absorbed(q_nope[rows], q_pe[rows], kv, batch, rows=rows)
            out[chunks.rows] = self._expanded(q_nope[chunks.rows], q_pe[chunks.rows], kv, chunks)
        return self.o_proj(out.reshape(T, H * self.v_dim))

    def _absorbed(self, q_nope, q_pe, kv, batch: ForwardBatch, indices=None, rows=None) -> torch.Tensor:
        """[t, H, Dv] for the batch's tokens `rows` (default all): over `indices` [t, K] slots if
        given, else over each token's positions 0..p through the block table."""
        H, Dn, C = self.n_heads, self.nope_dim, self.kv_lora_rank
        w_kv = self.kv_b_proj.weight.view(H, Dn + self.v_dim, C)
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w_kv[:, :Dn])  # [t, H, C]
        q_full = torch.cat([q_lat, q_pe], dim=-1)[:, None]  # [t, 1, H, C+R]
        if indices is not None:
            out, _ = ops.sparse_mla_decode(q_full, kv, indices[:, None], self.scale, d_v=C)  # [t, 1, H, C]
        else:
            seq_ids, lens = batch.seq_ids, batch.context_lens
            if rows is not None:
                seq_ids, lens = seq_ids[rows], lens[rows]
            out, _ = ops.paged_mla_decode(
                q_full, kv, batch.block_tables, seq_ids, lens, batch.block_size, batch.max_context, self.scale, d_v=C
            )
        return torch.einsum("thc,hvc->thv", out[:, 0], w_kv[:, Dn:])  # [t, H, Dv]

    def _expanded(self, q_nope, q_pe, kv, chunks: PrefillChunks) -> torch.Tensor:
        """Non-absorbed causal attention of the prefill chunks' tokens over their contexts: [Tp, H, Dv]."""
        H, C, Dn = self.n_heads, self.kv_lora_rank, self.nope_dim
        records = kv[chunks.k_slots]
        if kv.dtype == torch.uint8:  # FP8 records: dequantize the context once, here
            records = ops.unpack_kv_fp8(records, C, C + self.rope_dim)
        latent, k_rope = records.to(q_nope.dtype).split([C, self.rope_dim], dim=-1)  # [S, C], [S, R]
        kv_heads = self.kv_b_proj(latent).view(-1, H, Dn + self.v_dim)  # [S, H, Dn+Dv]
        q = torch.cat([q_nope, q_pe], dim=-1)  # [Tp, H, Dn+R]
        out, _ = ops.mla_prefill_attention(
            q,
            kv_heads[..., :Dn],
            k_rope,
            kv_heads[..., Dn:],
            chunks.cu_q,
            chunks.cu_k,
            chunks.max_q,
            self.scale,
            max_seqlen_k=chunks.max_k,
        )
        return out

    def _project(self, x, cos, sin, slot_mapping, kv_cache):
        """Queries (q_nope [T, H, Dn], roped q_pe [T, H, R], q_resid), and this layer's cache [N, C+R]
        with the tokens' records written at slot_mapping."""
        T, H, C, R, Dn = x.shape[0], self.n_heads, self.kv_lora_rank, self.rope_dim, self.nope_dim
        if not self.q_lora:
            q_resid, q = None, self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora_rank]
            q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(T, H, Dn + R).split([Dn, R], dim=-1)  # [T, H, Dn], [T, H, R]
        q_pe = apply_rope(q_pe, cos, sin, self.interleave)

        latent, k_pe = self.kv_a_proj_with_mqa(x).split([C, R], dim=-1)  # [T, C], [T, R]
        record = torch.cat([self.kv_a_layernorm(latent), apply_rope(k_pe, cos, sin, self.interleave)], dim=-1)
        kv = kv_cache.layer("latent", self.layer_idx)  # [N, C+R] values, or [N, 656] FP8 records
        kv[slot_mapping] = ops.pack_kv_fp8(record, C) if kv.dtype == torch.uint8 else record.to(kv.dtype)
        return q_nope, q_pe, q_resid, kv
