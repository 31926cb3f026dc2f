"""DeepSeek-V4 prefill -> decode in one process, through the fake connector (which copies what the
KV layout spec describes, region by region, as NIXL reads it): the decode side continues exactly
as the colocated engine does (tests/unit/test_v4_engine.py checks that one against transformers), with
whole and chunked prefill, onto other block ids; every block of both pools returns.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.disagg.factory import StagingOptions
from pdserve.tiny_model import make_tiny_model
from tests.helpers.v4 import PROMPT_LENS, engine, pd_hand_off, requests, run

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_v4_pd"), arch="deepseek_v4", seed=0)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(6)
    return [torch.randint(4, 800, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def colocated(tiny, prompts):
    out = run(engine(tiny, kv_block_size=8), requests(prompts))
    return [out[str(i)].outputs[0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("chunked,staged", [(False, False), (True, False), (True, True)])
def test_pd_hand_off_continues_exactly(tiny, prompts, colocated, chunked, staged):
    kw = dict(kv_block_size=4, max_num_batched_tokens=10) if chunked else {}
    staging = StagingOptions(mode="on", prefill_arena_mib=4, decode_arena_mib=4) if staged else None
    final, prefill, decode, conn = pd_hand_off(tiny, prompts, kw, dict(kw, num_kv_blocks=300), staging)
    assert [final[str(i)].outputs[0].token_ids for i in range(len(prompts))] == colocated
    if staged:  # every request moved as one slab; both arenas empty again
        assert conn.stats.staged == {("decode", "staged"): len(prompts)} and conn.stats.descriptors_sum == len(prompts)
        assert conn.landing_arena.used_bytes == 0 and prefill.connector.staging_arena.used_bytes == 0
    # what moved is what the layout says a later step reads: every entry and indexer key, the window's
    # last W-1 positions, the state in the first block; never the window blocks behind the window
    want = [conn.layout.request_bytes(len(p)) for p in prompts]
    assert conn.stats.bytes_transferred == sum(sum(w.values()) for w in want)
    win, W = conn.layout.regions[0], decode.runner.model.config.v4.sliding_window
    assert win.name == "window" and win.last_tokens == W - 1
    per_block = win.block_bytes * win.num_layers
    blocks = [-(-len(p) // win.block_size) for p in prompts]
    assert [w["window"] for w in want] == [
        (b - max(0, len(p) - W + 1) // win.block_size) * per_block for p, b in zip(prompts, blocks)
    ]
    assert sum(w["window"] for w in want) < sum(blocks) * per_block  # blocks behind the window stayed
    assert [w["hca_state"] for w in want] == [conn.kv.regions["hca_state"][:, 0].numel() * 4] * len(prompts)
    assert prefill.get_stats().kv_blocks_used == 0 and not prefill.has_held_kv()
    assert decode.get_stats().kv_blocks_used == 0
    assert prefill.get_stats().kv_window_blocks_used == 0 and decode.get_stats().kv_window_blocks_used == 0


def test_pd_refuses_another_block_size(tiny, prompts):
    final, *_ = pd_hand_off(tiny, prompts[:2], dict(kv_block_size=8), dict(kv_block_size=16))
    for out in (final["0"], final["1"]):
        assert out.outputs[0].finish_reason == "error" and out.transfer_error.stage == "HANDSHAKE"
