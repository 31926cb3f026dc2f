"""What an MTP engine drafted at each step, recorded for an oracle to recompute: both MTP oracle
tests (V3 / V3.2 against transformers' MtpModel, V4 against transformers' V4 pieces) run the
same engine harness and differ only in the oracle."""

from __future__ import annotations

import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.request import Request

Draft = tuple[list[int], list[int], torch.Tensor]  # (the tokens so far, the drafts, their MTP logits)


def record_drafts(path: str, prompt: list[int], max_tokens: int, k: int, forced: bool) -> list[Draft]:
    """Greedy generation with MTP drafts (k a step), recording every draft with the MTP logits
    that made it. forced: every draft replaced by the tokens plain decoding gives (all accepted),
    else kept as drafted (random weights: about all rejected). Asserts the run's own invariants:
    the tokens of plain decoding, nothing left in use, drafts accepted exactly when forced, drafting
    from the first decode step."""
    args = dict(dtype="float32", kv_block_size=4, max_num_batched_tokens=16, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    (plain,) = LLM(path, **args).generate(prompt_token_ids=[prompt], sampling_params=params)
    expected = plain.outputs[0].token_ids

    engine = LLM(path, **args, speculative_config={"method": "mtp", "num_speculative_tokens": k}).engine
    model = engine.runner.model
    calls: list[torch.Tensor] = []
    compute = model.compute_mtp_logits

    def recording(g):
        out = compute(g)
        calls.append(out.clone())
        return out

    model.compute_mtp_logits = recording
    seen: list[Draft] = []
    propose = engine.spec.propose

    def propose_and_force(sched):
        calls.clear()
        propose(sched)
        for s in sched.scheduled:
            seq = s.seq
            if seq.spec_token_ids:
                seen.append((seq.token_ids(), list(seq.spec_token_ids), torch.cat(calls)))
                n = seq.num_output_tokens
                if forced:
                    seq.spec_token_ids = expected[n : n + len(seq.spec_token_ids)]

    engine.spec.propose = propose_and_force
    engine.add_request(Request(request_id="r", prompt_token_ids=prompt, params=params))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    stats = engine.get_stats()
    assert out.outputs[0].token_ids == expected
    assert stats.kv_blocks_used == stats.kv_window_blocks_used == stats.kv_state_slots_used == 0
    spec = engine.spec.stats
    assert spec.num_draft_tokens > 0 and (spec.num_accepted_tokens == spec.num_draft_tokens) == forced
    assert len(seen) >= 3 and seen[0][0] == prompt + expected[:1]  # drafting from the first decode step
    assert any(len(d) == k for _, d, _ in seen)
    return seen
