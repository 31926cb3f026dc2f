"""MTP drafts: DeepSeek's multi-token-prediction layer (model/deepseek_v3/mtp.py) run after each
step, over what the step computed and kept, then chained into the next step's drafts.

After a step (its tokens sampled, accepted drafts appended), a sequence the step ran has its KV
computed for positions [start, m) (m = num_computed_tokens: rejected drafts excluded) and knows
its tokens up to t_m. The pass: the MTP layer over rows i in [start, m), each the target's hidden
state h_i with the token t_{i+1}, at position i; it writes the MTP layer's KV record of each
position (one more layer of the paged pool) and gives g_i. A sequence that drafts next takes
d_1 = argmax(head(g_{m-1})), then chains: row (g, d_{j-1}) at position m + j - 2 gives d_j, up to
its limit. So every position below m holds the record of its true pair once the step ends, and
the chain's records past m - 1 are rewritten by a later pass before any query reads them: a
rejected draft leaves nothing that changes a later token (and verification keeps the target's
tokens whatever the drafts are).

DeepSeek-V4 (model/deepseek_v4/mtp.py) pairs the token with the step's residual streams before
hc_head (`model.mtp_source`, [N, H] a row) and chains them; its layer is a sliding-window one, so
its records are one more layer of the window region: the chain's window blocks come with the
table's growth below, and it has no compressor state for a rejected draft to touch.

Drafts are greedy (one-hot q for rejection sampling: `rejection.py`), as vLLM's MTP drafts are.
The chain writes records up to position m + k - 2: the sequence's table is grown to cover them
when blocks are free (the next verify chunk needs those blocks anyway), else its drafts stop
where the table ends. Prefill chunks run the pass too, so drafting starts at the first decode
step; under PD the prefill worker's pass gives the hand-off its g (mtp_handoff.py) and the decode
worker chains from it (`propose_loaded`). Sequences with a grammar never draft and skip the pass.
The layer runs on every TP rank (`ModelRunner.run_mtp`).

Legend: P rows of the pass, D sequences that draft, H hidden size (V4: N streams of H a row).
"""

from __future__ import annotations

import torch

from pdserve.engine import step_tables
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec_decode import mtp_handoff
from pdserve.model.batch import StepInputs

# the pass runs over these: decoding sequences, and a PD prefill's finished ones (their hand-off)
_PASSED = (SequenceStatus.RUNNING, SequenceStatus.FINISHED_REMOTE_DECODE)


class MTPDrafter:
    """The `StepProposer` of method "mtp" (decoder.py): needs the runner's step hidden states."""

    def __init__(self, runner, block_manager: BlockManager) -> None:
        model = runner.model
        if getattr(model, "mtp", None) is None:
            raise ValueError("speculative method 'mtp' needs a model loaded with its MTP layer")
        self.runner, self.model, self.bm = runner, model, block_manager
        runner.keep_hidden = True  # the pass reads the step's hidden states

    @torch.inference_mode()
    def propose_step(self, sched: SchedulerOutput, wanted: list[tuple[Sequence, int]]) -> None:
        """The pass over the step's kept positions, then drafts for `wanted` (sequence, limit; their
        spec_token_ids start empty)."""
        last = self._pass(sched)  # seq id -> g_{m-1} [H]
        for s in sched.scheduled:  # PD prefill: g travels in the hand-off (mtp_handoff.py)
            if s.seq.status is SequenceStatus.FINISHED_REMOTE_DECODE and id(s.seq) in last:
                s.seq.mtp_hidden = mtp_handoff.encode(last[id(s.seq)])
        drafting = [(seq, self._room(seq, limit)) for seq, limit in wanted if id(seq) in last]
        if drafting:
            self._chain(drafting, torch.stack([last[id(seq)] for seq, _ in drafting]))  # [D, H]

    @torch.inference_mode()
    def propose_loaded(self, wanted: list[tuple[Sequence, int]]) -> None:
        """PD decode: drafts for sequences whose KV arrived, from the g their hand-off carries."""
        if wanted:
            dtype, device, shape = self.runner.dtype, self.runner.device, mtp_handoff.row_shape(self.model)
            g = [mtp_handoff.decode(seq.kv_handle.mtp_hidden, dtype, device, shape) for seq, _ in wanted]
            g = torch.stack(g)  # [D, H] (V4: [D, N, H])
            self._chain([(seq, self._room(seq, limit)) for seq, limit in wanted], g)

    def _chain(self, drafting: list[tuple[Sequence, int]], g: torch.Tensor) -> None:
        """d_1 from each g_{m-1} [D, H] (V4: [D, N, H]), then row (g, d_{j-1}) at position m + j - 2 gives d_j."""
        tokens = self.model.compute_mtp_logits(g).argmax(dim=-1)  # [D] d_1
        for j in range(1, max(n for _, n in drafting) + 1):
            ids = tokens.tolist()
            for (seq, _), t in zip(drafting, ids):
                seq.spec_token_ids.append(t)
            keep = [i for i, (_, n) in enumerate(drafting) if n > j]
            if not keep:
                return
            drafting = [drafting[i] for i in keep]
            g, prev = g[keep], tokens[keep]
            starts = [seq.num_computed_tokens + j - 1 for seq, _ in drafting]  # position of d_j's row
            step = self._inputs([seq for seq, _ in drafting], prev.cpu(), starts, [1] * len(drafting))
            g = self._forward(step, g)
            tokens = self.model.compute_mtp_logits(g).argmax(dim=-1)

    def _pass(self, sched: SchedulerOutput) -> dict[int, torch.Tensor]:
        """The MTP layer over each sequence's rows this step kept; returns g at each one's last."""
        hidden = self.runner.last_hidden  # [T, H] the step's target hidden states
        source = getattr(self.model, "mtp_source", None)
        hidden = hidden if source is None else source(hidden)  # V4: [T, N, H] its streams
        seqs, starts, lens, rows, row = [], [], [], [], 0
        for s in sched.scheduled:
            seq, n = s.seq, s.seq.num_computed_tokens - s.start
            if seq.status in _PASSED and n > 0:
                seqs.append(seq)
                starts.append(s.start)
                lens.append(n)
                rows.append(torch.arange(row, row + n))
            row += s.num_tokens
        if not seqs:
            return {}
        ids = torch.tensor([t for seq, a, n in zip(seqs, starts, lens) for t in seq.tokens_between(a + 1, a + n + 1)])
        step = self._inputs(seqs, ids, starts, lens)
        prev = hidden[torch.cat(rows).to(hidden.device)]  # [P, H]
        g = self._forward(step, prev)  # [P, H]
        ends = torch.cumsum(torch.tensor(lens), 0) - 1
        return {id(seq): g[int(e)] for seq, e in zip(seqs, ends)}

    def _forward(self, step: StepInputs, prev: torch.Tensor) -> torch.Tensor:
        return self.runner.run_mtp(step, prev)

    def _inputs(self, seqs: list[Sequence], ids: torch.Tensor, starts: list[int], lens: list[int]) -> StepInputs:
        width = max(len(seq.block_table) for seq in seqs)
        windows = step_tables.window_rows(seqs, starts, width, self.bm.window_tokens, self.bm.block_size)
        return StepInputs(
            input_ids=ids.to(torch.int64),
            lens=torch.tensor(lens, dtype=torch.int64),
            starts=torch.tensor(starts, dtype=torch.int64),
            samples=torch.ones(len(seqs), dtype=torch.bool),
            block_tables=torch.from_numpy(step_tables.block_rows(seqs, width)),
            window_tables=torch.from_numpy(windows),
            state_slots=torch.full((len(seqs),), -1, dtype=torch.int64),
        )

    def _room(self, seq: Sequence, limit: int) -> int:
        """Drafts whose chain records fit seq's table (grown when blocks are free): d_j's row
        writes position m + j - 2, so k drafts need the table to cover m + k - 1 tokens (and,
        with a window space, the window table: V4)."""
        need, bm = seq.num_computed_tokens + limit - 1, self.bm
        if bm.can_allocate(seq, need):
            bm.allocate(seq, need)
        covered = len(seq.block_table) * bm.block_size
        if bm.window_tokens is not None:
            covered = min(covered, len(seq.window_table) * bm.block_size)
        return max(1, min(limit, covered - seq.num_computed_tokens + 1))
