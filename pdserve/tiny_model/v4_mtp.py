"""The tiny DeepSeek-V4's MTP layer, under the release's names (`mtp.0.*`, as DeepSeek-V4 ships it).

Its values come from a generator of their own (seed + MTP_SEED_OFFSET), drawn after the main
model's, so adding the layer leaves every main-model tensor as it was. The shapes are those of
pdserve's MTP layer (model/deepseek_v4/mtp.py) built on meta; each in-memory name is written
under its release name (`RELEASE_NAMES`), the routed experts one tensor per expert and
projection (w1 / w3 / w2), and the loader's mapping is checked to give the name back.
"""

from __future__ import annotations

import torch

from pdserve.tiny_model.weights import MTP_SEED_OFFSET

# pdserve's in-memory name (in the layer) -> the release's, first match (the decoder layer's
# names as the main layers' release names; the MTP modules' own)
RELEASE_NAMES = (
    ("self_attn.sinks", "attn.attn_sink"), ("self_attn.q_a_proj.", "attn.wq_a."), ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."), ("self_attn.kv_proj.", "attn.wkv."), ("self_attn.kv_norm.", "attn.kv_norm."),
    ("self_attn.o_a_proj.", "attn.wo_a."), ("self_attn.o_b_proj.", "attn.wo_b."),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"), ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."), ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
    ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.", "hc_attn_"), ("ffn_hc.", "hc_ffn_"), ("head_norm.", "norm."), ("hc_head.hc_", "hc_head_"),
    ("enorm.", "enorm."), ("hnorm.", "hnorm."), ("e_proj.", "e_proj."), ("h_proj.", "h_proj."),
)  # fmt: skip


def release_name(name: str) -> str:
    """The release name of in-memory MTP parameter `name` (relative to the layer)."""
    for mine, theirs in RELEASE_NAMES:
        if name.startswith(mine):
            return "mtp.0." + theirs + name[len(mine) :]
    raise KeyError(f"no release name for MTP parameter {name}")


def tiny_v4_mtp_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 weights of the MTP layer of V4 `config` (num_nextn_predict_layers 1),
    under the release's names; values drawn as tiny_v4_weights draws the main layers'."""
    from pdserve.model.config import ModelConfig
    from pdserve.model.deepseek_v4.loader import hf_name
    from pdserve.model.deepseek_v4.model import DeepseekV4ForCausalLM

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(ModelConfig.from_dict(config))
        model.add_mtp()
    gen = torch.Generator().manual_seed(seed + MTP_SEED_OFFSET)

    def normal(shape, scale: float = config["initializer_range"]) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * scale

    w: dict[str, torch.Tensor] = {}
    for name, t in model.mtp.named_parameters():
        if name.endswith(("norm.weight", "scale")):
            value = torch.ones(t.shape)
        elif name.endswith(("sinks", "base", "e_score_correction_bias")):
            value = normal(t.shape, 0.5)
        else:
            value = normal(t.shape)
        if name.startswith("mlp.experts."):  # [E, 2I, H] gate then up / [E, H, I] -> per expert
            projs = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
            for e in range(value.shape[0]):
                for proj, part in zip(projs, value[e].chunk(len(projs))):
                    w[f"mtp.0.ffn.experts.{e}.{proj}.weight"] = part.contiguous()
            continue
        release = release_name(name)
        if hf_name(release) != "model.mtp.0." + name:
            raise AssertionError(f"{release} loads as {hf_name(release)}, not model.mtp.0.{name}")
        w[release] = value
    return w
