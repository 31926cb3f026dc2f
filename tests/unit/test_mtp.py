"""MTP drafting through the engine (engine/spec_decode/mtp.py), tiny V3, V3.2 and V4 in float32.

The oracle for the tokens is the same engine without speculation (itself checked against
transformers in test_llm_parity.py); the drafts themselves are checked against transformers' MTP in
test_mtp_oracle.py and test_mtp_v4_oracle.py. Greedy with MTP drafts must give the same tokens, token for token, for
k = 1..3 with chunked prefill (a 16-token step budget; the prompts are longer), with preemption in
the middle of speculation and with aborts, leaving 0 blocks used (V4: 0 window blocks and state
slots too). Random tiny weights make MTP
drafts all but always wrong, so one test replaces each step's drafts by the target's own
continuation after the MTP layer ran: every draft is accepted, each verify step emits k + 1 tokens,
and the next pass covers k + 1 positions. Last, the start-up refusals.
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = (10, 7)
PROMPTS = [[(5 * i + 11) % 300 + 2 for i in range(21)], [9, 8, 7] * 6]


def _spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def _llm(path: str, k: int | None = None, **kw) -> LLM:
    args = dict(dtype="float32", kv_block_size=4, max_num_batched_tokens=16, skip_tokenizer_init=True)
    return LLM(path, **{**args, **kw}, **({"speculative_config": _spec(k)} if k else {}))


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def _tokens(llm: LLM, params=None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params or _params())]


def _made(tmp_path_factory, arch: str) -> tuple[str, list[list[int]]]:
    path = str(make_tiny_model(tmp_path_factory.mktemp(arch), arch))
    return path, _tokens(_llm(path))


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32", "deepseek_v4"])
def model(request, tmp_path_factory):
    return _made(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """V3 alone for the cases whose MTP code is V3.2's too (CI time)."""
    return _made(tmp_path_factory, "deepseek_v3")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return _made(tmp_path_factory, "deepseek_v4")


@pytest.fixture(scope="module", params=["v3", "v4"])
def sched_model(request):
    """The scheduling cases: V3, and V4 with its window blocks and state slots."""
    return request.getfixturevalue(request.param)


def _nothing_held(llm: LLM) -> bool:
    s = llm.engine.get_stats()
    return s.kv_blocks_used == s.kv_window_blocks_used == s.kv_state_slots_used == 0


def _force_right(llm: LLM, expected: list[list[int]]) -> None:
    """After the MTP layer drafted, replace each sequence's drafts by the target's continuation."""
    spec, want = llm.engine.spec, {tuple(p): e for p, e in zip(PROMPTS, expected)}
    propose = spec.propose

    def propose_then_force(sched):
        propose(sched)
        for s in sched.scheduled:
            seq, n = s.seq, s.seq.num_output_tokens
            if seq.spec_token_ids:
                seq.spec_token_ids = want[tuple(seq.prompt_token_ids)][n : n + len(seq.spec_token_ids)]

    spec.propose = propose_then_force


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_equals_plain_decoding(model, k):
    path, expected = model
    llm = _llm(path, k)
    assert _tokens(llm) == expected
    s = llm.engine.spec.stats
    assert s.num_drafts > 0 and s.num_draft_tokens >= s.num_drafts
    assert s.num_accepted_tokens == sum(s.accepted_per_pos) and s.accepted_per_pos == sorted(s.accepted_per_pos)[::-1]
    assert _nothing_held(llm)


def test_accepted_mtp_drafts_emit_k_plus_1_tokens_a_step(model):
    path, expected = model
    k, i = 3, 0
    llm = _llm(path, k)
    _force_right(llm, expected)
    engine, emitted = llm.engine, []
    engine.add_request(Request(request_id="a", prompt_token_ids=PROMPTS[i], params=_params()[i]))
    while engine.has_unfinished_requests():
        emitted += [len(o.outputs[0].token_ids) for o in engine.step() if o.outputs[0].token_ids]
    gains = [b - a for a, b in zip(emitted, emitted[1:])]
    # drafts from the first decode step; the last token has no room for drafts under max_tokens
    assert emitted[0] == 1 and gains == [k + 1, k + 1, 1]
    s = engine.spec.stats
    assert s.num_accepted_tokens == s.num_draft_tokens == 6 and s.accepted_per_pos == [2, 2, 2]
    assert _tokens(llm) == expected and _nothing_held(llm)


@pytest.mark.parametrize("right", [True, False])
def test_preemption_in_the_middle_of_mtp_speculation(v3, right):
    _preempted(*v3, right)


def test_v4_preemption_in_the_middle_of_accepted_mtp_speculation(v4):
    """Drafts accepted: the preempted sequences hold window blocks (the MTP layer's records among
    them) and a state slot advanced by accepted drafts when they are dropped."""
    _preempted(*v4, True)


def test_v4_mtp_from_a_prefix_cache_checkpoint(v4):
    """The same prompts twice: the second run starts from prefix checkpoints (window blocks, the
    MTP layer's records among them, and state copied), and its tokens are still plain decoding's."""
    path, expected = v4
    llm = _llm(path, 2, kv_block_size=16)  # a checkpoint at the 21-token prompt's block boundary
    assert _tokens(llm) == expected and _tokens(llm) == expected
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0 and _nothing_held(llm) and llm.engine.spec.stats.num_drafts > 0


def _preempted(path: str, expected: list[list[int]], right: bool) -> None:
    llm = _llm(path, 3, num_kv_blocks=12)
    if right:
        _force_right(llm, expected)
    assert _tokens(llm) == expected
    assert llm.engine.get_stats().num_preemptions > 0 and _nothing_held(llm)


def test_abort_while_mtp_drafts_wait(sched_model):
    path, expected = sched_model
    llm = _llm(path, 2)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(Request(request_id=str(i), prompt_token_ids=p, params=_params()[i]))
    done = {}
    while not any(s.spec_token_ids for s in engine.scheduler.running):
        done.update((o.request_id, o) for o in engine.step())
    victim = next(s for s in engine.scheduler.running if s.spec_token_ids).request_id
    engine.abort_request(victim)
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    assert done[victim].outputs[0].finish_reason == "abort"
    assert all(done[str(i)].outputs[0].token_ids == expected[i] for i in range(len(PROMPTS)) if str(i) != victim)
    assert _nothing_held(llm)


def test_random_sampling_with_mtp_drafts_frees_everything(v3):
    path, _ = v3
    llm = _llm(path, 2)
    params = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=6, ignore_eos=True)
    outs = _tokens(llm, params)
    assert all(len(t) == 6 for t in outs) and llm.engine.spec.stats.num_drafts > 0
    assert llm.engine.get_stats().kv_blocks_used == 0


# -- refusals at start --
def _config(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), kv_block_size=4, num_kv_blocks=32, skip_tokenizer_init=True, **kw)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_a_checkpoint_without_mtp_weights_is_a_clear_error(tmp_path, arch):
    path = make_tiny_model(tmp_path / "no_mtp", arch, overrides={"num_nextn_predict_layers": 0})
    with pytest.raises(ValueError, match="needs the checkpoint's MTP layer.*use method 'ngram'"):
        LLMEngine(_config(path, speculative_config=_spec(2)))
    LLMEngine(_config(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2}))  # ngram runs


def test_pd_workers_take_mtp_on_both_sides_or_neither():
    """A prefill worker takes method mtp (it computes the MTP layer's KV and hidden state) and no
    other; in a cluster, MTP on some PD workers and not on others is refused at start."""
    from pdserve.config import ConfigError, parse_config
    from pdserve.serve_config import WorkerServeConfig

    prefill = {"role": "prefill", "model": "tiny:deepseek_v3"}
    decode = {"role": "decode", "model": "tiny:deepseek_v3", "peers": ["http://127.0.0.1:30000"]}
    for role in (prefill, decode):
        w = WorkerServeConfig.model_validate({**role, "worker": {"port": 30001, "speculative_config": _spec(2)}})
        assert w.worker.speculative_config.method == "mtp"
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="prefill worker takes method 'mtp' only"):
        WorkerServeConfig.model_validate({**prefill, "worker": {"port": 30000, "speculative_config": ngram}})

    def pd(p, d):
        return {"model": "tiny:deepseek_v3", "prefill": [{"port": 30000, **p}], "decode": [{"port": 30001, **d}]}

    both = parse_config(pd({"speculative_config": _spec(2)}, {"speculative_config": _spec(3)}), "t")
    assert both.prefill[0].speculative_config.method == both.decode[0].speculative_config.method == "mtp"
    with pytest.raises(ConfigError, match="prefill-0: speculative method 'mtp' under PD needs it on both"):
        parse_config(pd({}, {"speculative_config": _spec(2)}), "t")
    with pytest.raises(ConfigError, match="decode-0: speculative method 'mtp' under PD needs it on both"):
        parse_config(pd({"speculative_config": _spec(2)}, {}), "t")
    with pytest.raises(ConfigError, match="prefill-0: speculative_config on a prefill worker takes method 'mtp'"):
        parse_config(pd({"speculative_config": ngram}, {"speculative_config": ngram}), "t")


def test_launch_gives_mtp_to_the_pair_and_ngram_to_decode_alone():
    import argparse

    from pdserve.config import parse_config
    from pdserve.launch.flags import apply_flags

    cfg = parse_config({"model": "tiny:deepseek_v3", "prefill": [{"port": 30000}], "decode": [{"port": 30001}]}, "t")
    mtp = apply_flags(cfg, argparse.Namespace(speculative_config=_spec(2)))
    assert mtp.prefill[0].speculative_config == mtp.decode[0].speculative_config
    ngram = apply_flags(cfg, argparse.Namespace(speculative_config={"method": "ngram", "num_speculative_tokens": 2}))
    assert ngram.prefill[0].speculative_config is None and ngram.decode[0].speculative_config.method == "ngram"


def test_an_fp8_checkpoint_keeps_its_mtp_layer_fp8(v3, tmp_path):
    """The MTP layer's projections and experts quantized as DeepSeek ships the rest: kept FP8 at
    load like the main layers', and greedy with MTP still equals plain decoding."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from pdserve_kernels.ref_fp8 import quant_block_fp8

    path, _ = v3
    block, skip = (32, 32), ("embed_tokens", "lm_head", "shared_head", "norm", "mlp.gate.weight", "eh_proj")
    tensors = {}
    for name, w in load_file(f"{path}/model.safetensors").items():
        if w.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip):
            tensors[name], tensors[name + "_scale_inv"] = quant_block_fp8(w, block)
        else:
            tensors[name] = w
    out = tmp_path / "fp8"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(open(f"{path}/config.json").read())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config))
    llm = _llm(str(out), 2)
    mtp = llm.engine.runner.model.mtp
    assert mtp.self_attn.q_a_proj.weight.dtype == mtp.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert _tokens(llm) == _tokens(_llm(str(out))) and llm.engine.spec.stats.num_drafts > 0


def test_a_v4_flash_format_checkpoint_keeps_its_mtp_layer_quantized(tmp_path_factory):
    """The tiny V4 in V4-Flash's formats (quantize_tiny_v4: FP8 projections, FP4 routed experts,
    the MTP layer's under its release names with `.scale`): the MTP layer kept FP8 / FP4 like
    the main layers, and greedy with MTP equals plain decoding."""
    import torch

    from pdserve.tiny_model import quantize_tiny_v4

    tmp = tmp_path_factory.mktemp("v4q")
    quant, _ = quantize_tiny_v4(make_tiny_model(tmp / "f", "deepseek_v4"), tmp / "q", tmp / "r", block=(32, 32))
    llm = _llm(str(quant), 2)
    mtp = llm.engine.runner.model.mtp
    assert mtp.e_proj.weight.dtype == mtp.self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    assert mtp.mlp.experts.gate_up_proj.dtype == torch.uint8  # packed FP4
    assert _tokens(llm) == _tokens(_llm(str(quant))) and llm.engine.spec.stats.num_drafts > 0 and _nothing_held(llm)
