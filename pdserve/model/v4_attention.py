"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed entries, with sinks.

Legend: T tokens in the step, L new tokens of one sequence, H query heads, D head_dim (one K=V
head, [nope | rope]), R rope dims, S keys of a sequence (window + new + entries), Q
q_lora_rank, G o_groups, Ro o_lora_rank.

Per token: q = rope(rms(q_b_proj(q_a_norm(q_a_proj(x))))) [H, D]; kv = rope(kv_norm(kv_proj(x)))
[D] is both key and value. A query at position p attends to the kv of positions (p - W, p], to
the compressor's entries it may see (HCA: all complete ones; CSA: the indexer's top-k of them)
and to a learned per-head sink logit that takes probability mass but has no value. The output's
rope slice is rotated back by -p (so it depends on relative positions only), then the grouped
output projection maps each group of H/G heads to Ro dims (o_a_proj) and all G*Ro to hidden.
Sliding-only layers use the "main" rope; CSA/HCA layers the "compress" rope (YaRN), everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model.config import ModelConfig
from pdserve.model.config_v4 import CSA, HCA, SLIDING
from pdserve.model.parallel import ColumnParallelLinear, RowParallelLinear, narrow_shard
from pdserve.model.rope import RotaryEmbedding
from pdserve.model.v4_cache import LayerState
from pdserve.model.v4_compressor import CSACompressor, HCACompressor, Indexer
from pdserve.model.v4_ops import V4RMSNorm, rms_norm, rope_tail


@dataclass
class V4Step:
    """One forward's metadata, built once by the model and read by every layer. B sequences."""

    input_ids: torch.Tensor  # [T] int64, new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64, each token's position in its sequence
    rows: list[slice]  # [B] each sequence's rows of the flat batch
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main" / "compress" -> cos, sin [T, R/2]
    compress_rotary: RotaryEmbedding  # for compressed entries (position e * m)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: weight [G*Ro, in/G]; group g maps its slice of the input.
    Under TP a rank holds G/tp whole groups (rows [r*G/tp*Ro, (r+1)*G/tp*Ro)); G below is that."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        first, self.groups = self.tp.shard(groups, "o_groups")
        self.start, self.n = first * (out_features // groups), self.groups * (out_features // groups)
        self.weight = nn.Parameter(torch.zeros(self.n, in_per_group))

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """weight [G*Ro, in/G] -> this rank's groups' rows [G/tp*Ro, in/G]."""
        return narrow_shard(full, 0, self.start, self.n, self.tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, G, in/G] -> [T, G*Ro]."""
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])  # [G, Ro, in/G]
        return torch.einsum("tgi,goi->tgo", x, w).flatten(1)


class V4Attention(nn.Module):
    """Tensor parallelism splits the query heads (H below is this rank's H/tp): q_b_proj is
    column-parallel by head, the sinks are sliced by head, o_a_proj keeps this rank's G/tp groups
    (group g's H/G heads are heads g*H/G.., so the groups of a rank are exactly the heads it holds:
    o_groups % tp == 0), and o_b_proj is row-parallel over those groups' G/tp*Ro inputs (one
    all-reduce). q_a_proj, the shared K=V head (kv_proj, kv_norm) and the compressors with the
    indexer are replicated: every rank computes and caches the same window and compressed entries
    (the KV cache is replicated, as V3's latent is). The indexer stays whole because its score sums
    over its heads: split, it would need an all-reduce of the scores (each query's, of every entry
    it may see) in every CSA layer, and another summation order could flip a near-tie of the top-k
    against TP1; whole, every rank picks TP1's entries bit for bit, for ~9M parameters a layer
    (V4-Flash).
    """

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        v4, tp = config.v4, tp or TPGroup.single()
        hidden, H, D, Q = config.hidden_size, config.num_attention_heads, v4.head_dim, config.q_lora_rank
        G, eps = v4.o_groups, config.rms_norm_eps
        if H % G:
            raise ValueError(f"num_attention_heads ({H}) is not a multiple of o_groups ({G})")
        self.tp = tp
        self.head_start, local_heads = tp.shard(H, "num_attention_heads")
        self.kind, self.heads, self.head_dim, self.eps = v4.layer_types[layer_idx], local_heads, D, eps
        self.window, self.scale = v4.sliding_window, D**-0.5
        self.rope_kind = "main" if self.kind == SLIDING else "compress"
        self.q_a_proj = nn.Linear(hidden, Q, bias=False)
        self.q_a_norm = V4RMSNorm(Q, eps)
        self.q_b_proj = ColumnParallelLinear(Q, H * D, tp, what="q heads")
        self.kv_proj = nn.Linear(hidden, D, bias=False)
        self.kv_norm = V4RMSNorm(D, eps)
        self.o_a_proj = GroupedLinear(H * D // G, G * v4.o_lora_rank, G, tp)
        self.o_b_proj = RowParallelLinear(G * v4.o_lora_rank, hidden, tp, what="o_groups * o_lora_rank")
        self.sinks = nn.Parameter(torch.zeros(local_heads, dtype=torch.float32))  # this rank's heads
        self.compressor: nn.Module | None = None
        rate = v4.compress_rate(layer_idx)
        if self.kind == HCA:
            self.compressor = HCACompressor(hidden, D, rate, overlap=False, eps=eps)
        elif self.kind == CSA:
            indexer = Indexer(hidden, Q, config.index_n_heads, config.index_head_dim, rate, config.index_topk, eps)
            self.compressor = CSACompressor(hidden, D, rate, eps, indexer)

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """sinks [H] -> this rank's heads [H/tp] (its other parameters live in its submodules)."""
        if name != "sinks":
            return full
        return narrow_shard(full, 0, self.head_start, self.heads, self.tp.size)

    def forward(self, x: torch.Tensor, step: V4Step, states: list[LayerState]) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]; reads and advances each sequence's LayerState."""
        T = x.shape[0]
        cos, sin = step.rope[self.rope_kind]
        q_res = self.q_a_norm(self.q_a_proj(x))  # [T, Q]
        q = rms_norm(self.q_b_proj(q_res).view(T, self.heads, self.head_dim), self.eps)
        q = rope_tail(q, cos, sin)  # [T, H, D]
        kv = rope_tail(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, D]
        out = torch.cat(
            [self._sequence(x[r], q[r], kv[r], q_res[r], step, r, st) for r, st in zip(step.rows, states)]
        )  # [T, H, D]
        out = rope_tail(out, cos, -sin)  # undo the values' rope at the query position
        out = self.o_a_proj(out.reshape(T, self.o_a_proj.groups, -1))  # [T, G*Ro]
        return self.o_b_proj(out)

    def _sequence(self, x, q, kv, q_res, step: V4Step, rows: slice, st: LayerState) -> torch.Tensor:
        """One sequence's L new tokens: q [L, H, D], kv [L, D] -> [L, H, D]."""
        positions = step.positions[rows]  # [L]
        keys = torch.cat([st.window, kv])  # [Sw, D]
        key_pos = torch.arange(keys.shape[0], device=x.device) + positions[0] - st.window.shape[0]
        delta = positions[:, None] - key_pos[None, :]  # [L, Sw]
        mask = (delta >= 0) & (delta < self.window)
        st.window = keys[keys.shape[0] - min(keys.shape[0], self.window - 1) :]
        if self.compressor is not None:
            entries_mask = self._compress(x, q_res, positions, rows, step, st)  # [L, E]
            keys = torch.cat([keys, st.compressor.entries])  # [S, D]
            mask = torch.cat([mask, entries_mask], dim=1)
        logits = torch.einsum("lhd,sd->lhs", q, keys) * self.scale  # [L, H, S]
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        sinks = self.sinks.to(logits.dtype).view(1, -1, 1).expand(logits.shape[0], -1, 1)
        probs = F.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1]  # [L, H, S]
        return torch.einsum("lhs,sd->lhd", probs.to(keys.dtype), keys)

    def _compress(self, x, q_res, positions, rows: slice, step: V4Step, st: LayerState) -> torch.Tensor:
        """Advance the compressor (and indexer) by x [L, hidden]; the entries mask [L, E]."""
        comp = self.compressor
        comp.append(x, st.compressor, step.compress_rotary)
        if isinstance(comp, HCACompressor):
            return comp.visible(positions, st.compressor)
        comp.indexer.append(x, st.indexer, step.compress_rotary)
        cos, sin = step.rope["compress"]
        return comp.indexer.select(x, q_res, positions, cos[rows], sin[rows], st.indexer)
