"""Parity of pdserve's DeepSeek-V3 / V3.2 with transformers 5.24 (the oracle), float32 on CPU.

Tiny random models are made by transformers itself, saved with save_pretrained, loaded with
pdserve's loader, and run through the paged KV cache (block size 4, shuffled blocks).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM

from pdserve.model import ops
from pdserve.model.loader import load_model
from tests.helpers.model import PagedHarness, Seq

pytestmark = pytest.mark.timeout(300)

VOCAB = 300
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, initializer_range=0.08, max_position_embeddings=256,
)  # fmt: skip
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
    beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8,
)  # fmt: skip

CONFIGS = {
    # MoE with group-limited routing, q LoRA, biased attention projections, interleaved rope
    "v3_groups_qlora": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(n_group=4, topk_group=2, attention_bias=True)),
    # no q LoRA, YaRN, half-split rope, un-normalized top-k, 2 shared experts, tied embeddings, 2 dense layers
    "v3_yarn_noqlora": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            q_lora_rank=None,
            rope_parameters=YARN,
            rope_interleave=False,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            n_shared_experts=2,
            n_group=2,
            topk_group=1,
            tie_word_embeddings=True,
            first_k_dense_replace=2,
        ),  # fmt: skip
    ),
    # DSA: prompts longer than index_topk, 16 indexer heads so score ties are improbable
    "v32_dsa_yarn": (
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
        dict(n_group=2, topk_group=1, index_n_heads=16, index_head_dim=32, index_topk=8, rope_parameters=YARN),
    ),
    "v32_dsa_all_moe": (
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
        dict(n_group=1, topk_group=1, index_n_heads=8, index_head_dim=16, index_topk=6, first_k_dense_replace=0),
    ),
}
PROMPT_LENS = (1, 5, 14, 27)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-zero e_score_correction_bias and biases (transformers initializes them to zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=g) * 0.2 - 0.1)


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, pdserve model) with the same weights."""
    cfg_cls, model_cls, extra = CONFIGS[request.param]
    torch.manual_seed(0)
    ref = model_cls(cfg_cls(**{**BASE, **extra}, attn_implementation="eager")).eval()
    _randomize(ref, seed=1)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    ops.set_backend("torch")
    try:
        yield ref, load_model(path, dtype=torch.float32, device="cpu", progress=False)
    finally:
        ops.set_backend(None)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ref_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()  # [T, V]


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= 1e-4 * scale, f"max abs diff {err:.3e} vs max |logit| {scale:.3e}"


def test_prompt_logits_match(pair):
    ref, model = pair
    for i, n in enumerate(PROMPT_LENS):
        prompt = _prompt(n, seed=10 + i)
        (logits,) = PagedHarness(model, seed=i).step([(Seq(), prompt)])
        _assert_close(logits, _ref_logits(ref, prompt))


def test_greedy_decode_matches(pair):
    ref, model = pair
    for i, n in enumerate(PROMPT_LENS[1:]):
        prompt = _prompt(n, seed=20 + i)
        got, _ = PagedHarness(model, seed=100 + i).greedy(prompt, steps=10, chunk=4 if i == 1 else None)
        seq = list(prompt)
        for _ in range(10):  # plain argmax continuation over the full sequence
            seq.append(int(_ref_logits(ref, seq)[-1].argmax()))
        assert got == seq[len(prompt) :], f"prompt length {n}"


def test_flat_batch_equals_single_sequences(pair):
    """A prefill chunk, a decode token and a fresh prompt in one flat batch give each sequence the
    logits it gets alone."""
    _, model = pair
    prompts = [_prompt(11, 31), _prompt(6, 32), _prompt(13, 33)]
    alone = [PagedHarness(model, seed=7).step([(Seq(), p)])[0] for p in prompts]
    h = PagedHarness(model, seed=8)
    a, b, c = Seq(), Seq(), Seq()
    first = h.step([(a, prompts[0][:5]), (b, prompts[1][:5])])
    second = h.step([(b, prompts[1][5:]), (a, prompts[0][5:]), (c, prompts[2])])
    _assert_close(torch.cat([first[0], second[1]]), alone[0])
    _assert_close(torch.cat([first[1], second[0]]), alone[1])
    _assert_close(second[2], alone[2])
