"""Decode steps replayed as CUDA graphs (nano-vllm's and vLLM's scheme), so a decode step costs
its kernels and not the Python and launches of every layer.

One graph per (rows, context bucket): row counts of a ladder (1, 2, 4, 8, then every 16 up to
`cuda_graph_max_bs`), contexts 4K, 16K, 64K, ... (x4) up to max_model_len; all share one memory
pool, captured largest first. A step of T decode rows whose longest context is C replays the
graph of the smallest size >= T and the smallest bucket >= C; the graph reads its inputs from
static buffers that the step fills first. The extra rows are padding: they attend to nothing
(context length 0) and write their KV records into the pool's scratch block, one block past those
the BlockManager hands out (and, for DeepSeek-V4, the scratch window block and state slot past
those of the window and state spaces: a padding row is a sequence at position 0 whose every table
points there), so no sequence's record is touched. The paged kernels' grids (and the indexer's
[G, C] scores and top-k; V4's entry lists, C / m wide) are sized by the bucket, not by
max_model_len, and each query stops at its own context.

Speculative decoding's verify steps (`max_chunk` = k + 1, for a model whose decode path is per
token: `verify_as_decode_rows`) replay the same graphs: a chunk [last token, d_1 .. d_k] is k + 1
decode rows, each with its own position, slot and context (positions 0..p through its sequence's
block table), so B sequences verifying k drafts are B (k + 1) rows. The ladder then also holds
the row counts of B = 1, 2, 4, 8, 16 sequences with 1..k drafts each and of every batch size with
k drafts (`graph_sizes`), capped at max_num_batched_tokens.

Used when: CUDA, not `enforce_eager`, one engine rank (tensor parallelism runs eager), a model that
declares `supports_cuda_graphs` (DeepSeek-V3/V3.2 and V4: its routed experts run in one fused
kernel a layer), every chunk of the step samples and is at most `max_chunk` tokens, T <= the
largest size. Anything else runs eagerly, as before.

Legend: B chunks (sequences) in the step, T decode rows (their tokens), G rows of the graph
replayed (>= T), W block-table width of max_model_len.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from pdserve.model.batch import ForwardBatch, StepInputs
from pdserve.model.kv_cache import KVCache


def context_buckets(max_len: int, first: int = 4096) -> list[int]:
    """Context bounds captured: 4096, 16384, 65536, ... below max_len, then max_len."""
    buckets, c = [], first
    while c < max_len:
        buckets.append(c)
        c *= 4
    return buckets + [max_len]


def graph_sizes(max_bs: int, max_chunk: int = 1, max_rows: int | None = None) -> list[int]:
    """Row counts captured: 1, 2, 4, 8, 16, 32, 48, ... up to max_bs (and max_bs itself); with
    verify chunks of up to max_chunk tokens also n * b rows for b <= 16 of those and n = 2..max_chunk,
    and max_chunk * b for every b, at most max_rows (the step's token budget) of them."""
    ladder = sorted(set([s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 16)) + [max_bs]))
    verify = {n * b for b in ladder if b <= 16 for n in range(2, max_chunk + 1)} | {max_chunk * b for b in ladder}
    return sorted(set(ladder) | {r for r in verify if max_rows is None or r <= max_rows})


def verified_drafts(config) -> int:
    """k of an engine's verify steps: 0 without speculation, and on a prefill worker (with MTP it
    runs the MTP layer's pass and verifies nothing)."""
    spec = config.speculative_config
    return spec.num_speculative_tokens if spec is not None and config.kv_role != "kv_producer" else 0


def graph_ladder(config, model: torch.nn.Module) -> tuple[int, int, list[int]]:
    """An engine's (max_bs, max_chunk, sizes): the largest decode batch captured, the longest chunk
    run as decode rows (1 + k with speculative decoding, for a model whose decode path is per token:
    `verify_as_decode_rows`; else 1) and the row counts captured. config: an EngineConfig."""
    max_bs = config.cuda_graph_max_bs or min(config.max_num_seqs, 256)
    k = verified_drafts(config)
    max_chunk = 1 + k if k and getattr(model, "verify_as_decode_rows", False) else 1
    return max_bs, max_chunk, graph_sizes(max_bs, max_chunk, config.max_num_batched_tokens)


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        *,
        max_bs: int,
        max_len: int,
        scratch_block: int,
        scratch_window_block: int = -1,
        scratch_state_slot: int = -1,
        max_chunk: int = 1,
        max_rows: int | None = None,
    ) -> None:
        """scratch_*: the padding rows' block, window block and state slot (-1: the pool has no such
        space). max_chunk: the longest chunk replayed as decode rows (1 + k drafts; 1: decode only)."""
        self.model, self.kv_cache = model, kv_cache
        self.max_chunk = max_chunk
        self.sizes = graph_sizes(max_bs, max_chunk, max_rows)
        self.buckets = context_buckets(max_len)
        self.max_len = max_len
        self.block_size = bs = kv_cache.block_size
        self.width = -(-max_len // bs)
        self.scratch_slot = scratch_block * bs
        dev, G = next(iter(kv_cache.regions.values())).device, self.sizes[-1]
        self.scratch_block, self.scratch_window_block, self.scratch_state_slot = (
            scratch_block,
            scratch_window_block,
            scratch_state_slot,
        )
        # the static inputs, as rows of two tensors so that one copy fills each dtype's rows:
        # int64 input_ids, positions, slot_mapping, state_slots; int32 seq_ids, context_lens
        self.ids64 = torch.zeros(4, G, dtype=torch.int64, device=dev)
        self.ids64[2], self.ids64[3] = self.scratch_slot, scratch_state_slot
        self.ids32 = torch.zeros(2, G, dtype=torch.int32, device=dev)
        self.input_ids, self.positions, self.slot_mapping, self.state_slots = self.ids64.unbind(0)
        self.seq_ids, self.context_lens = self.ids32.unbind(0)
        self.lens = torch.ones(G, dtype=torch.int64, device=dev)  # static too: a graph must not read a freed tensor
        self.block_tables = torch.full((G, self.width), scratch_block, dtype=torch.int32, device=dev)
        self.window_tables = torch.full((G, self.width), scratch_window_block, dtype=torch.int64, device=dev)
        self.rows = torch.arange(G, device=dev)
        # a step's inputs are written on the host into one pinned buffer and cross in one copy
        # (6 rows of G, then the step's [B, w] block and window tables)
        cuda = dev.type == "cuda"
        self.staged_host = torch.empty(6 * G + 2 * G * self.width, dtype=torch.int64, pin_memory=cuda)
        self.staged = torch.empty_like(self.staged_host, device=dev)
        self.copied = torch.cuda.Event() if cuda else None  # the last copy out of staged_host
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # (G, bucket) -> [G, hidden] output buffer

    def static_batch(self, g: int, bucket: int) -> ForwardBatch:
        """The ForwardBatch a graph of g rows and contexts up to `bucket` is captured with: views
        of the static buffers."""
        return ForwardBatch(
            input_ids=self.input_ids[:g], positions=self.positions[:g], slot_mapping=self.slot_mapping[:g],
            seq_ids=self.seq_ids[:g], context_lens=self.context_lens[:g], decode_rows=self.rows[:g], prefill=None,
            logits_indices=self.rows[:g], starts=self.positions[:g], lens=self.lens[:g],
            block_tables=self.block_tables[:g], window_tables=self.window_tables[:g], state_slots=self.state_slots[:g],
            block_size=self.block_size, max_context=bucket,
        )  # fmt: skip

    def capture(self) -> None:
        """Capture every size, largest first (later ones reuse its pool); each after one eager
        warm-up run (Triton compiles, kernels size their scratch buffers outside the capture)."""
        pool = None
        for c in reversed(self.buckets):
            for g in reversed(self.sizes):
                batch = self.static_batch(g, c)
                self.model.forward(batch, self.kv_cache)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[g, c] = self.model.forward(batch, self.kv_cache)
                pool = graph.pool() if pool is None else pool
                self.graphs[g, c] = graph
        torch.cuda.synchronize()

    def fits(self, step: StepInputs) -> bool:
        T = step.input_ids.numel()
        if not 0 < T <= self.sizes[-1] or step.block_tables.shape[1] > self.width:
            return False
        ends = step.starts.numpy() + step.lens.numpy()
        return all_decode_rows(step, self.max_chunk) and int(ends.max()) <= self.max_len

    def run(self, step: StepInputs) -> torch.Tensor:
        """hidden [T, hidden] of a step that `fits`: fill the buffers, replay the graph of G rows."""
        key = self.fill(step)
        self.replay(key)
        return self.outputs[key][: step.input_ids.numel()]

    def fill(self, step: StepInputs) -> tuple[int, int]:
        """Write the step into the static buffers; returns the graph's (rows G, context bucket).
        Host work is numpy on a pinned buffer; the device sees one copy in and 2-6 copies out
        (the step's inputs are on the host: the scheduler's lists)."""
        B, T, bs = step.lens.numel(), step.input_ids.numel(), self.block_size
        g = self.sizes[bisect.bisect_left(self.sizes, T)]
        seq, pos = decode_rows(step.starts.numpy(), step.lens.numpy(), T)  # [T] each row's chunk and position
        tables = step.block_tables.numpy()
        bucket = self.buckets[bisect.bisect_left(self.buckets, int(pos.max()) + 1)]
        w, v4 = tables.shape[1], self.scratch_window_block >= 0
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the pinned buffer
        rows = self.staged_host.numpy()[: 6 * g].reshape(6, g)
        rows[:, T:] = np.array([0, 0, self.scratch_slot, self.scratch_state_slot, 0, 0])[:, None]  # padding rows:
        rows[4] = np.arange(g)  # token 0 at position 0, no context, writes to the scratch; its own table row (>= B)
        rows[0, :T], rows[1, :T], rows[4, :T], rows[5, :T] = step.input_ids.numpy(), pos, seq, pos + 1
        rows[2, :T] = tables[seq, pos // bs] * bs + pos % bs
        rows[3, :T] = step.state_slots.numpy()[seq] if v4 else self.scratch_state_slot
        n = 6 * g + 2 * B * w
        both = self.staged_host.numpy()[6 * g : n].reshape(2, B, w)
        both[0], both[1] = tables, step.window_tables.numpy()
        self.staged[:n].copy_(self.staged_host[:n], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        staged = self.staged[: 6 * g].view(6, g)
        self.ids64[:, :g].copy_(staged[:4])
        self.ids32[:, :g].copy_(staged[4:])
        both = self.staged[6 * g : n].view(2, B, w)
        self.block_tables[:B, :w].copy_(both[0])
        if g > B:
            self.block_tables[B:g] = self.scratch_block  # padding rows: every table points at the scratch
        if v4:  # DeepSeek-V4's window tables
            self.window_tables[:B, :w].copy_(both[1])
            if g > B:
                self.window_tables[B:g] = self.scratch_window_block
        return g, bucket

    def replay(self, key: tuple[int, int]) -> None:
        self.graphs[key].replay()


def all_decode_rows(step: StepInputs, max_chunk: int) -> bool:
    """Every chunk samples and is at most max_chunk tokens: the step runs as decode rows (numpy:
    no torch op per check)."""
    return bool((step.lens.numpy() <= max_chunk).all() and step.samples.numpy().all())


def decode_rows(starts: np.ndarray, lens: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    """Each token's chunk [T] and position [T] (a chunk of n tokens: rows start .. start + n - 1)."""
    if T == lens.size:  # plain decode: a row a chunk
        return np.arange(T), starts
    seq = np.repeat(np.arange(lens.size), lens)
    return seq, starts[seq] + np.arange(T) - np.repeat(np.cumsum(lens) - lens, lens)
