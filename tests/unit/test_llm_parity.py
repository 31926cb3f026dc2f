"""End-to-end parity of the offline LLM with transformers 5.24 (the oracle), float32 on CPU.

Tiny random DeepSeek-V3 and V3.2 models are made by transformers itself and saved with
save_pretrained (no tokenizer: skip_tokenizer_init). pdserve runs all prompts AS ONE BATCH with
different max_tokens (sequences finish at different steps), block size 4 and a 16-token step
budget (longer prompts are prefilled in chunks, sharing steps with decodes); transformers runs a
plain argmax continuation over the full sequence. Then: each prompt alone, and a KV pool so small
that sequences are preempted and recomputed. All must give the same tokens; the engine's raw
logprob of each chosen token must match transformers' log_softmax.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, initializer_range=0.08, max_position_embeddings=256, n_group=4, topk_group=2,
)  # fmt: skip
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
    beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8,
)  # fmt: skip
CONFIGS = {
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(rope_parameters=YARN)),
    # index_topk 8 < most contexts here, so the sparse path differs from dense attention
    "deepseek_v32": (
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
        dict(index_n_heads=16, index_head_dim=16, index_topk=8),
    ),
}
PROMPT_LENS = (1, 3, 6, 11, 17, 24, 33, 41)
MAX_TOKENS = (12, 4, 9, 1, 7, 10, 3, 6)


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    cfg_cls, model_cls, extra = CONFIGS[request.param]
    torch.manual_seed(0)
    ref = model_cls(cfg_cls(**{**BASE, **extra}, attn_implementation="eager")).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # transformers zero-initializes the routing bias: make it matter
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=g) * 0.2 - 0.1)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    expected = [_reference(ref, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    return str(path), prompts, expected


def _reference(ref, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Plain argmax continuation over the full sequence: (tokens, their log-probabilities)."""
    seq, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(ref(torch.tensor([seq])).logits[0, -1].float(), -1)
            seq.append(int(lp.argmax()))
            lps.append(lp[seq[-1]].item())
    return seq[len(prompt) :], lps


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in MAX_TOKENS]


def _check(outs, prompts, expected) -> None:
    for i, (out, prompt, (tokens, lps)) in enumerate(zip(outs, prompts, expected)):
        c = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert c.token_ids == tokens, f"prompt {i} (length {len(prompt)})"
        assert c.finish_reason == "length" and c.text == ""
        got = [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)]
        assert got == pytest.approx(lps, abs=1e-4), f"prompt {i}"


def test_one_batch_with_chunked_prefill_matches_transformers(checkpoint):
    path, prompts, expected = checkpoint
    llm = LLM(path, dtype="float32", kv_block_size=4, max_num_batched_tokens=16, skip_tokenizer_init=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params())
    _check(outs, prompts, expected)
    assert llm.engine.get_stats().kv_blocks_used == 0
    # the same prompts one at a time give identical results
    for i, p in enumerate(prompts):
        (alone,) = llm.generate(prompt_token_ids=[p], sampling_params=_params()[i])
        assert alone.outputs[0].token_ids == outs[i].outputs[0].token_ids
    assert llm.engine.get_stats().kv_blocks_used == 0


def test_preemption_under_a_small_kv_pool_matches_transformers(checkpoint):
    path, prompts, expected = checkpoint
    llm = LLM(
        path, dtype="float32", kv_block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, skip_tokenizer_init=True
    )
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params())
    _check(outs, prompts, expected)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0
