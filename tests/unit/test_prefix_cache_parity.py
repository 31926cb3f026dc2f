"""Prefix-cache hits give exactly the tokens of a cold prefill, DeepSeek-V3 and V3.2 (latent records,
and V3.2's indexer keys), float32 on CPU, against transformers 5.24's greedy continuation (the
oracle) and against the same engine with --no-enable-prefix-caching.

Block size 4: prompts share prefixes that end inside a block (10 tokens), at a block boundary (12),
and repeat whole; with chunked prefill (an 8-token step budget) and with a pool so small that
sequences holding shared cached blocks are preempted and cached blocks are evicted while others run.
"""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.unit.test_llm_parity import BASE, CONFIGS, _reference

pytestmark = pytest.mark.timeout(600)

BS = 4
NEW = 6


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    cfg_cls, model_cls, extra = CONFIGS[request.param]
    torch.manual_seed(0)
    ref = model_cls(cfg_cls(**{**BASE, **extra}, attn_implementation="eager")).eval()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    g = torch.Generator().manual_seed(7)
    p = torch.randint(2, 256, (30,), generator=g).tolist()
    tails = [torch.randint(2, 256, (n,), generator=g).tolist() for n in (5, 3, 9, 14)]
    prompts = [
        p[:10] + tails[0],  # 15 tokens
        p[:10] + tails[1],  # shares 10: a hit of 2 blocks, the prefix ends inside block 2
        p[:12] + tails[2],  # shares 12 with p: 3 blocks, at a block boundary
        p[:12] + tails[3],  # the same 12 again, with a longer tail (chunked)
        p[:16],  # whole blocks: the hit stops one block short (its last token is computed)
        p[:16],  # the same prompt again
        p[:12] + tails[2],  # a repeat of prompt 2
    ]
    expected = [_reference(ref, q, NEW)[0] for q in prompts]
    return str(path), prompts, expected


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", kv_block_size=BS, skip_tokenizer_init=True, **kw)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def _one_by_one(llm: LLM, prompts: list[list[int]]) -> list:
    return [llm.generate(prompt_token_ids=[p], sampling_params=_greedy())[0] for p in prompts]


@pytest.mark.parametrize("budget", [64, 8])
def test_hits_give_the_cold_tokens(checkpoint, budget):
    path, prompts, expected = checkpoint
    warm = _llm(path, max_num_batched_tokens=budget)
    cold = _llm(path, max_num_batched_tokens=budget, enable_prefix_caching=False)
    outs = _one_by_one(warm, prompts)
    colds = _one_by_one(cold, prompts)
    for i, (out, c, exp) in enumerate(zip(outs, colds, expected)):
        assert out.outputs[0].token_ids == exp == c.outputs[0].token_ids, f"prompt {i}"
    cached = [o.num_cached_tokens for o in outs]
    # p[:12]+t2 finds p[:8] from prompt 0; p[:16] finds p[:12] (prompt 2); its repeat its own 12
    assert cached == [0, 8, 8, 12, 12, 12, 20]
    assert [c.num_cached_tokens for c in colds] == [None] * len(prompts)
    stats = warm.engine.get_stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached > 0
    pc = warm.engine.block_manager.prefix_cache
    assert (pc.queries, pc.hits) == (sum(len(p) for p in prompts), sum(cached))


def test_preemption_and_eviction_with_shared_blocks(checkpoint):
    """All prompts at once in a 14-block pool: sequences that share cached blocks are preempted
    and recompute, cached blocks are evicted for others, and every token stays the oracle's."""
    path, prompts, expected = checkpoint
    llm = _llm(path, num_kv_blocks=14, max_num_batched_tokens=16)
    _one_by_one(llm, prompts[:1])  # prompt 0's blocks cached before the batch
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_greedy())
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i}"
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached <= stats.kv_blocks_total
    # a pool full of cached blocks still serves a new prompt that needs all of it
    fresh = list(range(200, 200 + 14 * BS - NEW))
    (out,) = llm.generate(prompt_token_ids=[fresh], sampling_params=_greedy())
    assert out.num_cached_tokens == 0 and llm.engine.get_stats().kv_blocks_used == 0
