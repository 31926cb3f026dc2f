"""Speculation on a pool with per-sequence state (DeepSeek-V4's compressors): rejected drafts
leave no trace in it. No torch.

A verify chunk [last token, d_1 .. d_k] computes positions n .. n + k and the step accepts a
drafts: the sequence's computed tokens end at n_acc = n + 1 + a, where the forward went on to
n_end = n + k + 1. Token-space records (entries, indexer keys) and window records past n_acc are
overwritten by a later step before any query reads them, as V3's latent records are. The state
record is the one thing a step both reads and replaces, so a verify chunk reads its sequence's
record and writes the new one (the state at n_end) into a spare slot (`ScheduledSeq.state_dst`,
the compressors' `dst`); the record it read stays as it was. After the acceptance:

- n_acc and n_end in the same group of every compressor rate m (n_acc // m == n_end // m, every
  draft accepted included): the state at n_end is the state at n_acc. Its pending rows of
  positions before n_acc are the accepted tokens' own, those past n_acc are never read (a step
  reads the pending rows of the positions before its start only), and the last complete group,
  whose Ca the overlap keeps, is the same. The sequence keeps the spare slot; its old one is freed.
- otherwise a rejected position opened a new group, whose state cannot be taken back to n_acc: the
  sequence keeps its old record (the state at n) and its computed tokens go back to n, so the next
  step recomputes the accepted tokens (one chunk of a + 2 tokens, without drafts). The spare
  slot is freed.

Rates: the tokens per record of the pool's compressed regions (`KVRegionSpec.tokens_per_record`
> 1), the groups the state's pending rows belong to. With no spare slot free a verify chunk loses
its drafts for the step (it decodes one token).
"""

from __future__ import annotations

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput


class SpareStates:
    def __init__(self, blocks: BlockManager, rates: set[int]) -> None:
        self.blocks, self.rates = blocks, sorted(rates)
        self.num_kept = 0  # rejections after which the sequence kept its new state
        self.num_recomputes = 0  # rejections that sent a sequence back to recompute its accepted tokens

    def begin(self, sched: SchedulerOutput) -> None:
        """Before the forward: a spare slot for every verify chunk of a sequence with state."""
        for s in sched.scheduled:
            if not s.num_spec or s.seq.state_slot < 0:
                continue
            spare = self.blocks.take_spare_state()
            if spare is None:  # no room for its new state: no drafts this step
                s.num_tokens, s.num_spec, s.seq.spec_token_ids = s.num_tokens - s.num_spec, 0, []
            else:
                s.state_dst = spare

    def settle(self, s: ScheduledSeq) -> None:
        """After the acceptance (seq.num_computed_tokens = n_acc): which state the sequence keeps."""
        if s.state_dst < 0:
            return
        seq, n_end = s.seq, s.start + s.num_tokens
        if all(seq.num_computed_tokens // m == n_end // m for m in self.rates):
            self.blocks.give_back_state(seq.state_slot, seq.request_id)
            seq.state_slot = s.state_dst
            self.num_kept += seq.num_computed_tokens < n_end
        else:
            self.blocks.give_back_state(s.state_dst, seq.request_id)
            seq.num_computed_tokens = s.start
            self.num_recomputes += 1
        s.state_dst = -1
