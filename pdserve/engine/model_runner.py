"""The only engine file that touches torch: loads the model, owns the KV cache, turns a
SchedulerOutput into one ForwardBatch, runs the model and samples.

Legend: T tokens in the step, C longest context in the step, N sequences that sample.
"""

from __future__ import annotations

import math

import torch

from pdserve.engine.config import DEFAULT_CPU_KV_GB, EngineConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.sampler import SampledToken, Sampler
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.model.batch import ForwardBatch


def _ids(v: int | list[int] | None) -> set[int]:
    return set() if v is None else {v} if isinstance(v, int) else set(v)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None) -> None:
        """model: an already-built model with the DeepseekForCausalLM interface (tests); by default
        the checkpoint in config.model is loaded."""
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self.dtype = getattr(torch, config.resolved_dtype())
        if model is None:
            from pdserve.model.loader import load_model

            model = load_model(config.model, self.dtype, self.device)
        self.model = model
        self.block_size = config.kv_block_size
        max_pos = model.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_pos:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {max_pos}")
        specs = model.kv_cache_specs()
        self.num_kv_blocks = self._num_kv_blocks(KVCache.bytes_per_block(specs, model.num_layers, self.block_size, self.dtype), config.max_model_len or max_pos)
        capacity = self.num_kv_blocks * self.block_size
        if config.max_model_len is not None and config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {config.max_model_len} needs {math.ceil(config.max_model_len / self.block_size)} KV blocks "
                f"but only {self.num_kv_blocks} fit; lower max_model_len or raise num_kv_blocks / kv_cache_memory_gb"
            )
        self.max_model_len = config.max_model_len or min(max_pos, capacity)
        self.kv_cache = KVCache(specs, model.num_layers, self.num_kv_blocks, self.block_size, self.dtype, self.device)
        self.eos_token_ids = set(model.config.eos_token_ids) | _ids(config.generation_config().get("eos_token_id"))
        self.sampler = Sampler(self.device, config.seed, sorted(self.eos_token_ids), config.logprobs_mode)

    def _num_kv_blocks(self, bytes_per_block: int, max_len: int) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory_gb is not None:
            budget = c.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = c.gpu_memory_utilization * total - (total - free)
        else:
            budget = DEFAULT_CPU_KV_GB * 2**30
        useful = c.max_num_seqs * math.ceil(max_len / self.block_size)  # more could never be used
        n = min(int(budget // bytes_per_block), useful)
        if n < 1:
            raise ValueError(f"no room for a single KV block ({bytes_per_block} bytes) in {budget / 2**30:.2f} GiB")
        return n

    # -- one step --
    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> list[SampledToken]:
        """Forward the scheduled tokens; returns one sampled token per sequence whose chunk
        reached its last token, in scheduled order."""
        batch, sampling = self.prepare(sched)
        hidden = self.model.forward(batch.to(self.device), self.kv_cache)  # [T, hidden]
        if not sampling:
            return []
        logits = self.model.compute_logits(hidden[batch.logits_indices.to(self.device)])  # [N, V]
        return self.sampler(logits, sampling)

    def prepare(self, sched: SchedulerOutput) -> tuple[ForwardBatch, list[Sequence]]:
        """One flat batch for the step, built with a few vectorized ops (no per-token Python)."""
        bs = self.block_size
        chunks = sched.scheduled
        B = len(chunks)
        lens = torch.tensor([s.num_tokens for s in chunks])  # [B]
        starts = torch.tensor([s.start for s in chunks])  # [B]
        width = max(len(s.seq.block_table) for s in chunks)
        tables = torch.tensor([s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in chunks])  # [B, W]
        seq_idx = torch.repeat_interleave(torch.arange(B), lens)  # [T]
        first_row = torch.cumsum(lens, 0) - lens  # [B] first flat row of each sequence
        positions = starts[seq_idx] + torch.arange(len(seq_idx)) - first_row[seq_idx]  # [T]
        C = int((starts + lens).max())
        col = torch.arange(C)  # [C]
        seq_slots = tables.gather(1, (col // bs).clamp(max=width - 1).expand(B, C)) * bs + col % bs  # [B, C]
        context = torch.where(col[None, :] <= positions[:, None], seq_slots[seq_idx], -1)  # [T, C] causal
        input_ids: list[int] = []
        for s in chunks:
            input_ids.extend(s.seq.tokens_between(s.start, s.start + s.num_tokens))
        sampling = [s.seq for s in chunks if s.samples]
        last_rows = first_row + lens - 1  # [B]
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=positions,
            slot_mapping=seq_slots[seq_idx, positions],
            context_slots=context.to(torch.int32),
            logits_indices=last_rows[torch.tensor([s.samples for s in chunks], dtype=torch.bool)],
        )
        return batch, sampling
