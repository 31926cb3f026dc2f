"""A DeepSeek-V4 model driven over its own paged pool the way the engine drives it, for tests
that feed sequences by hand: each sequence gets fixed, shuffled token blocks and window blocks
(never freed) and a state slot; a step is StepInputs -> ForwardBatch -> forward, as in
engine/model_runner.py."""

from __future__ import annotations

import torch

from pdserve.model.batch import ForwardBatch, StepInputs
from pdserve.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdserve.model.kv_cache import KVCache


class PoolRunner:
    def __init__(
        self, model: DeepseekV4ForCausalLM, max_seqs: int = 16, max_len: int = 96, block_size: int = 8, seed: int = 0
    ) -> None:
        self.model = model
        p = model.lm_head.weight
        self.block_size, blocks = block_size, -(-max_len // block_size)
        g = torch.Generator().manual_seed(seed)
        self.tables = torch.randperm(max_seqs * blocks, generator=g).view(max_seqs, blocks)
        self.window_tables = torch.randperm(max_seqs * blocks, generator=g).view(max_seqs, blocks)
        self.kv = KVCache(
            self.model.kv_cache_specs(), model.num_layers, max_seqs * blocks, block_size, p.dtype, p.device,
            num_window_blocks=max_seqs * blocks, num_state_slots=max_seqs,
        )  # fmt: skip
        self.lengths: list[int] = []

    def new_sequence(self) -> int:
        self.lengths.append(0)
        return len(self.lengths) - 1

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, lens: list[int], seqs: list[int]) -> torch.Tensor:
        """input_ids [T]: lens[b] new tokens of sequence seqs[b], concatenated -> hidden [T, hidden]."""
        rows = torch.tensor(seqs)
        step = StepInputs(
            input_ids=input_ids, lens=torch.tensor(lens), starts=torch.tensor([self.lengths[s] for s in seqs]),
            samples=torch.ones(len(seqs), dtype=torch.bool), block_tables=self.tables[rows],
            window_tables=self.window_tables[rows], state_slots=rows,
        )  # fmt: skip
        hidden = self.model(ForwardBatch.build(step, self.block_size).to(self.kv.regions["window"].device), self.kv)
        for s, n in zip(seqs, lens):
            self.lengths[s] += n
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
