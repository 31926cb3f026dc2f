"""FP8 block-scaled checkpoints kept FP8 in the engine (model/fp8.py, loader.py, moe.py), float32
on CPU (the torch reference path of ops.fp8_linear / ops.fused_moe_fp8).

Tiny DeepSeek-V3 / V3.2 models made by transformers; every weight DeepSeek ships in FP8 is
quantized per (16 x 32) block (non-square, and hidden 72 / q_lora 48 / kv_a 40 leave partial
blocks), written with a quantization_config. The oracle is transformers in float32 on the
dequantized weights: the kept-FP8 engine must give its greedy tokens and log-probabilities, and
the same as the engine dequantizing at load (--quantization none); TP2 must give TP1's tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.model.loader import CheckpointError, load_model
from pdserve_kernels.ref_fp8 import dequant_block_fp8, quant_block_fp8
from tests.helpers.oracle import first_topk

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("restore_torch_threads")]

BLOCK = (16, 32)
BASE = dict(
    vocab_size=256, hidden_size=72, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, initializer_range=0.08, max_position_embeddings=256, n_group=4, topk_group=2,
)  # fmt: skip
CONFIGS = {
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, {}),
    "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM, dict(index_n_heads=4, index_head_dim=32, index_topk=8)),
}
PROMPT_LENS = (1, 5, 12, 23, 37)
MAX_TOKENS = (8, 3, 6, 1, 5)
ENGINE = dict(dtype="float32", kv_block_size=4, max_num_batched_tokens=16, skip_tokenizer_init=True, cpu_threads=1)
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}


def _shipped_fp8(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek ships in FP8: the linear weights of attention, indexer, MLPs and experts."""
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "weights_proj")
    return t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip)


def _write(path: Path, tensors: dict, config: dict) -> str:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoints(request, tmp_path_factory):
    """(fp8 folder, dequantized folder, prompts, oracle (tokens, logprobs) per prompt)."""
    cfg_cls, model_cls, extra = CONFIGS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model_cls(cfg_cls(**{**BASE, **extra})).save_pretrained(root / "hf")
    config = json.loads((root / "hf" / "config.json").read_text())
    g = torch.Generator().manual_seed(1)
    fp8, deq = {}, {}
    for name, w in load_file(str(root / "hf" / "model.safetensors")).items():
        if name.endswith("e_score_correction_bias"):  # transformers zero-initializes it: make it matter
            w = torch.rand(w.shape, generator=g) * 0.2 - 0.1
        if _shipped_fp8(name, w):
            q, s = quant_block_fp8(w, BLOCK)
            fp8[name], fp8[name + "_scale_inv"], deq[name] = q, s, dequant_block_fp8(q, s, BLOCK)
        else:
            fp8[name] = deq[name] = w.contiguous()
    assert any(n.endswith("experts.3.down_proj.weight_scale_inv") for n in fp8)
    fp8_dir = _write(root / "fp8", fp8, {**config, "quantization_config": QUANT})
    deq_dir = _write(root / "deq", deq, config)
    oracle = model_cls.from_pretrained(deq_dir, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [torch.randint(2, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return fp8_dir, deq_dir, prompts, [_argmax(oracle, p, n) for p, n in zip(prompts, MAX_TOKENS)]


def _argmax(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    seq, lps = list(prompt), []
    with torch.no_grad(), first_topk():  # V3.2's 4 index heads tie at 0: pdserve's tie rule
        for _ in range(n):
            lp = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), -1)
            seq.append(int(lp.argmax()))
            lps.append(lp[seq[-1]].item())
    return seq[len(prompt) :], lps


def _generate(llm: LLM, prompts) -> list[tuple[list[int], list[float]]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in MAX_TOKENS]
    outs = [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    return [(c.token_ids, [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)]) for c in outs]


def test_kept_fp8_matches_the_oracle_and_dequantized_at_load(checkpoints):
    fp8_dir, _, prompts, oracle = checkpoints
    kept = LLM(fp8_dir, **ENGINE)
    m = kept.engine.runner.model
    layer = m.model.layers[1]
    assert layer.self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert tuple(layer.mlp.experts.down_proj_scale_inv.shape) == (8, 5, 2)  # [E, ceil(72/16), 64/32]
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.float32  # absorbed per head: dequantized
    got = _generate(kept, prompts)
    dequantized = _generate(LLM(fp8_dir, quantization="none", **ENGINE), prompts)
    for i, ((tokens, lps), (want, want_lps), (d_tokens, d_lps)) in enumerate(zip(got, oracle, dequantized)):
        assert tokens == want == d_tokens, f"prompt {i}"
        assert lps == pytest.approx(want_lps, abs=1e-4), f"prompt {i}"
        assert lps == pytest.approx(d_lps, abs=1e-5), f"prompt {i}"


@pytest.mark.slow
def test_tp2_equals_tp1(checkpoints):
    fp8_dir, _, prompts, oracle = checkpoints
    llm = LLM(fp8_dir, tensor_parallel_size=2, **ENGINE)
    try:
        assert [t for t, _ in _generate(llm, prompts)] == [t for t, _ in oracle]
    finally:
        llm.engine.shutdown()


def test_each_rank_holds_its_fp8_blocks(checkpoints):
    fp8_dir = checkpoints[0]
    full = dict(load_model(fp8_dir, torch.float32, progress=False).named_parameters())
    from pdserve.distributed.group import TPGroup

    part = dict(load_model(fp8_dir, torch.float32, progress=False, tp=TPGroup(rank=1, size=2)).named_parameters())
    o, ex = "model.layers.1.self_attn.o_proj.", "model.layers.2.mlp.experts."
    assert torch.equal(part[o + "weight"].float(), full[o + "weight"].float()[:, 32:])
    assert torch.equal(part[o + "weight_scale_inv"], full[o + "weight_scale_inv"][:, 1:])  # bk 32: block 1 of 2
    gate_up, s = full[ex + "gate_up_proj_scale_inv"], part[ex + "gate_up_proj_scale_inv"]  # [E, 2I/16, ...]
    assert torch.equal(s, torch.cat([gate_up[:, 2:4], gate_up[:, 6:8]], dim=1))  # rank 1's gate and up blocks


def test_contradictions_are_refused(checkpoints, tmp_path):
    fp8_dir, deq_dir, _, _ = checkpoints
    with pytest.raises(ValueError, match="has no FP8 quantization_config .* does not quantize at load"):
        LLM(deq_dir, quantization="fp8", **ENGINE)
    # a tensor-parallel shard that would cut a block: refused before any rank starts
    cut = tmp_path / "cut"
    shutil.copytree(fp8_dir, cut)
    cfg = json.loads((cut / "config.json").read_text())
    (cut / "config.json").write_text(
        json.dumps({**cfg, "quantization_config": {**QUANT, "weight_block_size": [32, 32]}})
    )
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match=r"q heads: 48 per rank .* cuts the FP8 weights' 32-wide scale blocks"):
        LLM(str(cut), tensor_parallel_size=2, **ENGINE)
    assert psutil.Process().children(recursive=True) == before
    # a weight the config makes FP8 that comes in float32 (without its scale)
    t = load_file(str(Path(fp8_dir) / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"
    t[name] = dequant_block_fp8(t[name], t.pop(name + "_scale_inv"), BLOCK)
    bad = _write(tmp_path / "bad", t, json.loads((Path(fp8_dir) / "config.json").read_text()))
    with pytest.raises(
        CheckpointError,
        match=r"o_proj\.weight in .* is torch\.float32, but config\.json's quantization_config makes it an FP8",
    ):
        load_model(bad, torch.float32, progress=False)


def test_dummy_fp8_weights(checkpoints):
    """load_format dummy on an FP8 config: random e4m3 weights with per-block scales, N(0, 1/fan_in)
    before quantization; the engine runs them. On a config without FP8, quantization fp8 makes
    DeepSeek's 128 x 128 blocks."""
    from pdserve.model.config import ModelConfig
    from pdserve.model.fp8 import model_config_for

    llm = LLM(checkpoints[0], load_format="dummy", **ENGINE)
    layer = llm.engine.runner.model.model.layers[2]
    w, s = layer.mlp.experts.down_proj, layer.mlp.experts.down_proj_scale_inv
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and (s > 0).all()
    real = dequant_block_fp8(w, s, BLOCK)
    assert real.std().item() == pytest.approx(64**-0.5, rel=0.1)
    assert layer.self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    (out,) = llm.generate(
        prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )
    assert len(out.outputs[0].token_ids) == 3
    plain = ModelConfig.from_model_dir(checkpoints[1])
    assert model_config_for(plain, "fp8", dummy=True).fp8_block == (128, 128)
    assert model_config_for(plain, None, dummy=True).fp8_block is None


def test_quantization_flag(checkpoints):
    """`pdserve serve --quantization` (vLLM's name) reaches the engine config; bad values are refused."""
    import argparse

    from pdserve.serve import add_serve_args, config_from_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = lambda *a: p.parse_args(["--role", "colocated", "--model", checkpoints[0], *a])  # noqa: E731
    cfg = config_from_args(args("--quantization", "none"))
    assert cfg.worker.quantization == "none" and cfg.worker.engine_config(checkpoints[0]).quantization == "none"
    assert config_from_args(args()).worker.engine_config(checkpoints[0]).quantization is None
    with pytest.raises(ValueError, match="quantization"):
        config_from_args(args("-q", "awq"))
