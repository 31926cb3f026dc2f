"""Device memory planned at start: how many KV blocks fit in this worker's share of the GPU.

    load weights -> profile_peak (a dummy prefill of max_num_batched_tokens, max_num_seqs one-token
    decodes, and the largest captured graph's rows) -> measure_figures -> plan_kv_pool -> the pool

`gpu_memory_utilization` is vLLM's flag with vLLM's meaning: the share of the WHOLE GPU this worker
may use, so two workers on one GPU at 0.45 each take at most 90% of it between them. Memory that
other processes hold is not this worker's: its own use is measured (torch's allocator, and the
process's CUDA context and libraries through NVML where it can see them), the others' is what the
device says is used beyond that. The pool is what is left of the share after the weights, the
profiled peak activations, the non-torch memory and a reserve; it must also fit in what the other
processes leave free now. On CPU nothing is planned: the pool is the configured size.

`plan_kv_pool` is a pure function of numbers (tests run it on CPU); `profile_peak` runs the model's
forward on dummy batches on any device and measures its peak only on CUDA.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from pdserve.model.batch import ForwardBatch, StepInputs
from pdserve.model.kv_cache import STATE, WINDOW, KVCache, KVRegionSpec

GiB = 2**30
MiB = 2**20
# room left unplanned: allocator fragmentation, the sampler's small tensors, a transfer's metadata
MARGIN_BYTES = 256 * MiB
# this process's CUDA context and library workspaces when NVML cannot see it (a container's pids)
NON_TORCH_FALLBACK_BYTES = 768 * MiB


class PoolDoesNotFit(ValueError):
    """The configured KV pool (or a single block) does not fit; the message gives the numbers."""


@dataclass(frozen=True)
class MemoryFigures:
    """Bytes, all measured (or given by a test) before the pool is made."""

    total: int  # the GPU's memory
    used_by_others: int  # what other processes hold now
    weights: int  # this process's tensors after loading (the model's parameters and buffers)
    peak_activation: int  # the profiled forwards' peak beyond the weights (+ the graphs' pool)
    non_torch: int  # this process's CUDA context, cuBLAS / NCCL workspaces
    reserve: int  # set apart: the transfer arenas made after the pool, and MARGIN_BYTES
    side_bytes: int  # the sliding-window and per-sequence state spaces of the pool
    block_bytes: int  # one token-space block over every region and layer

    def summary(self) -> str:
        return ", ".join(
            f"{k} {v / GiB:.2f} GiB" if k != "block_bytes" else f"a block {v / MiB:.2f} MiB"
            for k, v in vars(self).items()
        )


def plan_kv_pool(m: MemoryFigures, share: float, requested: int | None, useful: int) -> int:
    """Token-space blocks of the pool: `requested` if it fits, else PoolDoesNotFit; unset, the
    largest that fits (at most `useful`, what max_num_seqs sequences of max_model_len could use).
    The pool fits when it fits both in share * total after this worker's other needs and in what
    the other processes leave of the GPU."""
    needs = m.weights + m.peak_activation + m.non_torch + m.reserve + m.side_bytes
    by_share = int(share * m.total) - needs
    by_free = m.total - m.used_by_others - needs
    room = min(by_share, by_free)
    largest = max(room // m.block_bytes, 0)
    if requested is not None and requested <= largest:
        return requested
    if requested is None and largest >= 1:
        return min(largest, useful)
    raise PoolDoesNotFit(_explain(m, share, requested, largest, by_free < by_share))


def _explain(m: MemoryFigures, share: float, requested: int | None, largest: int, others_limit: bool) -> str:
    def gib(n: int) -> str:
        return f"{n / GiB:.2f} GiB"

    want = f"num_kv_blocks {requested}" if requested is not None else "a single KV block"
    lines = [
        f"{want} ({m.block_bytes / MiB:.2f} MiB a block) does not fit in GPU memory:",
        f"  gpu_memory_utilization {share} of {gib(m.total)} allows {gib(int(share * m.total))};",
        f"  weights {gib(m.weights)}, peak activations {gib(m.peak_activation)}, CUDA context and "
        f"libraries {gib(m.non_torch)}, reserve {gib(m.reserve)}, window/state blocks {gib(m.side_bytes)};",
        f"  other processes hold {gib(m.used_by_others)} of the GPU"
        + (" (they, not the share, are the limit now)" if others_limit else ""),
    ]
    fix = "raise gpu_memory_utilization, or lower max_num_batched_tokens / max_num_seqs"
    if largest >= 1:
        lines.append(f"the largest pool that fits: num_kv_blocks {largest} (or {fix})")
    else:
        lines.append(f"no pool fits: {fix}")
    return "\n".join(lines)


def own_non_torch_bytes(device: torch.device) -> int:
    """This process's device memory outside torch's allocator (its CUDA context, library
    workspaces), from NVML's per-process figure; NON_TORCH_FALLBACK_BYTES when NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = next(
            h
            for h in (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount()))
            if str(pynvml.nvmlDeviceGetUUID(h)).removeprefix("GPU-") == uuid.removeprefix("GPU-")
        )
        mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()]
    except Exception:  # no pynvml, no NVML, another GPU naming: the fallback
        return NON_TORCH_FALLBACK_BYTES
    if not mine or mine[0] is None:
        return NON_TORCH_FALLBACK_BYTES
    return max(int(mine[0]) - torch.cuda.memory_reserved(device), 0)


def measure_figures(
    device: torch.device, peak_activation: int, reserve_mib: int, side_bytes: int, block_bytes: int
) -> MemoryFigures:
    """The figures of this process on `device` now (after loading and profiling)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = own_non_torch_bytes(device)
    mine = torch.cuda.memory_reserved(device) + non_torch
    return MemoryFigures(
        total=total,
        used_by_others=max(total - free - mine, 0),
        weights=torch.cuda.memory_allocated(device),
        peak_activation=peak_activation,
        non_torch=non_torch,
        reserve=reserve_mib * MiB + MARGIN_BYTES,
        side_bytes=side_bytes,
        block_bytes=block_bytes,
    )


@torch.inference_mode()
def profile_peak(
    model: torch.nn.Module,
    specs: list[KVRegionSpec],
    *,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_num_batched_tokens: int,
    max_model_len: int,
    max_num_seqs: int,
    graph_shapes: list[tuple[int, int]] | None,
    num_speculative_tokens: int = 0,
) -> int:
    """Peak activation bytes (CUDA; 0 elsewhere, where the forwards still run) of the steps this
    engine may take: prefill chunks filling max_num_batched_tokens, and min(max_num_seqs,
    max_num_batched_tokens) one-token decodes; with CUDA graphs, the largest captured graph's
    activations (graph_shapes (P, n): P decode rows, n = 1 (with verify steps as decode rows, a
    verify step's B (k + 1)); P chunks of n tokens, n > 1: DeepSeek-V4's verify graphs,
    engine/cuda_graphs.py) are held in the graphs' own pool besides, so they count once more. With
    speculative decoding (k drafts) also a verify step: chunks of k + 1 tokens, logits and the
    acceptance's working copies at every position."""
    chunk = min(max_num_batched_tokens, max_model_len)
    full, rest = divmod(max_num_batched_tokens, chunk)
    prefill = [chunk] * full + ([rest] if rest else [])
    decode = min(max_num_seqs, max_num_batched_tokens)
    peaks = [_peak_of(model, specs, lens, block_size, dtype, device) for lens in (prefill, [1] * decode)]
    k = num_speculative_tokens
    if k:
        verify = min(max_num_seqs, max_num_batched_tokens // (k + 1))
        if verify:
            peaks.append(_peak_of(model, specs, [k + 1] * verify, block_size, dtype, device, every_row=True))
    held = 0
    for p, n in graph_shapes or []:
        graph = peaks[1] if (p, n) == (decode, 1) else _peak_of(model, specs, [n] * p, block_size, dtype, device)
        held = max(held, graph)
    return max(peaks) + held


def _peak_of(
    model: torch.nn.Module,
    specs: list[KVRegionSpec],
    lens: list[int],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    every_row: bool = False,
) -> int:
    """One dummy step of fresh sequences of `lens` tokens over a pool just big enough for it:
    the forward, the logits of each sequence's last token and their log-softmax (the sampler's).
    every_row: logits at every token and three more copies of them held at once (a verify
    step's: the processed logits, their padded copy and probabilities, spec_decode/verify.py)."""
    blocks = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks)
    has_window = any(s.space == WINDOW for s in specs)
    has_state = any(s.space == STATE for s in specs)
    cache = KVCache(
        specs,
        model.num_layers,
        num_blocks,
        block_size,
        dtype,
        device,
        num_blocks if has_window else 0,
        len(lens) if has_state else 0,
    )
    width, first = max(blocks), 0
    tables = []
    for b in blocks:
        tables.append(list(range(first, first + b)) + [0] * (width - b))
        first += b
    table = torch.tensor(tables, dtype=torch.int64)  # [B, W]
    step = StepInputs(
        input_ids=torch.zeros(sum(lens), dtype=torch.int64),
        lens=torch.tensor(lens, dtype=torch.int64),
        starts=torch.zeros(len(lens), dtype=torch.int64),
        samples=torch.ones(len(lens), dtype=torch.bool),
        block_tables=table,
        window_tables=table if has_window else torch.full_like(table, -1),
        state_slots=torch.arange(len(lens)) if has_state else torch.full((len(lens),), -1, dtype=torch.int64),
    )
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    batch = ForwardBatch.build(step, block_size)
    hidden = model.forward(batch.to(device), cache)  # [T, hidden]
    rows = torch.arange(len(step.input_ids)) if every_row else batch.logits_indices
    logits = model.compute_logits(hidden[rows.to(device)])  # [B, V] (every_row: [T, V])
    held = [logits.float().clone(), logits.float().clone(), logits.float().softmax(dim=-1)] if every_row else []
    torch.log_softmax(logits.float(), dim=-1)
    del hidden, logits, held
    if not cuda:
        return 0
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del cache
    torch.cuda.empty_cache()
    return max(peak, 0)
