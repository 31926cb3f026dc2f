"""DeepSeek-V4 served by the engine (float32, CPU): greedy tokens equal transformers' deepseek_v4
(the oracle) for a batch of prompts finishing at different times, with chunked prefill,
preemption and aborts; every paged cache kind (window, CSA / HCA entries, indexer keys,
compressor state) is block-accounted and described by the KV layout spec.

The tiny V4 checkpoint: window 8, CSA rate 4, HCA rate 16, top-4 indexer. Prompt lengths sit just
below, at and above multiples of 4, 8 and 16, and decode runs across those boundaries.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.disagg.layout import KVLayout
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v4.cache import kv_cache_specs as v4_kv_specs
from pdserve.model.deepseek_v4.config import CSA, HCA
from pdserve.model.kv_cache import KVCache, KVRegionSpec
from pdserve.tiny_model import make_tiny_model
from tests.helpers.v4 import NEW_TOKENS, PROMPT_LENS, engine, requests, run

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_v4_engine"), arch="deepseek_v4", seed=0)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, 800, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(tiny, prompts):
    """transformers' greedy tokens, each prompt alone."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    out = []
    for p, n in zip(prompts, NEW_TOKENS):
        ids = ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(ids[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(kv_block_size=4, max_num_batched_tokens=11),  # chunked prefill beside decodes; an HCA entry per 4 blocks
        dict(kv_block_size=16, num_kv_blocks=9, max_num_batched_tokens=24),  # preemption; one HCA entry a block
        dict(kv_block_size=32),  # HCA's rate divides the block: two entries a block
    ],
    ids=["bs4-chunked", "bs16-preempt", "bs32"],
)
def test_engine_greedy_matches_transformers(tiny, prompts, expected, kw):
    eng = engine(tiny, **kw)
    out = run(eng, requests(prompts))
    assert [out[str(i)].outputs[0].token_ids for i in range(len(prompts))] == expected
    stats = eng.get_stats()
    assert stats.kv_blocks_used == 0 and eng.block_manager.num_free_blocks == eng.num_kv_blocks
    assert stats.kv_window_blocks_used == 0 and stats.kv_window_blocks_total > 0
    assert stats.kv_state_slots_used == 0 and stats.kv_state_slots_total > 0
    if "num_kv_blocks" in kw:  # a pool too small for all: the youngest were preempted and recomputed
        assert stats.num_preemptions > 0


def test_aborts_return_every_block(tiny, prompts):
    eng = engine(tiny, kv_block_size=4, max_num_batched_tokens=9)
    for r in requests(prompts):
        eng.add_request(r)
    for step in range(12):
        eng.step()
        if step in (1, 4, 8):  # mid-prefill (chunks of 9 tokens) and mid-decode
            for rid in {1: ("9", "10"), 4: ("0", "5"), 8: ("3",)}[step]:
                eng.abort_request(rid)
        stats = eng.get_stats()
        assert stats.kv_blocks_used == sum(len(s.block_table) for s in eng.scheduler.running)
        assert stats.kv_window_blocks_used == sum(sum(b >= 0 for b in s.window_table) for s in eng.scheduler.running)
        assert stats.kv_state_slots_used == len(eng.scheduler.running)
    while eng.has_unfinished_requests():
        eng.step()
    stats = eng.get_stats()
    assert stats.kv_blocks_used == stats.kv_window_blocks_used == stats.kv_state_slots_used == 0


def test_window_blocks_are_freed_as_a_sequence_runs(tiny, prompts, expected):
    """The window region holds only the blocks of the last W-1 = 7 positions: between steps a
    sequence has at most ceil(7 / 4) + 1 = 3 window blocks (4 tokens each) however long it gets,
    while its token-space blocks (compressed entries) grow with it; the tokens stay the oracle's."""
    eng = engine(tiny, kv_block_size=4, max_num_batched_tokens=11)
    reqs = requests(prompts)
    for r in reqs:
        eng.add_request(r)
    most, longest = 0, 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        for s in eng.scheduler.running:
            held = [i for i, b in enumerate(s.window_table) if b >= 0]
            most, longest = max(most, len(held)), max(longest, len(s.block_table))
            if held:  # exactly the blocks of positions [n - 7, n)
                n = s.num_computed_tokens
                assert held == list(range(max(0, n - 7) // 4, -(-n // 4))), (s, s.window_table)
        for o in outs:
            if o.finished:
                assert o.outputs[0].token_ids == expected[int(o.request_id)]
    assert most == 3 and longest >= 8  # sequences of 30+ tokens, never more than 3 window blocks
    assert eng.get_stats().kv_window_blocks_used == 0


def test_layout_describes_every_cache_kind(tiny):
    eng = engine(tiny, kv_block_size=8, num_kv_blocks=10)
    layout = KVLayout.from_kv_cache(eng.kv_cache)
    regions = {r.name: r for r in layout.regions}
    cfg = eng.runner.model.config
    csa = [i for i, t in enumerate(cfg.v4.layer_types) if t == CSA]
    hca = [i for i, t in enumerate(cfg.v4.layer_types) if t == HCA]
    D, Di = cfg.v4.head_dim, cfg.index_head_dim
    want = {  # name: (layers, tokens per record, records per block of 8 tokens, values per record)
        "window": (list(range(5)), 1, 8, D),
        "csa_kv": (csa, 4, 2, D),
        "csa_index_k": (csa, 4, 2, Di),
        "csa_state": (csa, 0, 1, 2 * 3 * 2 * D + 2 * 4 * D),
        "csa_index_state": (csa, 0, 1, 2 * 3 * 2 * Di + 2 * 4 * Di),
        "hca_kv": (hca, 16, 1, D),
        "hca_state": (hca, 0, 1, 2 * 15 * D),
    }
    got = {n: (r.layers, r.tokens_per_record, r.records_per_block, r.dim) for n, r in regions.items()}
    assert got == want
    n_window = eng.block_manager.num_total_window_blocks  # 2 x max_num_seqs x (2 blocks read + 2 written)
    assert n_window == eng.kv_cache.num_window_blocks == 2 * eng.config.max_num_seqs * 4 == layout.num_window_blocks
    n_state = eng.block_manager.num_total_state_slots  # one per sequence: 2 x max_num_seqs
    assert n_state == eng.kv_cache.num_state_slots == 2 * eng.config.max_num_seqs == layout.num_state_slots
    assert layout.num_blocks == 10 and {r.name: r.space for r in layout.regions} == {
        "window": "window", "csa_kv": "tokens", "csa_index_k": "tokens", "hca_kv": "tokens",
        "csa_state": "state", "csa_index_state": "state", "hca_state": "state",
    }  # fmt: skip
    for r in layout.regions:
        n = {"window": n_window, "tokens": 10, "state": n_state}[r.space]
        assert r.record_bytes == r.dim * 4 and r.bytes == r.num_layers * n * r.records_per_block * r.record_bytes
        assert eng.kv_cache.regions[r.name].shape == (r.num_layers, n, r.records_per_block, r.dim)
    with pytest.raises(ValueError, match="tokens per record does not fit blocks of 12"):
        engine(tiny, kv_block_size=12)


def test_v4_flash_bytes_by_kind():
    """The numbers README's V4 section quotes: V4-Flash's released config, bf16, blocks of 128."""
    c = ModelConfig.from_dict({
        "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 43,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4], "qk_rope_head_dim": 64,
    })  # fmt: skip
    layout = KVLayout.from_kv_cache(
        KVCache(v4_kv_specs(c), 43, 1, 128, torch.bfloat16, "meta", num_window_blocks=1, num_state_slots=1)
    )
    per_block = {
        r.name: r.block_bytes * r.num_layers for r in layout.regions
    }  # a block (a slot for state) of all layers
    assert per_block == {
        "window": 5_636_096, "csa_kv": 688_128, "csa_index_k": 172_032, "csa_state": 430_080,
        "csa_index_state": 107_520, "hca_kv": 20_480, "hca_state": 5_201_920,
    }  # fmt: skip
    by_space = {
        s: sum(per_block[r.name] for r in layout.regions if r.space == s) for s in ("tokens", "window", "state")
    }
    # what grows with the sequence: 880,640 B per 128 tokens = 6,880 B/token; the window: at most two
    # blocks between steps (positions n-127..n-1); the compressors' state: once per sequence
    assert by_space == {"tokens": 880_640, "window": 5_636_096, "state": 5_739_520}
    assert [r.record_bytes for r in layout.regions] == [1024, 1024, 256, 20_480, 5_120, 1024, 260_096]
    for n, total in ((256, 13_136_896), (8192, 67_736_576), (65536, 462_263_296)):
        moved = layout.request_bytes(n)
        assert sum(moved.values()) == total
        assert moved["csa_kv"] + moved["csa_index_k"] + moved["hca_kv"] == n * (
            21 * 320 + 20 * 8
        )  # cache_bytes' 6,880 B/token
        assert (
            moved["window"] == 5_636_096
            and moved["hca_state"] + moved["csa_state"] + moved["csa_index_state"] == 5_739_520
        )


def test_record_ids_are_computed_on_the_block_tables_device():
    """The engine hands the model its block tables on the model's device (CUDA on a GPU): the
    record ids of V4's entries come out on that device, not from a CPU arange mixed into it (a
    table on the meta device stands in for CUDA here)."""
    kv = KVCache([KVRegionSpec("entries", 8, None, 4)], 1, 4, 8, torch.float32, "meta")
    table = torch.tensor([3, 1], dtype=torch.int64)
    assert kv.slots("entries", table, 0, 4).tolist() == [6, 7, 2, 3]  # 2 records a block of 8 tokens
    assert kv.slots("entries", table.to("meta"), 0, 4).device.type == "meta"
