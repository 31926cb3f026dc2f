"""DeepSeek-V4's KV compressors (CSA and HCA) and the CSA lightning indexer, over the paged pool.

Legend: T tokens of the step (all sequences), B sequences, hidden model width, m rate (tokens per
entry), Dc entry dim (head_dim, or index_head_dim for the indexer), C projection width (Dc, or
2*Dc with overlap), U groups the step touches (step.GroupPlan), Hi/Di indexer heads/dim, Q
q_lora_rank, R rope dims.

A compressor pools every m consecutive tokens into one entry:
    entry = kv_norm(sum_j softmax_j(gate_j + position_bias_j) * kv_j), roped at position e*m.
HCA pools its group only (C = Dc). CSA (overlap) projects two series per token, Ca = [:Dc] and
Cb = [Dc:], and pools 2m slots: the previous group's Ca and its own group's Cb, so windows of
2m tokens overlap by m. The indexer is a CSA compressor of its own (at Di) plus a scorer: each
query keeps the top `index_topk` entries by sum_h w_h * relu(q_h . k) among those it may see
(`ops.indexer_topk_paged`, over the whole flat batch at once, reading the pool's keys).

Running state, one record a sequence in the state region (cache.py): the raw kv and gate of
the incomplete group's P = n % m tokens ([m-1, C] each, zero past P) and, with overlap, the Ca of
the last complete group ([m, Dc] kv and gate with position bias). `CompressedKV.update` advances
every sequence of the step at once: it gathers each touched group's m rows from the records and
the step's projections, pools them all, writes the entries (one scatter) and the new records (one
scatter), so prefill, chunked prefill and decode give the same entries. On the Triton path the
same in kernels/compress.py: one kernel a decode step, two for any other; this code is the
reference.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.model import ops
from pdserve.model.deepseek_v4.layers import (
    V4RMSNorm,
    joined_outputs,
    normed_records,
    rope_tail,
    store_records,
)
from pdserve.model.deepseek_v4.step import EntryIndex
from pdserve.model.fp8 import Block, linear


class CompressedKV(nn.Module):
    """kv_proj / gate_proj [C, hidden], position_bias [m, C] (float32), kv_norm [Dc]. The loader
    joins the two projections' rows (`joined`: one GEMM a step, `project`)."""

    joined = (("kv_proj", "gate_proj"),)  # groups of linears whose weights share one tensor

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap, self.width = dim, rate, overlap, width
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = V4RMSNorm(dim, eps)

    def update(
        self,
        x: torch.Tensor,
        ix: EntryIndex,
        slots: torch.Tensor,
        entries: torch.Tensor,
        states: torch.Tensor,
        dst: torch.Tensor | None = None,
        proj: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Feed every sequence's new tokens x [T, hidden] (state records states[slots], slots [B]):
        writes the entries of the groups the step touches into `entries` (this layer's region:
        [N, Dc] values or fp8_ds_v4 pages) and each sequence's new record into `states`
        [S, state_dim], at row dst [B] (None: slots; a verify chunk's spare slot leaves the
        record it read as it was, for the engine to keep if drafts are rejected). proj: this x's
        (kv_proj(x), gate_proj(x)) when the caller ran them already (`CSACompressor.project_all`)."""
        plan, m, dim, C = ix.groups, self.rate, self.dim, self.width
        cos, sin = plan.rope
        if ops.uses_triton(x):
            kv, gate = proj if proj is not None else self.project(x)
            if plan.start is not None and dst is None:  # a decode step: one kernel, in place
                pooled = ops.compress_decode(kv, gate, states, slots, plan.start, self.position_bias, dim, self.overlap)
            else:  # any other step (prefill, mixed, a verify chunk into spare slots): two kernels
                dst = slots if dst is None else dst
                pooled = ops.compress_chunk(kv, gate, states, slots, dst, plan, self.position_bias, dim, self.overlap)
            normed_records(self.kv_norm, pooled, (cos, sin), entries, plan.slot)  # one kernel on a GPU
            return
        B, n = slots.shape[0], (self.rate - 1) * self.width
        rec = states[slots]  # [B, state_dim]
        kv_x, gate_x = proj if proj is not None else self.project(x)
        raw_kv = torch.cat([rec[:, :n].reshape(-1, C).to(x.dtype), kv_x])[plan.src]  # [U, m, C]
        raw_gate = torch.cat([rec[:, n : 2 * n].reshape(-1, C).to(x.dtype), gate_x])[plan.src]
        biased = (raw_gate + self.position_bias).masked_fill(~plan.present[..., None], float("-inf"))  # float32
        kv, gate, prev_kv, prev_gate = raw_kv, biased, None, None
        if self.overlap:
            own_kv, own_gate = raw_kv[..., :dim], biased[..., :dim]  # [U, m, Dc]: this group's Ca
            stored = rec[:, 2 * n :].view(B, 2, m, dim)[plan.seq]  # [U, 2, m, Dc]: the state's last Ca
            first = plan.first[:, None, None]
            prev_kv = torch.where(first, stored[:, 0].to(x.dtype), own_kv[plan.prev])
            prev_gate = torch.where(first, stored[:, 1].to(gate.dtype), own_gate[plan.prev])
            none = ~plan.has_prev[:, None, None]  # before the first group: kv 0, gate -inf
            prev_kv = prev_kv.masked_fill(none, 0.0)
            prev_gate = prev_gate.masked_fill(none, float("-inf"))
            kv = torch.cat([prev_kv, raw_kv[..., dim:]], dim=1)  # [U, 2m, Dc]: previous Ca, own Cb
            gate = torch.cat([prev_gate, gate[..., dim:]], dim=1)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)  # [U, Dc]
        store_records(
            entries, plan.slot, self.kv_norm(pooled, rope=(cos, sin)), 2 * cos.shape[-1]
        )  # norm + rope: one kernel
        dst = slots if dst is None else dst
        states.index_copy_(0, dst, self._record(plan, raw_kv, raw_gate, biased, prev_kv, prev_gate).to(states.dtype))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_proj(x), gate_proj(x) [T, C]: one GEMM over both weights where the loader joined them
        (`join_rows`; the two halves of its [T, 2C] output, row-strided views), else two."""
        kv, gate = joined_outputs(x, self.kv_proj, self.gate_proj)
        return kv, gate

    def _record(self, plan, raw_kv, raw_gate, biased, prev_kv, prev_gate) -> torch.Tensor:
        """[B, state_dim]: each sequence's last group's first P rows (raw kv, raw gate; zero
        past P) and, with overlap, the Ca of its last complete group (kv, gate + bias)."""
        m, dim, last = self.rate, self.dim, plan.last
        keep = (torch.arange(m - 1, device=last.device) < plan.pending[:, None])[..., None]  # [B, m-1, 1]
        parts = [torch.where(keep, raw_kv[last, : m - 1], 0.0), torch.where(keep, raw_gate[last, : m - 1], 0.0)]
        if self.overlap:
            full = (plan.pending == 0)[:, None, None]  # the last group is complete: its own Ca
            parts += [
                torch.where(full, raw_kv[last, :, :dim], prev_kv[last]),
                torch.where(full, biased[last, :, :dim], prev_gate[last]),
            ]
        return torch.cat([p.float().flatten(1) for p in parts], dim=1)


class HCACompressor(CompressedKV):
    """Heavily compressed attention: dense over its non-overlapping entries (which ones a query
    may see: EntryIndex.visible, built once per step)."""


class IndexScorer(nn.Module):
    """weights_proj [Hi, hidden]: per-head weights of the index score."""

    def __init__(self, hidden: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.softmax_scale, self.weights_scale = head_dim**-0.5, heads**-0.5
        self.weights_proj = nn.Linear(hidden, heads, bias=False)

    @property
    def scale(self) -> float:
        """The head weights' factor, both scales folded in: transformers scales the ReLU'd dot by
        Di^-0.5 and the weights by Hi^-0.5; relu(s) * c = relu(s * c) for c > 0. The weights are
        weights_proj(x).float() * scale [T, Hi] (`ops.indexer_topk_paged` multiplies)."""
        return self.weights_scale * self.softmax_scale


class Indexer(CompressedKV):
    """The lightning indexer: its own overlapping compressor at Di, q_b_proj [Hi*Di, Q] (FP8 in
    V4-Flash, kept so with `fp8_block`; its compressor and weights_proj are bf16), scorer. Its
    CSA compressor joins its projections (`CSACompressor.joined`)."""

    joined = ()

    def __init__(
        self,
        hidden: int,
        q_lora_rank: int,
        heads: int,
        head_dim: int,
        rate: int,
        topk: int,
        eps: float,
        fp8_block: Block | None = None,
    ):
        super().__init__(hidden, head_dim, rate, overlap=True, eps=eps)
        self.heads, self.topk = heads, topk
        self.q_b_proj = linear(q_lora_rank, heads * head_dim, fp8_block=fp8_block)
        self.scorer = IndexScorer(hidden, heads, head_dim)

    def select(self, x, q_res, cos, sin, keys: torch.Tensor, ix: EntryIndex, seq_ids: torch.Tensor, w=None, q=None):
        """x [T, hidden], q_res [T, Q], cos/sin [T, R/2] (compress rope), keys [N, Di] (this
        layer's indexer-key region), ix the rate's entries, seq_ids [T] int32, w: weights_proj(x)
        [T, Hi] and q: q_b_proj(q_res) [T, Hi*Di] when the caller ran them already (joined GEMMs)
        -> [T, min(topk, Em)] int32: the region rows of each query's top-k visible entries, -1 pad."""
        if ix.max_seen == 0:
            return ix.seen.new_empty(x.shape[0], 0)
        q = self.q_b_proj(q_res) if q is None else q
        q = rope_tail(q.view(x.shape[0], self.heads, self.dim), cos, sin)  # [T, Hi, Di]
        w = self.scorer.weights_proj(x) if w is None else w
        scale = self.scorer.scale  # applied in the kernel (float32)
        return ops.indexer_topk_paged(q, keys, w, ix.table, seq_ids, ix.seen, ix.page, ix.max_seen, self.topk, scale)


class CSACompressor(CompressedKV):
    """Compressed sparse attention: overlapping entries at head_dim, filtered by the indexer.
    Its projections and the indexer's read the same x: the loader joins all five (`joined`)."""

    joined = (("kv_proj", "gate_proj", "indexer.kv_proj", "indexer.gate_proj", "indexer.scorer.weights_proj"),)

    def __init__(self, hidden: int, dim: int, rate: int, eps: float, indexer: Indexer) -> None:
        super().__init__(hidden, dim, rate, overlap=True, eps=eps)
        self.indexer = indexer

    def project_all(self, x: torch.Tensor):
        """(kv_proj(x), gate_proj(x)), the indexer's (kv_proj(x), gate_proj(x)) and its
        weights_proj(x), from one GEMM where joined (row-strided views of its output)."""
        kv, gate, ikv, igate, w = joined_outputs(x, *(self.get_submodule(n) for n in self.joined[0]))
        return (kv, gate), (ikv, igate), w
