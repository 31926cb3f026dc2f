"""Decode steps replayed as CUDA graphs (nano-vllm's and vLLM's scheme), so a decode step costs
its kernels and not the Python and launches of every layer.

A graph runs P sequences of up to n new tokens each (key (P, n, context bucket)); plain decode
is n = 1. Sequence counts of a ladder (1, 2, 4, 8, then every 16 up to `cuda_graph_max_bs`),
contexts 4K, 16K, 64K, ... (x4) up to max_model_len; all share one memory pool, captured largest
first. A step of B sequences whose longest context is C replays the graph of the smallest P >= B
(decode rows: the smallest row count >= T) and the smallest bucket >= C; the graph reads its
inputs from static buffers that the step fills first. The extra sequences are padding: they write
their KV records into the pool's scratch block, one block past those the BlockManager hands out
(and, for DeepSeek-V4, the scratch window block and state slot past those of the window and state
spaces: a padding sequence starts at position 0 and its every table and state slot points there),
so no sequence's record is touched. The paged kernels' grids (and the indexer's [G, C] scores and
top-k; V4's entry lists, C / m wide) are sized by the bucket, not by max_model_len, and each query
stops at its own context.

Speculative decoding's verify steps (chunks [last token, d_1 .. d_k], `max_chunk` = k + 1) replay
graphs in one of two ways, as the model declares:
  - `verify_as_decode_rows` (V3/V3.2: every part of the decode path is per token): a chunk is
    k + 1 decode rows, each with its own position, slot and context (positions 0..p through its
    sequence's block table), so B sequences verifying k drafts are B (k + 1) rows of the n = 1
    graphs. The ladder then also holds the row counts of B = 1, 2, 4, 8, 16 sequences with 1..k
    drafts each and of every batch size with k drafts (`graph_sizes`);
  - `verify_as_chunks` (V4: a chunk's tokens depend on each other through the sliding window and
    the compressors' state, so the step runs its chunk path, whose metadata is built on the
    device from host ints alone: T, B and the context bound; on a GPU by
    kernels/v4_chunk_step.py, else by step.py): graphs of shape (P, n), P
    chunks of up to n tokens each, G = P n rows. A step of B chunks that sample, the longest n'
    tokens, replays the graph of fewest rows with n >= n' and P > B, or P = B when its chunks
    fill it (any mix of verify chunks, plain decodes and recomputes); the rows its chunks leave go
    to padding sequences B..P-1, as even as can be, tokens 0 at positions 0.. whose tables, state
    slot and new-state slot (`state_dst`) are the scratch ones (one longer than max_len: the next
    shape, or eager). Captured: n = k + 1 for every P of the ladder and n = 2..k for P <= 16 only
    (`chunk_shapes`: MTP drafts k a step, so k + 1 is the common longest chunk), each at most
    max_num_batched_tokens tokens. A step of B = P equal chunks (a benchmark's) runs exactly its
    rows; a mixed one at B = P takes the next P.

Used when: CUDA, not `enforce_eager`, one engine rank (tensor parallelism runs eagerly), a model
that declares `supports_cuda_graphs` (DeepSeek-V3/V3.2 and V4: its routed experts run in one fused
kernel a layer), every chunk of the step samples and fits a captured shape. Anything else runs
eagerly, as before. A model that keeps its step's residual streams for the MTP layer
(`last_streams`, V4 with MTP: `mtp_source`) gets a replayed graph's, its real rows.

Legend: B chunks (sequences) in the step, T their tokens, P sequences of the graph replayed
(>= B), n tokens a chunk, G rows of the graph (P n), S the most sequences of any graph (its
static tables' rows), W block-table width of max_model_len.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.model.batch import ForwardBatch, StepInputs
from pdserve.model.kv_cache import KVCache

if TYPE_CHECKING:
    from pdserve.engine.launched_step import Feed

SMALL_BATCH = 16  # chunk graphs of fewer than k + 1 tokens are captured up to this many sequences


def context_buckets(max_len: int, first: int = 4096) -> list[int]:
    """Context bounds captured: 4096, 16384, 65536, ... below max_len, then max_len."""
    buckets, c = [], first
    while c < max_len:
        buckets.append(c)
        c *= 4
    return buckets + [max_len]


def graph_sizes(max_bs: int, max_chunk: int = 1, max_rows: int | None = None) -> list[int]:
    """Row counts captured: 1, 2, 4, 8, 16, 32, 48, ... up to max_bs (and max_bs itself); with
    verify chunks of up to max_chunk tokens as decode rows also n * b rows for b <= 16 of those and
    n = 2..max_chunk, and max_chunk * b for every b, at most max_rows (the step's token budget) of them."""
    ladder = sorted(set([s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 16)) + [max_bs]))
    verify = {n * b for b in ladder if b <= SMALL_BATCH for n in range(2, max_chunk + 1)}
    verify |= {max_chunk * b for b in ladder}
    return sorted(set(ladder) | {r for r in verify if max_rows is None or r <= max_rows})


def chunk_shapes(max_bs: int, max_chunk: int, max_rows: int | None = None) -> list[tuple[int, int]]:
    """Verify graphs of whole chunks (`verify_as_chunks`), (P sequences, n tokens each): n =
    max_chunk for every P of the ladder, n = 2..max_chunk - 1 for P <= 16, at most max_rows tokens."""
    ladder = graph_sizes(max_bs)
    shapes = {(p, max_chunk) for p in ladder} | {
        (p, n) for p in ladder if p <= SMALL_BATCH for n in range(2, max_chunk)
    }
    return sorted(s for s in shapes if s[1] > 1 and (max_rows is None or s[0] * s[1] <= max_rows))


def graph_shapes(max_bs: int, max_chunk: int = 1, max_rows: int | None = None, as_chunks: bool = False):
    """Every (P, n) captured: the decode graphs (n = 1; with verify chunks as decode rows, their
    row counts too) and, with `as_chunks`, the chunk graphs."""
    rows = graph_sizes(max_bs, 1 if as_chunks else max_chunk, max_rows)
    return [(g, 1) for g in rows] + (chunk_shapes(max_bs, max_chunk, max_rows) if as_chunks else [])


def verified_drafts(config) -> int:
    """k of an engine's verify steps: 0 without speculation, and on a prefill worker (with MTP it
    runs the MTP layer's pass and verifies nothing)."""
    spec = config.speculative_config
    return spec.num_speculative_tokens if spec is not None and config.kv_role != "kv_producer" else 0


def graph_ladder(config, model: torch.nn.Module) -> tuple[int, int, bool, list[tuple[int, int]]]:
    """An engine's (max_bs, max_chunk, as_chunks, largest): the largest decode batch captured, the
    longest verify chunk replayed (1 + k with speculative decoding, for a model that declares
    `verify_as_decode_rows` or `verify_as_chunks`; else 1), whether as chunks, and the graphs the
    memory plan profiles, (P, n): the decode graph of most rows and, as chunks, the chunk graph of
    most rows (its key buffer holds each chunk's window besides its rows). config: an EngineConfig."""
    max_bs = config.cuda_graph_max_bs or min(config.max_num_seqs, 256)
    k = verified_drafts(config)
    as_rows, as_chunks = (bool(getattr(model, a, False)) for a in ("verify_as_decode_rows", "verify_as_chunks"))
    max_chunk = 1 + k if k and (as_rows or as_chunks) else 1
    shapes = graph_shapes(max_bs, max_chunk, config.max_num_batched_tokens, as_chunks)
    largest = [max((s for s in shapes if s[1] == 1), key=lambda s: s[0])]
    largest += (
        [max((s for s in shapes if s[1] > 1), key=lambda s: (s[0] * s[1], s[1]))] if as_chunks and max_chunk > 1 else []
    )
    return max_bs, max_chunk, as_chunks and max_chunk > 1, largest


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
        as_chunks: bool = False,
    ) -> None:
        """scratch_*: the padding sequences' block, window block and state slot (-1: the pool has
        no such space). max_chunk: the longest verify chunk replayed (1 + k drafts; 1: decode
        only), as decode rows or, with as_chunks, as chunk graphs. max_rows: the step's token budget."""
        self.model, self.kv_cache = model, kv_cache
        self.max_chunk, self.as_chunks = max_chunk, as_chunks
        self.shapes = graph_shapes(max_bs, max_chunk, max_rows, as_chunks)  # (P, n)
        self.sizes = [p for p, n in self.shapes if n == 1]  # decode row counts
        self.chunk_graphs = sorted((s for s in self.shapes if s[1] > 1), key=lambda s: s[0] * s[1])
        self.buckets = context_buckets(max_len)
        self.max_len = max_len
        self.block_size = bs = kv_cache.block_size
        self.width = -(-max_len // bs)
        self.scratch_slot = scratch_block * bs
        dev, G = next(iter(kv_cache.regions.values())).device, max(p * n for p, n in self.shapes)
        S = max(p for p, _ in self.shapes)  # table rows: a decode row's, or a chunk's
        self.scratch_block, self.scratch_window_block, self.scratch_state_slot = (
            scratch_block,
            scratch_window_block,
            scratch_state_slot,
        )
        # the static inputs, as rows of two tensors so that one copy fills each dtype's rows: int64
        # input_ids, positions, slot_mapping [G rows], state_slots, starts, state_dst, lens [S
        # sequences]; int32 seq_ids, context_lens [G]. Static all (a graph must not read a freed tensor).
        self.ids64 = torch.empty(7, G, dtype=torch.int64, device=dev)
        self.ids32 = torch.empty(2, G, dtype=torch.int32, device=dev)
        self.input_ids, self.positions, self.slot_mapping, self.state_slots, self.starts, self.state_dst, self.lens = (
            self.ids64.unbind(0)
        )
        self.seq_ids, self.context_lens = self.ids32.unbind(0)
        self.block_tables = torch.full((S, self.width), scratch_block, dtype=torch.int32, device=dev)
        self.window_tables = torch.full((S, self.width), scratch_window_block, dtype=torch.int64, device=dev)
        self.rows = torch.arange(G, device=dev)
        self._fill_padding(G, 1)
        # a step's inputs are written on the host into one pinned buffer and cross in one copy
        # (9 rows of G, then the step's [B, w] block and window tables)
        cuda = dev.type == "cuda"
        self.staged_host = torch.empty(9 * G + 2 * S * self.width, dtype=torch.int64, pin_memory=cuda)
        self.staged = torch.empty_like(self.staged_host, device=dev)
        self.copied = torch.cuda.Event() if cuda else None  # the last copy out of staged_host
        self._checked: tuple[StepInputs, tuple[int, int] | None] | None = None  # fits' step and its shape
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, int], torch.Tensor] = {}  # (P, n, bucket) -> [G, hidden] output
        self.streams: dict[tuple[int, int, int], torch.Tensor | None] = {}  # -> the model's last_streams

    def static_batch(self, p: int, n: int, bucket: int) -> ForwardBatch:
        """The ForwardBatch a graph of shape (p, n) and contexts up to `bucket` is captured with:
        views of the static buffers. n = 1: p decode rows (each its own sequence, starting at its
        position; V3's verify rows among them). n > 1: p chunks of up to n tokens (a step's, then
        padding sequences that take the rows they leave), as ForwardBatch.build makes them
        with as_decode_rows (no prefill chunks; the model runs its chunk path: V4's step.py),
        logits at every row."""
        g = p * n
        return ForwardBatch(
            input_ids=self.input_ids[:g], positions=self.positions[:g], slot_mapping=self.slot_mapping[:g],
            seq_ids=self.seq_ids[:g], context_lens=self.context_lens[:g], decode_rows=self.rows[:g], prefill=None,
            logits_indices=self.rows[:g], starts=self.positions[:g] if n == 1 else self.starts[:p],
            lens=self.lens[:p], block_tables=self.block_tables[:p], window_tables=self.window_tables[:p],
            state_slots=self.state_slots[:p], block_size=self.block_size, max_context=bucket,
            state_dst=None if n == 1 else self.state_dst[:p],
        )  # fmt: skip

    def capture(self) -> None:
        """Capture every shape, largest first (later ones reuse its pool); each after one eager
        warm-up run (Triton compiles, kernels size their scratch buffers outside the capture)."""
        pool = None
        for c in reversed(self.buckets):
            for p, n in sorted(self.shapes, key=lambda s: (s[0] * s[1], s[1]), reverse=True):
                self._fill_padding(p, n)
                batch = self.static_batch(p, n, c)
                self.model.forward(batch, self.kv_cache)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.keep((p, n, c), self.model.forward(batch, self.kv_cache))
                pool = graph.pool() if pool is None else pool
                self.graphs[p, n, c] = graph
        torch.cuda.synchronize()

    def _fill_padding(self, p: int, n: int) -> None:
        """The static buffers of a graph of padding only, which it is captured with: decode rows
        (token 0 at position 0, no context, the scratch slots) or chunks."""
        if n == 1:
            pad = [0, 0, self.scratch_slot, self.scratch_state_slot, 0, 0, 1]
            self.ids64[:, :p] = torch.tensor(pad, device=self.ids64.device)[:, None]
            self.ids32[:, :p] = 0
            return
        none = torch.zeros(0, dtype=torch.int64)
        empty = StepInputs(none, none, none, none.bool(), none.view(0, 1), none.view(0, 1), none)
        g = p * n
        self._chunk_rows(empty, self.staged_host.numpy()[: 9 * g].reshape(9, g), p)
        self._send(empty, g, p)

    def keep(self, key: tuple[int, int, int], hidden: torch.Tensor) -> None:
        """A graph's outputs: its hidden rows and, for a model that keeps its step's residual
        streams (V4 with MTP), those."""
        self.outputs[key], self.streams[key] = hidden, getattr(self.model, "last_streams", None)

    def shape_of(self, step: StepInputs) -> tuple[int, int] | None:
        """(P, n) of the graph that runs the step, None when it runs eagerly (numpy: no torch op
        per check). n = 1: its tokens as decode rows (plain decode; V3's verify chunks). n > 1: the
        chunk graph of fewest rows with n >= the longest chunk and P > B (P = B: chunks that fill
        it), whose padding sequences fit max_len."""
        lens = step.lens.numpy()
        if not lens.size or step.block_tables.shape[1] > self.width or not step.samples.numpy().all():
            return None
        if int((step.starts.numpy() + lens).max()) > self.max_len:
            return None
        n, T, B = int(lens.max()), int(lens.sum()), lens.size
        if step.state_dst is None and (n == 1 or not self.as_chunks and n <= self.max_chunk):
            sizes = self.sizes
            return (sizes[bisect.bisect_left(sizes, T)], 1) if T <= sizes[-1] else None
        for p, m in self.chunk_graphs:
            if m >= n and (p > B and -(-(p * m - T) // (p - B)) <= self.max_len or p == B and T == p * m):
                return p, m
        return None

    def fits(self, step: StepInputs) -> bool:
        self._checked = (step, self.shape_of(step))  # `fill` of the same step reuses it
        return self._checked[1] is not None

    def run(self, step: StepInputs, feed: Feed | None = None) -> torch.Tensor:
        """hidden [T, hidden] of a step that `fits`: fill the buffers, replay the graph. feed: input
        rows the previous step's tokens give on the device (the overlapped loop; launched_step.py)."""
        key = self.fill(step)
        if feed is not None:  # a decode step's rows are its input_ids rows, in order
            if key[1] != 1:
                raise RuntimeError("only a step of decode rows takes in-flight tokens")
            self.input_ids[feed[0]] = feed[2][feed[1]]
        self.replay(key)
        T = step.input_ids.numel()  # the real rows come first
        if self.streams.get(key) is not None:
            self.model.last_streams = self.streams[key][:T]
        return self.outputs[key][:T]

    def fill(self, step: StepInputs) -> tuple[int, int, int]:
        """Write the step into the static buffers; returns the graph's (P, n, context bucket).
        Host work is numpy on a pinned buffer; the device sees one copy in and 2-6 copies out
        (the step's inputs are on the host: the scheduler's lists)."""
        checked, self._checked = self._checked, None
        p, n = checked[1] if checked is not None and checked[0] is step else self.shape_of(step)
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the pinned buffer
        g = p * n
        rows = self.staged_host.numpy()[: 9 * g].reshape(9, g)
        end = self._chunk_rows(step, rows, p) if n > 1 else self._decode_rows(step, rows, g)
        bucket = self.buckets[bisect.bisect_left(self.buckets, end)]
        self._send(step, g, p)
        return p, n, bucket

    def _decode_rows(self, step: StepInputs, rows: np.ndarray, g: int) -> int:
        """Rows of a step of g decode rows (T real ones, then padding rows: token 0 at position 0, no
        context, writing to the scratch, each its own table row >= B); returns the longest context."""
        T, bs, v4 = step.input_ids.numel(), self.block_size, self.scratch_window_block >= 0
        seq, pos = decode_rows(step.starts.numpy(), step.lens.numpy(), T)  # [T] each row's chunk and position
        rows[:, T:] = np.array([0, 0, self.scratch_slot, self.scratch_state_slot, 0, 0, 1, 0, 0])[:, None]
        rows[7] = np.arange(g)
        rows[0, :T], rows[1, :T], rows[7, :T], rows[8, :T] = step.input_ids.numpy(), pos, seq, pos + 1
        rows[2, :T] = step.block_tables.numpy()[seq, pos // bs] * bs + pos % bs
        rows[3, :T] = step.state_slots.numpy()[seq] if v4 else self.scratch_state_slot
        rows[4], rows[5], rows[6] = rows[1], rows[3], 1  # (a decode row starts at its position, writes its slot)
        return int(pos.max()) + 1

    def _chunk_rows(self, step: StepInputs, rows: np.ndarray, b: int) -> int:
        """Rows of b sequences: the step's B chunks, then padding sequences that take the graph's
        other rows (tokens 0 at positions 0.., their tables and state slots the scratch ones);
        returns the longest context (a padding sequence's too)."""
        B, T, bs, scratch = step.lens.numel(), step.input_ids.numel(), self.block_size, self.scratch_state_slot
        lens, starts = np.zeros(b, dtype=np.int64), np.zeros(b, dtype=np.int64)
        lens[:B], lens[B:], starts[:B] = step.lens.numpy(), padding_lens(rows.shape[1] - T, b - B), step.starts.numpy()
        seq = np.repeat(np.arange(b), lens)
        pos = starts[seq] + np.arange(seq.size) - (np.cumsum(lens) - lens)[seq]
        rows[0, :T], rows[0, T:] = step.input_ids.numpy(), 0
        rows[1] = pos
        rows[2, :T] = step.block_tables.numpy()[seq[:T], pos[:T] // bs] * bs + pos[:T] % bs
        rows[2, T:] = self.scratch_slot + pos[T:] % bs
        rows[3, :B], rows[3, B:b] = step.state_slots.numpy(), scratch
        rows[4, :b], rows[6, :b] = starts, lens
        rows[5, :B] = (step.state_dst if step.state_dst is not None else step.state_slots).numpy()
        rows[5, B:b] = scratch
        rows[7], rows[8] = seq, pos + 1
        return int(pos.max()) + 1

    def _send(self, step: StepInputs, g: int, tables: int) -> None:
        """The staged rows and the step's tables to the device, in one copy; table rows B..tables
        (the padding's) point at the scratch blocks."""
        B, w = step.block_tables.shape
        n = 9 * g + 2 * B * w
        both = self.staged_host.numpy()[9 * g : n].reshape(2, B, w)
        both[0], both[1] = step.block_tables.numpy(), step.window_tables.numpy()
        self.staged[:n].copy_(self.staged_host[:n], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        staged = self.staged[: 9 * g].view(9, g)
        self.ids64[:, :g].copy_(staged[:7])
        self.ids32[:, :g].copy_(staged[7:])
        both = self.staged[9 * g : n].view(2, B, w)
        self.block_tables[:B, :w].copy_(both[0])
        if tables > B:
            self.block_tables[B:tables] = self.scratch_block
        if self.scratch_window_block >= 0:  # DeepSeek-V4's window tables
            self.window_tables[:B, :w].copy_(both[1])
            if tables > B:
                self.window_tables[B:tables] = self.scratch_window_block

    def replay(self, key: tuple[int, int, int]) -> None:
        self.graphs[key].replay()


def padding_lens(rows: int, seqs: int) -> np.ndarray:
    """The lengths of `seqs` padding sequences taking `rows` rows (rows >= seqs), as even as can be."""
    lens = np.full(seqs, rows // max(seqs, 1), dtype=np.int64)
    lens[: rows % max(seqs, 1)] += 1
    return lens


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
