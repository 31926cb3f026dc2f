"""DeepSeek-V4's multi-token-prediction (MTP) layer: a draft of the token after next.

Legend: T tokens, N hc_mult residual streams, H hidden size, V vocab.

The release holds it as `mtp.0.*` (config.json's `num_nextn_predict_layers: 1`; DeepSeek's
reference `MTPBlock`, vLLM's `DeepSeekV4MultiTokenPredictorLayer`): a whole V4 decoder layer at
index num_hidden_layers - attention, MoE (routed by score, never hashed), the two
hyper-connections - and beside it

    enorm, hnorm          RMSNorm of the next token's embedding and of each previous residual stream
    e_proj, h_proj        [H, H] each (FP8 in the release, as the main layers' projections)
    norm                  the final RMSNorm before the head (`head_norm` here: the loader's
                          `.norm.` -> `.kv_norm.` rename is attention's)
    hc_head_fn/base/scale its own collapse of the N streams (HyperHead), before that norm

and the main model's embedding and head (the release stores no copy). Its attention type is the
entry of `compress_ratios` past the main layers (V4-Flash: 0, sliding window only), so its cache
is one more layer of the window region: no compressed entries, no compressor state.

Row i pairs the target's residual streams h_i [N, H] *before* its hc_head (what the last main
layer returns) with the token t_{i+1}, at position i:

    x = e_proj(enorm(embed(t_{i+1})))[None] + h_proj(hnorm(h_i))     [N, H], each stream
    g_i = layer(x)                                                    [N, H], streams again
    logits = head(head_norm(hc_head(g_i)))                            scores t_{i+2}

Chained drafts feed g (the streams, before hc_head) back as the previous state, as DeepSeek's
reference and vLLM do. Under tensor parallelism the decoder layer is split as the main layers are
(query heads and output groups, the experts' intermediate dim); enorm / hnorm, e_proj / h_proj,
hc_head and head_norm are replicated, as the main model's norms and mHC are.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v4.config import SLIDING
from pdserve.model.deepseek_v4.hyper_connections import HyperHead
from pdserve.model.deepseek_v4.layers import V4RMSNorm
from pdserve.model.deepseek_v4.step import V4Step
from pdserve.model.fp8 import linear
from pdserve.model.kv_cache import KVCache


def mtp_config(config: ModelConfig) -> ModelConfig:
    """config with the MTP layer's attention and MoE types appended at index num_hidden_layers,
    for building that layer; only a sliding-window MTP layer (the release's) is supported."""
    v4 = config.v4
    kind = v4.mtp_layer_types[0] if v4.mtp_layer_types else SLIDING
    if kind != SLIDING:
        raise ValueError(
            f"DeepSeek-V4 MTP layer of type {kind!r}: pdserve runs a sliding-window MTP layer only "
            "(compress ratio 0, as DeepSeek-V4 releases it)"
        )
    v4 = dataclasses.replace(v4, layer_types=(*v4.layer_types, kind), mlp_layer_types=(*v4.mlp_layer_types, "moe"))
    return dataclasses.replace(config, v4=v4)


def mtp_layer(config: ModelConfig, tp: TPGroup, decoder_layer: type[nn.Module]) -> nn.Module:
    """The MTP layer: a `decoder_layer` (model.py's V4DecoderLayer) at index num_hidden_layers with
    the MTP modules beside it (module names: the release's, through loader.py's renames)."""
    H, eps, v4 = config.hidden_size, config.rms_norm_eps, config.v4
    layer = decoder_layer(mtp_config(config), config.num_hidden_layers, tp)
    layer.enorm = V4RMSNorm(H, eps)
    layer.hnorm = V4RMSNorm(H, eps)
    layer.e_proj = linear(H, H, fp8_block=config.fp8_block)
    layer.h_proj = linear(H, H, fp8_block=config.fp8_block)
    layer.head_norm = V4RMSNorm(H, eps)
    layer.hc_head = HyperHead(H, v4.hc_mult, v4.hc_eps, eps)
    return layer


def mtp_forward(
    layer: nn.Module, embed: nn.Embedding, step: V4Step, kv_cache: KVCache, index: int, prev: torch.Tensor
) -> torch.Tensor:
    """step's input_ids are the next tokens t_{i+1} at positions i; prev [T, N, H] the residual
    streams h_i. Writes the layer's window records (pool layer `index`); returns g [T, N, H]."""
    e = layer.e_proj(layer.enorm(embed(step.input_ids)))  # [T, H]
    T, N, H = prev.shape
    h = layer.h_proj(layer.hnorm(prev.to(e.dtype)).view(T * N, H)).view(T, N, H)
    return layer(h + e[:, None, :], step, kv_cache, index)


def mtp_logits(layer: nn.Module, lm_head: nn.Linear, g: torch.Tensor) -> torch.Tensor:
    """g [N', N, H] streams -> the draft logits [N', V] float32 (hc_head, head_norm, the shared head)."""
    return lm_head(layer.hc_head(g, norm=layer.head_norm)).float()
