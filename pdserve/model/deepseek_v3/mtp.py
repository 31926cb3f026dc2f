"""DeepSeek-V3 / V3.2's multi-token-prediction (MTP) layer: a draft of the token after next.

Legend: T tokens in the batch, H hidden size, V vocab.

The checkpoint holds it as one more layer, `model.layers.{num_hidden_layers}.*` (config.json's
`num_nextn_predict_layers: 1`): a full decoder layer (MLA + MoE, always MoE) and

    enorm, hnorm          RMSNorm of the next token's embedding and of the previous hidden state
    eh_proj               [H, 2H]: cat(enorm(embed(t_{i+1})), hnorm(h_i)) -> the layer's input
    shared_head.norm      the final norm of its output
    shared_head.head      [V, H]: its logits (a copy of lm_head in DeepSeek's releases)
    embed_tokens          [V, H]: its embedding (a copy of the main model's)

Row i pairs the target's hidden state h_i (after the final norm, what the target's logits are
computed from) with the token t_{i+1}; its output g_i scores t_{i+2}. It runs at position i, with
its own KV records (one more layer of the paged pool, at the slot of position i), causal over the
sequence. Chained drafts feed g back as the hidden state with the drafted token (one layer reused,
as vLLM does; transformers' MtpModel and SGLang feed the normed output back too, as here).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model.batch import ForwardBatch
from pdserve.model.config import ModelConfig
from pdserve.model.kv_cache import KVCache
from pdserve.model.layers import RMSNorm


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


def mtp_layer(config: ModelConfig, tp: TPGroup, decoder_layer: type[nn.Module]) -> nn.Module:
    """The MTP layer at index num_hidden_layers: a `decoder_layer` (model.py's DecoderLayer) with
    the MTP modules beside it."""
    layer = decoder_layer(config, config.num_hidden_layers, tp)
    H = config.hidden_size
    layer.enorm = RMSNorm(H, config.rms_norm_eps)
    layer.hnorm = RMSNorm(H, config.rms_norm_eps)
    layer.eh_proj = nn.Linear(2 * H, H, bias=False)
    layer.shared_head = SharedHead(config)
    layer.embed_tokens = nn.Embedding(config.vocab_size, H)
    return layer


def mtp_forward(
    layer: nn.Module, rotary: nn.Module, batch: ForwardBatch, kv_cache: KVCache, prev_hidden: torch.Tensor
) -> torch.Tensor:
    """batch's input_ids are the next tokens t_{i+1} at positions i; prev_hidden [T, H] the hidden
    states h_i. Writes the layer's KV records; returns g [T, H] (after shared_head.norm)."""
    e = layer.enorm(layer.embed_tokens(batch.input_ids))  # [T, H]
    x = layer.eh_proj(torch.cat([e, layer.hnorm(prev_hidden.to(e.dtype))], dim=-1))  # [T, H]
    cos, sin = rotary(batch.positions)
    return layer.shared_head.norm(layer(x, cos, sin, batch, kv_cache))


def mtp_logits(layer: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """g [N, H] -> the draft logits [N, V] float32."""
    return layer.shared_head.head(g).float()


@torch.no_grad()
def share_copies(layer: nn.Module, embed: nn.Embedding, lm_head: nn.Linear) -> None:
    """Point the MTP layer's embedding and head at the main model's when they hold the same values
    (DeepSeek's releases store copies): one copy in memory instead of two."""
    if layer.embed_tokens.weight.shape == embed.weight.shape and torch.equal(layer.embed_tokens.weight, embed.weight):
        layer.embed_tokens.weight = embed.weight
    head = layer.shared_head.head
    if head.weight.shape == lm_head.weight.shape and torch.equal(head.weight, lm_head.weight):
        head.weight = lm_head.weight
