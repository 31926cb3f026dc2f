"""`--kv-cache-dtype fp8` in the engine (DeepSeek-V3 / V3.2, float32 compute on CPU): the latent is
stored as 656-byte FP8 records (512 e4m3 + 4 fp32 scales + 64 bf16 rope), read by the decode path
(dequantized rows), the expanded prefill and the PD transfer. The oracle here is the float32
engine whose records are rounded through the same FP8 format: the FP8 pool must compute exactly
that. (How far FP8 rounding itself moves tokens from transformers is a property of the format,
measured on a GPU by scripts/gpu_engine_check.py, not asserted here.)"""

from __future__ import annotations

import pytest
import torch

from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.disagg.layout import KVLayout
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import FirstToken, Request
from pdserve.sampling_params import SamplingParams
from pdserve.tiny_model import make_tiny_model

NEW = 16


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def tiny(request, tmp_path_factory):
    # kv_lora_rank 128: one scale group (the tiny default, 64, is refused: see the last test)
    return str(
        make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=0, overrides={"kv_lora_rank": 128})
    )


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, 250, (n,), generator=g).tolist() for n in (4, 11, 23, 40, 7, 30)]


def engine(tiny: str, connector=None, **kw) -> LLMEngine:
    cfg = dict(
        model=tiny,
        dtype="float32",
        kv_block_size=8,
        num_kv_blocks=64,
        skip_tokenizer_init=True,
        max_num_batched_tokens=16,
    )
    return LLMEngine(EngineConfig(**{**cfg, **kw}), connector)


def generate(eng: LLMEngine, reqs: list[Request]) -> dict[str, object]:
    for r in reqs:
        eng.add_request(r)
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o
    return out


def requests(hold_kv: bool = False) -> list[Request]:
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return [
        Request(request_id=str(i), prompt_token_ids=p, params=params, hold_kv=hold_kv) for i, p in enumerate(prompts())
    ]


def test_fp8_records_in_the_pool_and_layout(tiny):
    eng = engine(tiny, kv_cache_dtype="fp8")
    latent = eng.kv_cache.regions["latent"]
    rope = eng.runner.model.config.qk_rope_head_dim
    size = 128 + 4 + 2 * rope  # e4m3 latent | one fp32 scale | bf16 rope
    assert latent.dtype == torch.uint8 and latent.shape[-1] == size and latent.shape[2] == 8
    region = next(r for r in KVLayout.from_kv_cache(eng.kv_cache).regions if r.name == "latent")
    assert (region.record, region.record_bytes, region.dtype) == ("fp8_ds_mla", size, "uint8")


def test_fp8_kv_needs_whole_scale_groups(tmp_path):
    path = make_tiny_model(tmp_path, "deepseek_v3", seed=0)  # kv_lora_rank 64
    with pytest.raises(ValueError, match="multiple of 128"):
        engine(str(path), kv_cache_dtype="fp8")


def test_fp8_kv_is_float32_kv_rounded_through_fp8(tiny, monkeypatch):
    """The FP8 pool computes exactly what a float32 pool does when every record written is rounded
    through the FP8 format first: the records, the decode path's dequantized rows and the
    expanded prefill's all agree (same greedy tokens, logits within float32 reordering)."""
    from pdserve.model import ops
    from pdserve.model.deepseek_v3.attention import MLA

    fp8 = generate(engine(tiny, kv_cache_dtype="fp8"), requests())
    project = MLA._project

    def rounded(self, x, cos, sin, slot_mapping, kv_cache):
        q_nope, q_pe, q_resid, kv = project(self, x, cos, sin, slot_mapping, kv_cache)
        C = self.kv_lora_rank
        kv[slot_mapping] = ops.unpack_kv_fp8(ops.pack_kv_fp8(kv[slot_mapping], C), C, kv.shape[1]).to(kv.dtype)
        return q_nope, q_pe, q_resid, kv

    monkeypatch.setattr(MLA, "_project", rounded)
    emulated = generate(engine(tiny), requests())
    assert {k: v.outputs[0].token_ids for k, v in fp8.items()} == {
        k: v.outputs[0].token_ids for k, v in emulated.items()
    }


def test_fp8_kv_pd_equals_fp8_colocated_and_refuses_bf16_peers(tiny):
    colocated = generate(engine(tiny, kv_cache_dtype="fp8"), requests())
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D", "D16")]
    prefill = engine(tiny, conns[0], kv_cache_dtype="fp8")
    firsts = generate(prefill, requests(hold_kv=True))
    for name, conn, kv_dtype in (("fp8", conns[1], "fp8"), ("bf16", conns[2], "auto")):
        decode = engine(tiny, conn, kv_cache_dtype=kv_dtype)
        handoff = [
            Request(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, params=r.params,
                    kv_handle=firsts[r.request_id].kv_handle, first_token=FirstToken(token_id=firsts[r.request_id].outputs[0].token_ids[0]))
            for r in requests()
        ]  # fmt: skip
        final = generate(decode, handoff if name == "fp8" else handoff[:1])
        if name == "fp8":  # the FP8 records crossed as bytes: decode continues exactly as colocated
            assert {k: v.outputs[0].token_ids for k, v in final.items()} == {
                k: v.outputs[0].token_ids for k, v in colocated.items()
            }
        else:  # a bf16 pool cannot read FP8 records: refused by the compatibility hash
            assert final["0"].transfer_error is not None and final["0"].transfer_error.stage == "HANDSHAKE"
        assert decode.get_stats().kv_blocks_used == 0
