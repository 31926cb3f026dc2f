"""Prefix-cache hits on DeepSeek-V4 (float32, CPU) give exactly the tokens of a cold prefill: against
transformers' deepseek_v4 (the oracle) and the same engine with the cache off. A hit restores the
window's last W-1 records and the compressors' state from a checkpoint at its last block
(engine/prefix_checkpoints.py).

The tiny V4 model: window 8, CSA rate 4, HCA rate 16; blocks of 16 (every rate divides them; with
blocks of 8 the HCA rate does not, and the cache stays off). Prompts share prefixes that end inside
a block, at a block boundary, repeat whole, and continue a conversation (the earlier prompt, its
answer, more): that hit ends at a checkpoint taken while decoding.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.engine.request import FirstToken, Request
from pdserve.tiny_model import make_tiny_model
from tests.helpers.v4 import engine, greedy, run

pytestmark = pytest.mark.timeout(300)

BS, NEW = 16, 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_v4_prefix"), arch="deepseek_v4", seed=0)


@pytest.fixture(scope="module")
def oracle(tiny):
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0

    known: dict[tuple[int, ...], list[int]] = {}

    def greedy_tokens(p: list[int]) -> list[int]:
        if tuple(p) not in known:
            ids = ref.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            known[tuple(p)] = ids[0, len(p) :].tolist()
        return known[tuple(p)]

    return greedy_tokens


def _one(eng, rid: str, prompt: list[int]):
    return run(eng, [Request(request_id=rid, prompt_token_ids=prompt, params=greedy(NEW))])[rid]


@pytest.mark.parametrize("budget", [256, 12])
def test_v4_hits_give_the_cold_tokens(tiny, oracle, budget):
    g = torch.Generator().manual_seed(11)
    p = torch.randint(4, 800, (60,), generator=g).tolist()
    t = [torch.randint(4, 800, (n,), generator=g).tolist() for n in (9, 5, 13, 7)]
    warm = engine(tiny, kv_block_size=BS, max_num_batched_tokens=budget)
    cold = engine(tiny, kv_block_size=BS, max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert warm.block_manager.checkpoints is not None and cold.block_manager.prefix_cache is None
    first = _one(warm, "first", p[:40])  # checkpoints at 32 (its prompt's last full block) and while decoding
    turn2 = p[:40] + first.outputs[0].token_ids + t[2]  # 73 tokens: a conversation's next turn
    prompts = [p[:20] + t[0], p[:20] + t[3], p[:32] + t[1], p[:40], turn2, p[:48]]
    outs = [_one(warm, str(i), q) for i, q in enumerate(prompts)]
    for i, (q, out) in enumerate(zip(prompts, outs)):
        tokens = out.outputs[0].token_ids
        assert tokens == oracle(q), f"prompt {i}"
        if budget == 12:  # the same engine, cache off (chunked the same way)
            assert tokens == _one(cold, str(i), q).outputs[0].token_ids, f"prompt {i}"
    # p[:20] + t0: 0 (block 0 is cached but no step ended at 16: its prefill ends a chunk there, the
    # junction); p[:20] + t3: 16, that checkpoint; p[:32] + t1: 32, at a boundary; p[:40] again: 32;
    # turn 2: 48, decode's checkpoint (64 is past the answer's end); p[:48]: 32 (47 // 16 = 2 blocks)
    assert [o.num_cached_tokens for o in outs] == [0, 16, 32, 32, 48, 32]
    stats = warm.get_stats()
    assert stats.kv_blocks_used == 0 and stats.kv_window_blocks_used == 0 and stats.kv_state_slots_used == 0


def test_v4_preemption_and_abort_with_shared_checkpoints(tiny, oracle):
    g = torch.Generator().manual_seed(12)
    p = torch.randint(4, 800, (40,), generator=g).tolist()
    prompts = [p[:33] + [5 + i] * (2 + i) for i in range(5)]
    eng = engine(tiny, kv_block_size=BS, num_kv_blocks=8, max_num_batched_tokens=40)
    _one(eng, "warm", p[:33])
    eng.add_request(Request(request_id="gone", prompt_token_ids=p[:33] + [9] * 4, params=greedy(3 * NEW)))
    for _ in range(3):
        eng.step()
    eng.abort_request("gone")  # aborted while it holds shared blocks and restored window / state
    outs = run(eng, [Request(request_id=str(i), prompt_token_ids=q, params=greedy(NEW)) for i, q in enumerate(prompts)])
    assert outs["gone"].outputs[0].finish_reason == "abort" and outs["gone"].num_cached_tokens == 32
    for i, q in enumerate(prompts):
        assert outs[str(i)].outputs[0].token_ids == oracle(q), f"prompt {i}"
    stats = eng.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.kv_blocks_used == 0 and stats.kv_window_blocks_used == 0 and stats.kv_state_slots_used == 0


def test_v4_blocks_that_the_hca_rate_does_not_divide_stay_uncached(tiny):
    eng = engine(tiny, kv_block_size=8)
    assert eng.block_manager.prefix_cache is None and eng.runner.num_checkpoints == 0


def test_v4_pd_hand_off_after_a_prefill_hit(tiny):
    """A prefill worker whose prompt hit its cache (entries shared, window and state restored from a
    checkpoint) hands the KV to a decode worker, which continues as a cold colocated engine does."""
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D")]
    prefill = engine(tiny, conns[0], kv_block_size=BS)
    decode = engine(tiny, conns[1], kv_block_size=BS)
    g = torch.Generator().manual_seed(13)
    p = torch.randint(4, 800, (45,), generator=g).tolist()
    _one(prefill, "warm", p[:40])
    first = run(prefill, [Request(request_id="a", prompt_token_ids=p, params=greedy(NEW), hold_kv=True)])["a"]
    assert first.num_cached_tokens == 32 and prefill.has_held_kv()
    handoff = Request(
        request_id="a",
        prompt_token_ids=p,
        params=greedy(NEW),
        kv_handle=first.kv_handle,
        first_token=FirstToken(token_id=first.outputs[0].token_ids[0]),
    )
    final = run(decode, [handoff])["a"]
    prefill.step()  # takes the release
    cold = _one(engine(tiny, kv_block_size=BS, enable_prefix_caching=False), "a", p)
    assert final.outputs[0].token_ids == cold.outputs[0].token_ids
    for e in (prefill, decode):
        s = e.get_stats()
        assert s.kv_blocks_used == 0 and s.kv_window_blocks_used == 0 and s.kv_state_slots_used == 0
    assert not prefill.has_held_kv()
