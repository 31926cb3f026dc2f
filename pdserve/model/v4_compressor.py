"""DeepSeek-V4's KV compressors (CSA and HCA) and the CSA lightning indexer.

Legend: L new tokens of one sequence, T of the step (all sequences), hidden model width, m rate
(tokens per entry), Dc entry dim (head_dim, or index_head_dim for the indexer), C projection width
(Dc, or 2*Dc with overlap), G complete groups closed by this step, E entries after it, Q
q_lora_rank, Hi/Di indexer heads/dim, N indexer keys of the step (every sequence's entries), Em
the most entries of one sequence, R rope dims.

A compressor pools every m consecutive tokens into one entry:
    entry = kv_norm(sum_j softmax_j(gate_j + position_bias_j) * kv_j), roped at position e*m.
HCA pools its group only (C = Dc). CSA (overlap) projects two series per token, Ca = [:Dc] and
Cb = [Dc:], and pools 2m slots: the previous group's Ca and its own group's Cb, so windows of
2m tokens overlap by m. The indexer is a CSA compressor of its own (at Di) plus a scorer: each
query keeps the top `index_topk` entries by sum_h w_h * relu(q_h . k) among those it may see
(`ops.indexer_topk`, over the whole flat batch at once).

The running state (incomplete group, last Ca, entries) is an explicit CompressorState
(see v4_cache.py), so prefill, chunked prefill and decode give the same entries.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.model import ops
from pdserve.model.fp8 import Block, linear
from pdserve.model.rope import RotaryEmbedding
from pdserve.model.v4_cache import CompressorState
from pdserve.model.v4_ops import V4RMSNorm, rope_tail


class CompressedKV(nn.Module):
    """kv_proj / gate_proj [C, hidden], position_bias [m, C] (float32), kv_norm [Dc]."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = V4RMSNorm(dim, eps)

    def append(self, x: torch.Tensor, state: CompressorState, rotary: RotaryEmbedding) -> None:
        """Feed one sequence's new tokens x [L, hidden]; closes complete groups into entries."""
        m, dim = self.rate, self.dim
        kv = torch.cat([state.pending_kv, self.kv_proj(x)])  # [P + L, C]
        gate = torch.cat([state.pending_gate, self.gate_proj(x)])
        groups = kv.shape[0] // m
        state.pending_kv, state.pending_gate = kv[groups * m :], gate[groups * m :]
        if groups == 0:
            return
        kv = kv[: groups * m].view(groups, m, -1)  # [G, m, C]
        gate = gate[: groups * m].view(groups, m, -1) + self.position_bias
        if self.overlap:
            prev_kv = torch.cat([state.overlap_kv[None].to(kv.dtype), kv[:-1, :, :dim]])  # [G, m, Dc]: Ca
            prev_gate = torch.cat([state.overlap_gate[None].to(gate.dtype), gate[:-1, :, :dim]])
            state.overlap_kv, state.overlap_gate = kv[-1, :, :dim], gate[-1, :, :dim]
            kv = torch.cat([prev_kv, kv[..., dim:]], dim=1)  # [G, 2m, Dc]: previous Ca, own Cb
            gate = torch.cat([prev_gate, gate[..., dim:]], dim=1)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)  # [G, Dc]
        pooled = self.kv_norm(pooled)
        first = state.entries.shape[0]
        positions = torch.arange(first, first + groups, device=x.device) * m
        cos, sin = rotary(positions)
        state.entries = torch.cat([state.entries, rope_tail(pooled, cos, sin)])


class HCACompressor(CompressedKV):
    """Heavily compressed attention: dense over its non-overlapping entries (which ones a query
    may see: V4Step.visible, built once per step)."""


class IndexScorer(nn.Module):
    """weights_proj [Hi, hidden]: per-head weights of the index score."""

    def __init__(self, hidden: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.softmax_scale, self.weights_scale = head_dim**-0.5, heads**-0.5
        self.weights_proj = nn.Linear(hidden, heads, bias=False)

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, Hi] float32 with both scales folded in: transformers scales the
        ReLU'd dot by Di^-0.5 and the weights by Hi^-0.5; relu(s) * c = relu(s * c) for c > 0."""
        return self.weights_proj(x).float() * (self.weights_scale * self.softmax_scale)


class Indexer(CompressedKV):
    """The lightning indexer: its own overlapping compressor at Di, q_b_proj [Hi*Di, Q] (FP8 in
    V4-Flash, kept so with `fp8_block`; its compressor and weights_proj are bf16), scorer."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, rate: int, topk: int, eps: float,
                 fp8_block: Block | None = None):
        super().__init__(hidden, head_dim, rate, overlap=True, eps=eps)
        self.heads, self.topk = heads, topk
        self.q_b_proj = linear(q_lora_rank, heads * head_dim, fp8_block=fp8_block)
        self.scorer = IndexScorer(hidden, heads, head_dim)

    def select(self, x, q_res, cos, sin, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], q_res [T, Q], cos/sin [T, R/2] (compress rope), keys [N, Di] (every
        sequence's indexer entries), visible [T, Em] int32 (rows of keys a query may see, -1 pad)
        -> [T, min(topk, Em)] int32: the rows of each query's top-k visible entries, -1 pad."""
        if visible.shape[1] == 0:
            return visible
        q = rope_tail(self.q_b_proj(q_res).view(x.shape[0], self.heads, self.dim), cos, sin)  # [T, Hi, Di]
        return ops.indexer_topk(q, keys, self.scorer.weights(x), visible, self.topk)


class CSACompressor(CompressedKV):
    """Compressed sparse attention: overlapping entries at head_dim, filtered by the indexer."""

    def __init__(self, hidden: int, dim: int, rate: int, eps: float, indexer: Indexer) -> None:
        super().__init__(hidden, dim, rate, overlap=True, eps=eps)
        self.indexer = indexer
