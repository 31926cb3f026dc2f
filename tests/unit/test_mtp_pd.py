"""MTP drafting through PD (engine/spec_decode/mtp_handoff.py), in-process FakeConnector, tiny V3,
V3.2 and V4 in float32. The prefill engine runs the MTP layer over the prompt (its records travel
with the other layers') and hands the layer's output at the prompt's last position to the decode
engine, which drafts from its first step. Oracles: a colocated engine without speculation for the
tokens, and a colocated engine with MTP for the drafts themselves (the decode side must verify the
very drafts a colocated engine verifies, step for step: a wrong hidden state or a missing MTP
record changes them). V3 and V3.2 for exactness, V3 alone for the other cases; V4 (its residual
streams in the hand-off, its MTP records one more layer of the window blocks that travel) for
exactness and forced-right drafts. 0 blocks used on both sides after every run; a pair where one side drafts with MTP and the other does not fails
the request with the reason, never with wrong tokens."""

from __future__ import annotations

import base64

import pytest

from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import FirstToken, Request
from pdserve.sampling_params import SamplingParams
from tests.unit.test_spec_decode import _prompts
from tests.unit.test_spec_pd import engine, generate

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = (8, 5, 7, 6)  # per prompt of _prompts: short, each case runs two or three engines


def requests(prompts, **kw) -> list[Request]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [
        Request(request_id=str(i), prompt_token_ids=p, params=q, **kw) for i, (p, q) in enumerate(zip(prompts, params))
    ]


def _mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def _made(tmp_path_factory, arch: str) -> tuple[str, dict[str, list[int]]]:
    from pdserve.tiny_model import make_tiny_model

    path = str(make_tiny_model(tmp_path_factory.mktemp(arch), arch))
    plain = {k: v.outputs[0].token_ids for k, v in generate(engine(path), requests(_prompts(0))).items()}
    return path, plain


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def tiny(request, tmp_path_factory):
    return _made(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """V3 alone for the cases beside exactness (the PD code is the same for both; CI time is not)."""
    return _made(tmp_path_factory, "deepseek_v3")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return _made(tmp_path_factory, "deepseek_v4")


def _pair(path: str, prefill_spec: dict | None, decode_spec: dict | None) -> tuple[LLMEngine, LLMEngine]:
    fabric = FakeFabric()
    pre, dec = (FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D"))
    spec = lambda s: {"speculative_config": s} if s else {}  # noqa: E731
    return engine(path, pre, **spec(prefill_spec)), engine(path, dec, **spec(decode_spec))


def _handoffs(prefill: LLMEngine, prompts) -> list[Request]:
    firsts = generate(prefill, requests(prompts, hold_kv=True))
    return [
        r.model_copy(update={"kv_handle": firsts[r.request_id].kv_handle,
                             "first_token": FirstToken(token_id=firsts[r.request_id].outputs[0].token_ids[0])})
        for r in requests(prompts)
    ]  # fmt: skip


def _record_drafts(eng: LLMEngine) -> dict[str, list[list[int]]]:
    """Each request's drafts as each of its verify chunks after the first token ran them (a
    colocated engine also drafts for a prompt's last token when a chunk leaves it alone)."""
    seen: dict[str, list[list[int]]] = {}
    begin = eng.spec.begin

    def recording(sched):
        for s in sched.scheduled:
            if s.num_spec and s.seq.num_output_tokens:
                seen.setdefault(s.seq.request_id, []).append(list(s.seq.spec_token_ids[: s.num_spec]))
        begin(sched)

    eng.spec.begin = recording
    return seen


def _free(*engines: LLMEngine) -> None:
    for e in engines:
        e.step()  # the prefill side's releases
        s = e.get_stats()  # V4: window blocks and state slots too
        assert s.kv_blocks_used == s.kv_window_blocks_used == s.kv_state_slots_used == 0 and not e.has_held_kv()


def _pd_equals_colocated(path: str, plain: dict[str, list[int]], k: int) -> tuple[list[Request], LLMEngine]:
    """Greedy tokens through the pair equal plain decoding's, and the decode side verifies the drafts
    a colocated MTP engine verifies; returns the hand-offs and the decode engine."""
    prompts = _prompts(0)
    colocated = engine(path, speculative_config=_mtp(k))
    want_drafts = _record_drafts(colocated)
    assert {r: o.outputs[0].token_ids for r, o in generate(colocated, requests(prompts)).items()} == plain
    prefill, decode = _pair(path, _mtp(k), _mtp(k))
    drafts = _record_drafts(decode)
    reqs = _handoffs(prefill, prompts)
    assert all(r.kv_handle.mtp_hidden for r in reqs)
    out = generate(decode, reqs)
    assert {r: o.outputs[0].token_ids for r, o in out.items()} == plain
    assert drafts == want_drafts and sum(map(len, drafts.values())) > 0
    _free(prefill, decode)
    return reqs, decode


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pd_with_mtp_equals_colocated_tokens_and_drafts(tiny, k):
    _pd_equals_colocated(*tiny, k)


def test_v4_pd_with_mtp_equals_colocated_tokens_and_drafts(v4):
    """k = 2: with k = 3 the colocated engine's verify chunk for a prompt's last token (a chunk left
    it alone, which PD never does) crosses a compressor group on rejection and is recomputed
    without drafts, so its next drafts start a position later than the decode worker's."""
    from pdserve.model.config import ModelConfig

    reqs, decode = _pd_equals_colocated(*v4, 2)
    config = ModelConfig.from_model_dir(v4[0])
    nbytes = config.v4.hc_mult * config.hidden_size * 4  # the streams [N, H], float32
    assert all(len(base64.b64decode(r.kv_handle.mtp_hidden)) == nbytes for r in reqs)
    one_row = base64.b64decode(reqs[0].kv_handle.mtp_hidden)[: config.hidden_size * 4]  # a V3-shaped g [H]
    handle = reqs[0].kv_handle.model_copy(update={"mtp_hidden": base64.b64encode(one_row).decode()})
    with pytest.raises(ValueError, match=f"holds {nbytes // 4} bytes; this model's MTP input row has {nbytes}"):
        decode.add_request(reqs[0].model_copy(update={"request_id": "x", "kv_handle": handle}))
    _free(decode)


@pytest.mark.parametrize("arch", ["v3", "v4"])
def test_forced_right_mtp_drafts_emit_k_plus_1_tokens_from_the_first_decode_step(request, arch):
    path, plain = request.getfixturevalue(arch)
    k, prompts = 3, _prompts(0)
    prefill, decode = _pair(path, _mtp(k), _mtp(k))
    want = {tuple(p): plain[str(i)] for i, p in enumerate(prompts)}
    spec, waiting, after = decode.spec, decode.spec.propose_waiting, decode.spec.propose

    def force(seqs):  # the MTP layer drafted (its drafts' count kept); the target's own tokens instead
        for seq in seqs:
            n = seq.num_output_tokens
            if seq.spec_token_ids:
                seq.spec_token_ids = want[tuple(seq.prompt_token_ids)][n : n + len(seq.spec_token_ids)]

    spec.propose_waiting = lambda w: (waiting(w := list(w)), force(w))
    spec.propose = lambda sched: (after(sched), force([s.seq for s in sched.scheduled]))
    for r in _handoffs(prefill, prompts):
        decode.add_request(r)
    outs = decode.step()  # the first decode step: the first token and k + 1 more (fewer where max_tokens ends it)
    assert {o.request_id: len(o.outputs[0].token_ids) for o in outs} == {
        r: min(k + 2, len(t)) for r, t in plain.items()
    }
    out = {o.request_id: o.outputs[0].token_ids for o in outs if o.finished}
    while decode.has_unfinished_requests():
        out.update({o.request_id: o.outputs[0].token_ids for o in decode.step() if o.finished})
    assert out == plain
    _free(prefill, decode)


@pytest.mark.parametrize("sides", [("mtp", None), (None, "mtp")])
def test_a_pair_where_one_side_drafts_with_mtp_fails_the_request_with_the_reason(v3, sides):
    path, _ = v3
    prefill, decode = _pair(path, *(_mtp(2) if s else None for s in sides))
    reqs = _handoffs(prefill, _prompts(0)[:1])
    with pytest.raises(ValueError, match="needs it on both the prefill and the decode workers"):
        decode.add_request(reqs[0])
    prefill.abort_request(reqs[0].request_id)
    _free(prefill, decode)


def test_abort_while_a_decode_request_speculates_with_mtp(v3):
    path, plain = v3
    prefill, decode = _pair(path, _mtp(2), _mtp(2))
    reqs = _handoffs(prefill, _prompts(0))
    for r in reqs:
        decode.add_request(r)
    decode.step()
    decode.step()
    decode.abort_request("0")
    out = {}
    while decode.has_unfinished_requests():
        out.update({o.request_id: o for o in decode.step() if o.finished})
    assert out["0"].outputs[0].finish_reason == "abort"
    assert {r: o.outputs[0].token_ids for r, o in out.items() if r != "0"} == {
        r: t for r, t in plain.items() if r != "0"
    }
    _free(prefill, decode)


@pytest.mark.parametrize("decode_spec", [_mtp(2), None])
def test_the_engine_to_engine_hand_off_carries_the_mtp_state_or_fails_saying_why(v3, decode_spec):
    """The router's path: decode waits (kv_from) for the hand-off prefill sends through its
    connector; with MTP on both sides the tokens are plain decoding's, with MTP on the prefill
    side alone the request fails at the hand-off with the reason, and no block stays used."""
    from pdserve.disagg.base import KVPeerRef, PeerMetadata

    path, plain = v3
    prefill, decode = _pair(path, _mtp(2), decode_spec)

    def peer(e):
        return PeerMetadata(engine_id=e.connector.engine_id, instance_id="i", data=e.connector.peer_metadata())

    prompts = _prompts(0)
    for r in requests(prompts):
        ref = {"engine_id": "P", "metadata_url": "inproc://"}
        decode.add_request(r.model_copy(update={"kv_from": KVPeerRef(**ref)}), peer(prefill))
        update = {"hold_kv": True, "kv_to": KVPeerRef(**{**ref, "engine_id": "D"})}
        prefill.add_request(r.model_copy(update=update), peer(decode))
    assert all(o.kv_handoff_sent for o in generate(prefill, []).values())
    out = generate(decode, [])
    if decode_spec is not None:
        assert {r: o.outputs[0].token_ids for r, o in out.items()} == plain and decode.spec.stats.num_drafts > 0
    else:
        assert all("ran with MTP drafts, this decode worker without" in o.error for o in out.values())
        for r in out:
            prefill.abort_request(r)  # the router's abort ends a lease no decode worker will read
    _free(prefill, decode)


def test_a_failed_load_recomputed_and_random_sampling_with_mtp_under_pd(v3):
    """A load that fails under kv_load_failure_policy recompute: the decode engine computes the
    prompt (and its MTP records) itself and drafts as a colocated engine, tokens as plain decoding's;
    then requests sampled at temperature 0.8 through the pair end at their max_tokens. 0 blocks."""
    from pdserve.disagg.base import TransferStage

    path, plain = v3
    prefill, decode = _pair(path, _mtp(2), _mtp(2))
    decode.remote_kv.policy = "recompute"
    reqs = _handoffs(prefill, _prompts(0))
    decode.connector.fail_next(TransferStage.READING, "injected")
    out = generate(decode, reqs)
    assert {r: o.outputs[0].token_ids for r, o in out.items()} == plain
    assert decode.remote_kv.num_kv_load_recomputes == 1
    hot = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    reqs = [r.model_copy(update={"request_id": f"t{r.request_id}", "params": hot}) for r in requests(_prompts(0))]
    firsts = generate(prefill, [r.model_copy(update={"hold_kv": True}) for r in reqs])
    handed = [
        r.model_copy(update={"kv_handle": firsts[r.request_id].kv_handle,
                             "first_token": FirstToken(token_id=firsts[r.request_id].outputs[0].token_ids[0])})
        for r in reqs
    ]  # fmt: skip
    out = generate(decode, handed)
    assert all(len(o.outputs[0].token_ids) == 6 for o in out.values()) and decode.spec.stats.num_drafts > 0
    _free(prefill, decode)
