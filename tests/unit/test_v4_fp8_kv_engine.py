"""`--kv-cache-dtype fp8` for DeepSeek-V4 in the engine (float32 compute on CPU): the K = V records
(window, CSA and HCA entries) are fp8_ds_v4 pages (kernels/kv_fp8.py), the indexer keys and the
compressors' state stay values. The oracle is the float32 engine whose K = V records are rounded
through the same format when made: the FP8 pool must compute exactly that (the attention reads
them gathered from both regions). How far FP8 itself moves tokens from transformers is a property
of the format, not asserted here."""

from __future__ import annotations

import pytest
import torch

from pdserve.disagg.layout import KVLayout
from pdserve.model import ops
from pdserve.tiny_model import make_tiny_model
from pdserve_kernels import kv_fp8
from tests.helpers.v4 import engine, pd_hand_off, requests, run

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_v4_fp8"), arch="deepseek_v4", seed=0)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, 800, (n,), generator=g).tolist() for n in (3, 8, 9, 17, 33, 40)]


def tokens(out: dict) -> dict[str, list[int]]:
    return {k: v.outputs[0].token_ids for k, v in out.items()}


def test_kv_records_are_fp8_pages_and_the_rest_values(tiny):
    eng = engine(tiny, kv_cache_dtype="fp8", num_kv_blocks=16)
    cfg = eng.runner.model.config
    size = ops.fp8_v4_record_bytes(cfg.v4.head_dim, cfg.qk_rope_head_dim)  # 48 e4m3 + 16 bf16 rope + 8 scale bytes
    regions = {r.name: r for r in KVLayout.from_kv_cache(eng.kv_cache).regions}
    for name in ("window", "csa_kv", "hca_kv"):
        assert (
            (regions[name].record, regions[name].record_bytes, regions[name].dtype)
            == ("fp8_ds_v4", size, "uint8")
            == ("fp8_ds_v4", 88, "uint8")
        )
    for name in ("csa_index_k", "csa_state", "csa_index_state", "hca_state"):
        assert (regions[name].record, regions[name].dtype) == ("values", "float32")


def test_fp8_kv_is_float32_kv_rounded_through_fp8(tiny, prompts, monkeypatch):
    """Chunked prefill beside decodes (blocks of 4: window gaps, entries across blocks): the FP8
    pool's greedy tokens == the float32 pool's with every K = V record rounded when made."""
    from pdserve.model.deepseek_v4 import attention as v4_attention
    from pdserve.model.deepseek_v4 import compressor as v4_compressor

    kw = dict(kv_block_size=4, max_num_batched_tokens=11)
    fp8 = tokens(run(engine(tiny, kv_cache_dtype="fp8", **kw), requests(prompts)))
    plain = tokens(run(engine(tiny, **kw), requests(prompts)))
    D, R = 64, 16

    def rounded(v: torch.Tensor) -> torch.Tensor:
        return kv_fp8.unpack_kv_fp8_v4(ops.pack_kv_fp8_v4(v, R), kv_fp8.V4Record(D, R)).to(v.dtype)

    make_kv, store = v4_attention.V4Attention._kv, v4_compressor.store_records
    monkeypatch.setattr(v4_attention.V4Attention, "_kv", lambda self, x, cos, sin: rounded(make_kv(self, x, cos, sin)))
    monkeypatch.setattr(
        v4_compressor,
        "store_records",
        lambda region, slots, v, rope: store(region, slots, rounded(v) if v.shape[1] == D else v, rope),
    )
    emulated = tokens(run(engine(tiny, **kw), requests(prompts)))
    assert fp8 == emulated
    assert plain != emulated  # the rounding is seen: the oracle is not the unrounded engine


def test_fp8_kv_pd_equals_fp8_colocated(tiny, prompts):
    colocated = tokens(run(engine(tiny, kv_cache_dtype="fp8"), requests(prompts)))
    final, prefill, decode, _ = pd_hand_off(tiny, prompts, dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="fp8"))
    final.pop("other")  # pd_hand_off's request that takes part of decode's pool first
    assert tokens(final) == colocated  # the records crossed as bytes
    assert decode.get_stats().kv_blocks_used == 0 and prefill.get_stats().kv_blocks_used == 0
