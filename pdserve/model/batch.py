"""The batch metadata one forward pass needs, built once per step by the ModelRunner.

Tokens of all scheduled sequences (prefill chunks and decode tokens alike) are concatenated into
one flat batch of T tokens. Attention is always "sparse MLA over slot ids": each token attends to
the KV records at `context_slots[t]` (dense models) or to the top-k of them chosen by the DSA
indexer (DeepSeek-V3.2). A slot is `block_id * block_size + offset` in the paged pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, slot each token's KV record is written to
    context_slots: torch.Tensor  # [T, C] int32, slots of positions 0..pos (own included), -1 padded
    logits_indices: torch.Tensor  # [N] int64, rows of the hidden states to compute logits for

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> "ForwardBatch":
        return ForwardBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))
