"""What a Request must satisfy before the engine takes it: checked in the caller's thread
(LLMEngine.add_request), so bad input raises ValueError there and leaves nothing behind."""

from __future__ import annotations

from pdserve.engine.remote_kv import RemoteKV, handoff_problem
from pdserve.engine.request import Request


def check_request(req: Request, max_model_len: int, vocab: int, detokenizes: bool, remote_kv: RemoteKV | None) -> None:
    """ValueError naming the first problem. detokenizes: the engine has a tokenizer; remote_kv:
    its PD side (None without a KV connector)."""
    n = len(req.prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if n >= max_model_len:
        raise ValueError(
            f"prompt has {n} tokens; max_model_len is {max_model_len} (room for at least one output token is needed)"
        )
    resumed = req.resume.token_ids if req.resume is not None else []
    if any(not 0 <= t < vocab for t in req.prompt_token_ids + resumed):
        raise ValueError(f"prompt and resumed token ids must lie in [0, {vocab})")
    if n + len(resumed) >= max_model_len:
        raise ValueError(
            f"prompt + resumed output ({n + len(resumed)} tokens) leave no room under max_model_len {max_model_len}"
        )
    if any(not 0 <= t < vocab for t in req.params.logit_bias or ()):
        raise ValueError(f"logit_bias token ids must lie in [0, {vocab})")
    if req.params.stop and not (detokenizes and req.params.detokenize):
        raise ValueError("stop strings need detokenization (a tokenizer, and detokenize=True)")
    if req.hold_kv and req.params.num_seqs > 1 and n < 2:  # forks.py: prefill hands off all but the last token
        raise ValueError("n > 1 under PD needs a prompt of at least 2 tokens (prefill computes all but the last)")
    if req.role != "colocated" and remote_kv is None:
        raise ValueError("hold_kv / kv_handle / kv_from need an engine with a KV connector")
    if req.kv_handle is not None:
        problem = handoff_problem(req, req.kv_handle, req.first_token, vocab, remote_kv.mtp_bytes)
        if problem is not None:
            raise ValueError(problem)
