"""DeepSeek-V4 (V4-Flash) causal LM over a flat batch of new tokens and the paged KV pool.

Legend: T new tokens of the step (all sequences), B sequences, N hc_mult streams, V vocab,
n tokens of a sequence so far, D head_dim, Di index_head_dim, W sliding_window.

Cache state, per sequence and layer, by layer kind, all of it in the pool (regions in cache.py:
what the engine pages and transfers):
  - every layer: the K=V records of its last W-1 positions (normed, roped; window region);
  - CSA layers (rate 4): n // 4 entries [D] and indexer keys [Di], plus their running state:
    pending group [n % 4, 2D] / [n % 4, 2Di] for kv and for gate logits, and the overlap (last
    group's Ca) [4, D] / [4, Di] for kv and gate;
  - HCA layers (rate 128): n // 128 entries [D], pending group [n % 128, D] kv + gate.
Entry e pools positions e*m .. e*m+m-1 (CSA: and the m before) and is visible from positions
p >= e*m + m - 1.
Sizes for the released V4-Flash config (43 layers: 2 sliding, 21 CSA, 20 HCA; D 512, Di 128,
W 128) in bf16 (checked in tests/unit/test_v4_loader.py):
  - growing: CSA (512 + 128) / 4 values = 320 B/token/layer, HCA 512 / 128 = 8 B/token/layer;
    21 * 320 + 20 * 8 = 6,880 B per token for the whole model;
  - fixed per sequence: windows 43 * 127 * 512 * 2 B = 5.59 MB; running state at most 5.74 MB
    (CSA 25.6 KB a layer; HCA's pending group 127 * 2 * 512 * 2 B = 260 KB a layer, kept raw so
    that the pooling runs in transformers' order of operations).

Forward: `forward(batch, kv_cache)` runs the new tokens of B sequences (prefill chunks and
decode tokens alike, a ForwardBatch) concatenated; sequence b's tokens take positions
batch.starts[b] onwards. The step's indices are built on the device once (step.py; on the
Triton path by kernels: a decode step's in decode_step.py, a step of chunks' in chunk_step.py)
and each layer reads and writes its regions of the pool in place (after an exception the sequences' pool
state is half-advanced and must be dropped). Whole-prompt prefill, chunked prefill and one-token
decode give the same results.

Weights are kept as `config.quant` says (build from a config whose quant is None to dequantize
at load: loader.py): FP8 e4m3 with 128x128 block scales for the projections V4-Flash ships
FP8 (attention's q_a / q_b / kv / o_a / o_b, the indexer's q_b, the shared expert: config.fp8_block,
`ops.fp8_linear`), and its FP4 routed experts packed (moe.Experts, `ops.fused_moe_fp4`); the
compressors, indexer keys and weights, router, embedding and head are bf16 in the checkpoint.

Module and parameter names are transformers' (model.layers.N.self_attn.compressor.indexer...,
mlp.experts.gate_up_proj, attn_hc.fn, model.hc_head.hc_fn, ...), so a transformers-format
checkpoint maps one to one; loader.py also maps DeepSeek's release names. With the MTP layer
(`add_mtp`, speculative decoding's drafts: mtp.py) it is `model.mtp[0]` (the release's `mtp.0.*`),
the KV pool gets one more layer (`num_layers` L + 1: its window records) and `forward` keeps the
step's residual streams before hc_head in `last_streams` (the layer's input, `mtp_source`; a CUDA
graph's replay sets them to the graph's: engine/cuda_graphs.py).

CUDA graphs: the forward never syncs with the host (step.py builds every index on the device from
host ints; the routed experts run in one kernel a layer), so decode steps replay graphs, and so do
speculative decoding's verify steps whose chunks all have the same length (`verify_as_chunks`:
a chunk's tokens depend on each other through the window and the compressors' state, so they are
captured as chunks, not as decode rows).

Tensor parallelism (a TPGroup of size > 1) splits the query heads and output groups of attention
and the experts' intermediate dim (attention.py, moe.py): two all-reduces a layer, as V3.
The rest is replicated on every rank: the embedding, mHC and norms (they act on the full hidden
state each rank holds after an all-reduce), the shared K=V head, compressors and indexer (every
rank holds the same caches), and lm_head (only rank 0 computes logits, for its sampler).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model.batch import ForwardBatch
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v4.attention import V4Attention
from pdserve.model.deepseek_v4.cache import kv_cache_specs
from pdserve.model.deepseek_v4.chunk_step import build_chunk_step, fused_chunk_step
from pdserve.model.deepseek_v4.config import CSA, HCA
from pdserve.model.deepseek_v4.decode_step import build_decode_step, fused_decode_step
from pdserve.model.deepseek_v4.hyper_connections import HyperConnection, HyperHead, hc_residual
from pdserve.model.deepseek_v4.layers import V4RMSNorm
from pdserve.model.deepseek_v4.moe import V4MoE, fp4_experts
from pdserve.model.deepseek_v4.mtp import mtp_forward, mtp_layer, mtp_logits
from pdserve.model.deepseek_v4.step import V4Step, build_step
from pdserve.model.kv_cache import KVCache, KVRegionSpec
from pdserve.model.rope import RotaryEmbedding

# Parameters kept in float32 whatever the model dtype (transformers' _keep_in_fp32_modules_strict).
FP32_PARAM_PATTERNS = (
    "attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "q_a_norm.",
    "kv_norm.", "input_layernorm.", "post_attention_layernorm.", "model.norm.", "enorm.", "hnorm.", "head_norm.",
)  # fmt: skip


class V4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        v4, hidden, eps = config.v4, config.hidden_size, config.rms_norm_eps
        self.self_attn = V4Attention(config, layer_idx, tp)
        self.mlp = V4MoE(config, layer_idx, tp)
        self.input_layernorm = V4RMSNorm(hidden, eps)
        self.post_attention_layernorm = V4RMSNorm(hidden, eps)
        self.attn_hc = HyperConnection(hidden, v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps, eps)
        self.ffn_hc = HyperConnection(hidden, v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps, eps)

    def forward(self, h: torch.Tensor, step: V4Step, kv_cache: KVCache, layer: int) -> torch.Tensor:
        """h [T, N, hidden] -> [T, N, hidden]."""
        post, comb, x = self.attn_hc(h, norm=self.input_layernorm)  # x normed
        h = hc_residual(h, self.self_attn(x, step, kv_cache, layer), post, comb)
        post, comb, x = self.ffn_hc(h, norm=self.post_attention_layernorm)
        if self.mlp.tp.size > 1:  # the routed + shared sum is all-reduced first
            return hc_residual(h, self.mlp(x, step.input_ids), post, comb)
        routed, shared = self.mlp.parts(x, step.input_ids)
        return hc_residual(h, routed, post, comb, shared)  # their sum inside hc_post


class DeepseekV4Model(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        v4 = config.v4
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(V4DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config.hidden_size, v4.hc_mult, v4.hc_eps, config.rms_norm_eps)
        self.mtp = nn.ModuleList()  # the MTP layer, when added (mtp.py)


class DeepseekV4ForCausalLM(nn.Module):
    supports_mtp = True  # add_mtp, forward_mtp, compute_mtp_logits, mtp_source
    # graphs need a forward without host syncs: the pool path has none, and the routed experts
    # run in one kernel a layer (fused_moe with V4's clamp, or fused_moe_fp4)
    supports_cuda_graphs = True
    verify_as_chunks = True  # verify steps of equal chunks replay graphs of chunks (engine/cuda_graphs.py)
    last_streams: torch.Tensor | None = None  # [T, N, hidden] of the last forward, with the MTP layer

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        if config.v4 is None:
            raise ValueError(f"DeepseekV4ForCausalLM needs a deepseek_v4 config, got {config.model_type!r}")
        self.config = config
        self.tp = tp or TPGroup.single()
        self.num_layers = config.num_hidden_layers
        self.fp4_experts = fp4_experts(config)
        self.model = DeepseekV4Model(config, self.tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = {
            "main": RotaryEmbedding(config.v4.main_rope, config.qk_rope_head_dim),
            "compress": RotaryEmbedding(config.v4.compress_rope, config.qk_rope_head_dim),
        }
        v4 = config.v4
        self.rates = tuple({v4.compress_rate(i) for i, t in enumerate(v4.layer_types) if t == k} for k in (CSA, HCA))
        self.tie_weights()

    def add_mtp(self) -> None:
        """Append the MTP layer (built where the model is: on meta before a load)."""
        if self.mtp is None:
            self.model.mtp.append(mtp_layer(self.config, self.tp, V4DecoderLayer))
            self.num_layers = self.config.num_hidden_layers + 1

    @property
    def mtp(self) -> nn.Module | None:
        return self.model.mtp[0] if len(self.model.mtp) else None

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def kv_cache_specs(self, kv_cache_dtype: str = "auto") -> list[KVRegionSpec]:
        """The KV pool's regions (cache.py)."""
        return kv_cache_specs(self.config, kv_cache_dtype)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Every token of the batch (on the model's device) -> final-normed hidden [T, hidden];
        writes what each sequence's cache gains into kv_cache (cache.py's regions)."""
        step = self.step(batch)
        ids = step.input_ids[:, None].expand(-1, self.config.v4.hc_mult)  # [T, N]: each stream starts as the embedding
        h = self.model.embed_tokens(ids)  # [T, N, hidden], one gather
        for i, layer in enumerate(self.model.layers):
            h = layer(h, step, kv_cache, i)
        self.last_streams = h if self.mtp is not None else None
        return self.model.hc_head(h, norm=self.model.norm)

    def mtp_source(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the MTP layer pairs with the next tokens, for the step whose final hidden [T, hidden]
        is `hidden`: that step's residual streams [T, N, hidden] before hc_head."""
        streams = self.last_streams
        if streams is None or streams.shape[0] != hidden.shape[0]:
            raise RuntimeError("the MTP layer's input needs the last step's streams")
        return streams

    @torch.no_grad()
    def forward_mtp(self, batch: ForwardBatch, kv_cache: KVCache, prev: torch.Tensor) -> torch.Tensor:
        """The MTP layer over the batch (input_ids: the next tokens; prev [T, N, hidden]: the streams
        they pair with); writes its window records; returns its streams [T, N, hidden]."""
        step = self.step_builder(batch)(batch, self.rotary, self.config.v4.sliding_window, set(), set())  # window only
        return mtp_forward(self.mtp, self.model.embed_tokens, step, kv_cache, self.config.num_hidden_layers, prev)

    @torch.no_grad()
    def compute_mtp_logits(self, g: torch.Tensor) -> torch.Tensor:
        """MTP streams [N', N, hidden] -> draft logits [N', V] float32."""
        return mtp_logits(self.mtp, self.lm_head, g)

    def step(self, batch: ForwardBatch) -> V4Step:
        """The step's metadata."""
        return self.step_builder(batch)(batch, self.rotary, self.config.v4.sliding_window, *self.rates)

    def step_builder(self, batch: ForwardBatch):
        """What builds the step's metadata: on the Triton path a decode step's kernels
        (kernels/v4_step.py) or, for chunks, kernels/v4_chunk_step.py's (up to its bound on the
        sequences); else step.py."""
        if fused_decode_step(batch, self.rotary):
            return build_decode_step
        return build_chunk_step if fused_chunk_step(batch, self.rotary) else build_step

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, V] float32."""
        return self.lm_head(hidden).float()
