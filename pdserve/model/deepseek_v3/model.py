"""DeepSeek-V3 / V3.2 causal LM over a flat token batch and a paged latent KV cache.

Legend: T tokens in the batch, N rows to compute logits for, V vocab.

Module and parameter names are the checkpoint's (model.layers.N.self_attn.kv_b_proj.weight,
...), so the loader maps names one to one except for the stacked experts (see loader.py).

With the MTP layer (`add_mtp`, speculative decoding's drafts: mtp.py) it is `model.layers[L]`, L =
num_hidden_layers, under the checkpoint's own names; `forward` runs layers 0..L-1 only, and the KV
pool gets one more layer (`num_layers` L + 1) for its records.

Tensor parallelism (a TPGroup of size > 1) splits attention heads, MLP and expert intermediate
dims (see attention.py, model/layers.py, moe.py). The embedding and lm_head are replicated: the token
lookup needs no all-reduce, and only rank 0 computes logits, for the sampler it alone runs.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model.batch import ForwardBatch
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v3.attention import MLA
from pdserve.model.deepseek_v3.cache import kv_cache_specs
from pdserve.model.deepseek_v3.moe import MoE
from pdserve.model.deepseek_v3.mtp import mtp_forward, mtp_layer, mtp_logits, share_copies
from pdserve.model.kv_cache import KVCache, KVRegionSpec
from pdserve.model.layers import MLP, RMSNorm
from pdserve.model.rope import RotaryEmbedding

# Parameters kept in float32 whatever the model dtype (router and indexer weights), as transformers does.
FP32_PARAM_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = MLA(config, layer_idx, tp)
        if config.is_moe_layer(layer_idx):
            self.mlp: nn.Module = MoE(config, tp)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, tp, fp8_block=config.fp8_block)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos, sin, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.qk_rope_head_dim)


class DeepseekForCausalLM(nn.Module):
    supports_cuda_graphs = True  # decode forward: no host sync, shapes from the batch size alone
    supports_mtp = True  # add_mtp, forward_mtp, compute_mtp_logits
    # every part of the decode path (absorbed MLA, V3.2's indexer and sparse MLA, MoE) is per token:
    # a verify chunk's tokens run as decode rows, eager or replayed (engine/cuda_graphs.py)
    verify_as_decode_rows = True

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TPGroup.single()
        self.num_layers = config.num_hidden_layers
        self.model = DeepseekModel(config, self.tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def add_mtp(self) -> None:
        """Append the MTP layer (built where the model is: on meta before a load)."""
        if self.mtp is None:
            self.model.layers.append(mtp_layer(self.config, self.tp, DecoderLayer))
            self.num_layers = self.config.num_hidden_layers + 1

    @property
    def mtp(self) -> nn.Module | None:
        layers = self.model.layers
        return layers[self.config.num_hidden_layers] if len(layers) > self.config.num_hidden_layers else None

    def share_mtp_copies(self) -> None:
        """After a load: the MTP layer's embedding and head share the main model's when equal."""
        share_copies(self.mtp, self.model.embed_tokens, self.lm_head)

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (call again after
        replacing parameters, e.g. when materializing from the meta device)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def kv_cache_specs(self, kv_cache_dtype: str = "auto") -> list[KVRegionSpec]:
        """The KV pool's regions (cache.py)."""
        return kv_cache_specs(self.config, kv_cache_dtype)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Runs every token of the batch; writes their KV records; returns final-normed hidden [T, hidden]."""
        h = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = self.model.rotary_emb(batch.positions)  # [T, R/2]
        for layer in self.model.layers[: self.config.num_hidden_layers]:
            h = layer(h, cos, sin, batch, kv_cache)
        return self.model.norm(h)

    @torch.no_grad()
    def forward_mtp(self, batch: ForwardBatch, kv_cache: KVCache, prev_hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer over the batch (input_ids: the next tokens; prev_hidden [T, hidden]: the
        hidden states they pair with); writes its KV records; returns its hidden [T, hidden]."""
        return mtp_forward(self.mtp, self.model.rotary_emb, batch, kv_cache, prev_hidden)

    @torch.no_grad()
    def compute_mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """MTP hidden [N, hidden] -> draft logits [N, V] float32."""
        return mtp_logits(self.mtp, hidden)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, V] float32."""
        return self.lm_head(hidden).float()
