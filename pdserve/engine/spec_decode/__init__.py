"""Speculative decoding: drafts proposed after a step, verified in the next one.

- `config.py`: `SpeculativeConfig`, vLLM's `speculative_config` (method, num_speculative_tokens,
  prompt_lookup_min / max), validated; no torch.
- `ngram.py`: `NgramProposer`, prompt-lookup drafts from the sequence's own tokens; no torch.
- `rejection.py`: `accept_drafts`, greedy acceptance and the rejection sampling that keeps the
  target distribution exactly.
- `verify.py`: the runner's side of a verify step: which hidden rows give logits, and the
  tokens each sequence emits.
- `decoder.py`: `SpecDecoder`, the engine's side: which sequences may draft, drafts after each
  step, the counters.
- `mtp.py`: `MTPDrafter`, drafts of the checkpoint's MTP layer (a `StepProposer`).
- `mtp_handoff.py`: MTP through PD: the MTP layer's hidden state in the KV hand-off.
- `metrics.py`: `SpecDecodeStats`, drafts and accepted tokens (vLLM's metric names).
- `spare_states.py`: `SpareStates`, on a pool with per-sequence state (DeepSeek-V4): a verify
  chunk's new state in a spare slot, kept or dropped (with a recompute) after the acceptance.

A sequence with drafts is scheduled as one chunk of 1 + k tokens (its last token and the k
drafts, scheduler.py's `ScheduledSeq.num_spec`); the forward writes KV for all of them. The
tokens emitted are the accepted drafts and one more from the target; the KV of rejected drafts
lies past `num_computed_tokens` and is overwritten by the next step before any query reads it.
The compressor state a step replaces rather than extends goes to a spare slot (spare_states.py).
"""
