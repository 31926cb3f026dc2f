"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed entries, with sinks.

Legend: T tokens in the step, H query heads, D head_dim (one K=V head, [nope | rope]), R rope
dims, W sliding_window, N rows of the step's key buffer, K keys a query may read (W + entries),
Q q_lora_rank, G o_groups, Ro o_lora_rank, Hi / Di indexer heads / dim.

Per token: q = rope(rms(q_b_proj(q_a_norm(q_a_proj(x))))) [H, D]; kv = rope(kv_norm(kv_proj(x)))
[D] is both key and value. A query at position p attends to the kv of positions (p - W, p], to
the compressor's entries it may see (HCA: all complete ones; CSA: the indexer's top-k of them)
and to a learned per-head sink logit that takes probability mass but has no value. The output's
rope slice is rotated back by -p (so it depends on relative positions only), then the grouped
output projection maps each group of H/G heads to Ro dims (o_a_proj) and all G*Ro to hidden.
Sliding-only layers use the "main" rope; CSA/HCA layers the "compress" rope (YaRN), everywhere.

The attention of a layer is one `ops.sparse_mla_decode` over the whole flat batch (D = d_v, the
sinks) that reads the pool where it lies: the layer's window region (the step's new kv written
there first) through the step's window rows [T, W], and its entries region through a second
index list (HCA: every visible entry; CSA: the indexer's top-k, `ops.indexer_topk_paged` over the
region's indexer keys), -1 padded. The indices are built once per step (step.py). With FP8
records (`--kv-cache-dtype fp8`: window and entries as fp8_ds_v4 pages) the records each query
reads are gathered from both regions into one source first (`ops.sparse_mla_decode_fp8_v4`
takes one): T * (W + K2) records a layer.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model import ops
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v4.compressor import CSACompressor, HCACompressor, Indexer
from pdserve.model.deepseek_v4.config import CSA, HCA, SLIDING
from pdserve.model.deepseek_v4.layers import (
    V4RMSNorm,
    fused_store,
    joined_outputs,
    normed_records,
    rope_tail,
    store_records,
)
from pdserve.model.deepseek_v4.step import V4Step
from pdserve.model.fp8 import Block, fp8_params, linear, shard_scales
from pdserve.model.kv_cache import KVCache
from pdserve.model.parallel import ColumnParallelLinear, RowParallelLinear, narrow_shard


class GroupedLinear(nn.Module):
    """Block-diagonal projection: weight [G*Ro, in/G]; group g maps its slice of the input.
    Under TP a rank holds G/tp whole groups (rows [r*G/tp*Ro, (r+1)*G/tp*Ro)); G below is that.
    FP8 (`fp8_block` (bn, bk)): the e4m3 weight with weight_scale_inv [G*Ro/bn, ceil(in/G/bk)];
    a rank's groups must start on a block edge (Ro % bn == 0). Every group in one launch
    (`ops.grouped_linear`), bf16 or FP8."""

    def __init__(
        self,
        in_per_group: int,
        out_features: int,
        groups: int,
        tp: TPGroup | None = None,
        fp8_block: Block | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.fp8_block = tp or TPGroup.single(), fp8_block
        first, self.groups = self.tp.shard(groups, "o_groups")
        self.rows = out_features // groups  # Ro
        self.start, self.n = first * self.rows, self.groups * self.rows
        if fp8_block is None:
            self.weight = nn.Parameter(torch.zeros(self.n, in_per_group))
            self.weight_scale_inv = None
            return
        if self.rows % fp8_block[0]:
            raise ValueError(
                f"o_lora_rank {self.rows} is not a multiple of the FP8 block's {fp8_block[0]} rows: "
                "each output group must start on a block edge (or --quantization none)"
            )
        self.weight, self.weight_scale_inv = fp8_params(self.n, in_per_group, fp8_block)

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """weight [G*Ro, in/G] -> this rank's groups' rows [G/tp*Ro, in/G] (and their scale rows)."""
        if name == "weight_scale_inv":
            return shard_scales(full, 0, self.start, self.n, self.fp8_block[0])
        return narrow_shard(full, 0, self.start, self.n, self.tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, G, in/G] -> [T, G*Ro]."""
        return ops.grouped_linear(x, self.weight, self.weight_scale_inv, self.fp8_block)


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
    (V4-Flash). q_a_proj and kv_proj read the same x, and in a CSA layer q_b_proj and the
    indexer's q_b_proj the same q_res: the loader joins each pair's rows (`joined`), so one GEMM
    (FP8: one GEMV at decode rows) runs both.
    """

    joined: tuple[tuple[str, ...], ...] = (("q_a_proj", "kv_proj"),)  # groups whose weights share one tensor

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
        self.window, self.scale, self.rope = v4.sliding_window, D**-0.5, config.qk_rope_head_dim
        self.rope_kind = "main" if self.kind == SLIDING else "compress"
        fp8 = config.fp8_block  # the checkpoint's FP8 projections, kept FP8 (None: floats)
        self.q_a_proj = linear(hidden, Q, fp8_block=fp8)
        self.q_a_norm = V4RMSNorm(Q, eps)
        self.q_b_proj = ColumnParallelLinear(Q, H * D, tp, what="q heads", fp8_block=fp8)
        self.kv_proj = linear(hidden, D, fp8_block=fp8)
        self.kv_norm = V4RMSNorm(D, eps)
        self.o_a_proj = GroupedLinear(H * D // G, G * v4.o_lora_rank, G, tp, fp8_block=fp8)
        self.o_b_proj = RowParallelLinear(G * v4.o_lora_rank, hidden, tp, what="o_groups * o_lora_rank", fp8_block=fp8)
        self.sinks = nn.Parameter(torch.zeros(local_heads, dtype=torch.float32))  # this rank's heads
        self.compressor: nn.Module | None = None
        rate = v4.compress_rate(layer_idx)
        if self.kind == HCA:
            self.compressor = HCACompressor(hidden, D, rate, overlap=False, eps=eps)
        elif self.kind == CSA:
            indexer = Indexer(hidden, Q, config.index_n_heads, config.index_head_dim, rate, config.index_topk, eps, fp8)
            self.compressor = CSACompressor(hidden, D, rate, eps, indexer)
            self.joined = (*self.joined, ("q_b_proj", "compressor.indexer.q_b_proj"))

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """sinks [H] -> this rank's heads [H/tp] (its other parameters live in its submodules)."""
        if name != "sinks":
            return full
        return narrow_shard(full, 0, self.head_start, self.heads, self.tp.size)

    def forward(self, x: torch.Tensor, step: V4Step, kv_cache: KVCache, layer: int) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]; writes the step's window records, entries and
        compressor state of this layer into the pool and reads its keys from there."""
        T = x.shape[0]
        cos, sin = step.rope[self.rope_kind]
        q_a, kv_a = joined_outputs(x, self.q_a_proj, self.kv_proj)  # one GEMM / GEMV where joined at load
        q_res = self.q_a_norm(q_a)  # [T, Q]
        iq = None  # the indexer's q_b_proj(q_res), from q_b's GEMM where joined
        if isinstance(self.compressor, CSACompressor):
            q_b, iq = joined_outputs(q_res, self.q_b_proj, self.compressor.indexer.q_b_proj)
        else:
            q_b = self.q_b_proj(q_res)
        q = ops.rms_norm(q_b.view(T, self.heads, self.head_dim), None, self.eps, rope=(cos, sin))
        window = _region(kv_cache, "window", layer)  # [Nw, D] values, or fp8_ds_v4 pages
        if step.window_src is None and fused_store(window, x):  # normed, roped and stored by one kernel
            kv = normed_records(self.kv_norm, kv_a, (cos, sin), window, step.window_write)
        else:
            kv = self._kv(kv_a, cos, sin)  # [T, D]
            new = kv if step.window_src is None else kv[step.window_src]
            store_records(window, step.window_write, new, self.rope)  # the records later steps read
        extra = self._compress(x, q_res, step, kv_cache, layer, iq) if self.compressor is not None else None
        if window.dtype == torch.uint8:
            out = self._attend_fp8(q, kv, window, step, extra)
        else:
            keys = window if step.window_old is None else torch.cat([window[step.window_old], kv.to(window.dtype)])
            out, _ = ops.sparse_mla_decode(
                q[:, None], keys, step.window[:, None], self.scale, self.head_dim, sink=self.sinks, extra=extra
            )  # [T, 1, H, D]
        out = rope_tail(out[:, 0], cos, sin, inverse=True)  # undo the values' rope at the query position
        out = self.o_a_proj(out.reshape(T, self.o_a_proj.groups, -1))  # [T, G*Ro]
        return self.o_b_proj(out)

    def _kv(self, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """kv_proj(x) [T, D] -> the step's K = V records [T, D] (normed, roped)."""
        return self.kv_norm(kv, rope=(cos, sin))  # normed and roped in one kernel on a GPU

    def _attend_fp8(self, q, kv, window: torch.Tensor, step: V4Step, extra) -> torch.Tensor:
        """The attention over fp8_ds_v4 records: the records each query reads, gathered from both
        regions into pages of one record (bytes as stored; the new kv of a step with longer
        chunks packed as the pool would hold it) -> [T, 1, H, D]."""
        D, R = self.head_dim, self.rope
        if step.window_old is None:
            pages, idx = _gather_fp8(window, step.window, D, R)
        else:
            pages = torch.cat([ops.gather_kv_fp8_v4(window, step.window_old, D, R), ops.pack_kv_fp8_v4(kv, R)])
            idx = step.window
        if extra is not None:
            more, more_idx = _gather_fp8(extra[0], extra[1][:, 0], D, R)
            idx = torch.cat([idx, torch.where(more_idx >= 0, more_idx + pages.shape[0], -1)], dim=1)
            pages = torch.cat([pages, more])
        out, _ = ops.sparse_mla_decode_fp8_v4(
            q[:, None], pages, idx[:, None].to(torch.int32), self.scale, R, sink=self.sinks
        )
        return out

    def _compress(
        self, x, q_res, step: V4Step, kv_cache: KVCache, layer: int, iq=None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Advance every sequence's compressor (and indexer) by its new tokens, in the pool;
        returns the attention's second key source: (this layer's entries region, [N, D] values
        or fp8_ds_v4 pages; the rows each query reads [T, 1, K2]), or None when no query sees an
        entry yet."""
        comp, ix = self.compressor, step.entries[self.compressor.rate]
        csa = isinstance(comp, CSACompressor)
        name = "csa" if csa else "hca"
        entries = _region(kv_cache, f"{name}_kv", layer)
        own, index, w = comp.project_all(x) if csa else (None, None, None)  # one GEMM where joined
        comp.update(x, ix, step.state_slots, entries, kv_cache.layer(f"{name}_state", layer), step.state_dst, own)
        if csa:
            keys, st = kv_cache.layer("csa_index_k", layer), kv_cache.layer("csa_index_state", layer)
            comp.indexer.update(x, ix, step.state_slots, keys, st, step.state_dst, index)
            cos, sin = step.rope["compress"]
            rows = comp.indexer.select(x, q_res, cos, sin, keys, ix, step.seq_ids, w, iq)  # [T, k]
        else:
            rows = ix.visible  # [T, Em]
        return (entries, rows[:, None]) if rows.shape[1] else None


def _region(kv_cache: KVCache, name: str, layer: int) -> torch.Tensor:
    """A layer's K = V region: flat values [N, D], or fp8_ds_v4 pages [blocks, records, bytes]."""
    return kv_cache.layer_pages(name, layer) if kv_cache.specs[name].byte_record else kv_cache.layer(name, layer)


def _gather_fp8(pages: torch.Tensor, rows: torch.Tensor, dim: int, rope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [T, K] (slots, -1 pad) -> (their records as pages of one [T*K, 1, bytes], indices [T, K] into them)."""
    flat = rows.clamp(min=0).long().flatten()
    local = torch.arange(flat.numel(), device=rows.device).view_as(rows)
    return ops.gather_kv_fp8_v4(pages, flat, dim, rope), torch.where(rows >= 0, local, -1)
