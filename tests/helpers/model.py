"""A small paged-KV harness for model tests: sequences, block tables and ForwardBatch by hand.

Blocks come from a shuffled free list, so a sequence's block table is never the identity and
records of different sequences interleave in the pool, as they do in the engine.
"""

from __future__ import annotations

import torch

from pdserve.model.batch import ForwardBatch, StepInputs
from pdserve.model.deepseek_v3.model import DeepseekForCausalLM
from pdserve.model.kv_cache import KVCache


class Seq:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.blocks: list[int] = []


class PagedHarness:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        num_blocks: int = 64,
        block_size: int = 4,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model, self.block_size = model, block_size
        self.kv = KVCache(model.kv_cache_specs(), model.num_layers, num_blocks, block_size, dtype, "cpu")
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()

    def _slots(self, seq: Seq, upto: int) -> list[int]:
        while len(seq.blocks) * self.block_size < upto:
            seq.blocks.append(self.free.pop())
        bs = self.block_size
        return [seq.blocks[p // bs] * bs + p % bs for p in range(upto)]

    def step(self, work: list[tuple[Seq, list[int]]]) -> list[torch.Tensor]:
        """One forward over new tokens of several sequences (flat batch). Returns logits
        [len(new), V] per sequence, for every new token."""
        ids, starts = [], []
        for seq, new in work:
            starts.append(len(seq.tokens))
            self._slots(seq, len(seq.tokens) + len(new))
            ids += new
            seq.tokens += new
        B, nb = len(work), max(len(s.blocks) for s, _ in work)
        step = StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            lens=torch.tensor([len(new) for _, new in work], dtype=torch.int64),
            starts=torch.tensor(starts, dtype=torch.int64),
            samples=torch.ones(B, dtype=torch.bool),
            block_tables=torch.tensor([s.blocks + [0] * (nb - len(s.blocks)) for s, _ in work], dtype=torch.int64),
            window_tables=torch.full((B, nb), -1, dtype=torch.int64),
            state_slots=torch.full((B,), -1, dtype=torch.int64),
        )
        device = next(iter(self.kv.regions.values())).device
        batch = ForwardBatch.build(step, self.block_size).to(device)
        batch.logits_indices = torch.arange(len(ids), device=device)  # every new token's logits
        hidden = self.model(batch, self.kv)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return list(logits.split([len(new) for _, new in work]))

    def greedy(self, prompt: list[int], steps: int, chunk: int | None = None) -> tuple[list[int], torch.Tensor]:
        """Prefill `prompt` (in chunks of `chunk` tokens if given), then `steps` one-token decode
        steps of argmax. Returns (generated tokens, prompt logits [len(prompt), V])."""
        seq = Seq()
        chunk = chunk or len(prompt)
        prompt_logits = torch.cat([self.step([(seq, prompt[i : i + chunk])])[0] for i in range(0, len(prompt), chunk)])
        out = [int(prompt_logits[-1].argmax())]
        while len(out) < steps:
            out.append(int(self.step([(seq, [out[-1]])])[0][-1].argmax()))
        return out, prompt_logits
