"""Engine configuration: validated data, resolved against the checkpoint when the engine starts."""

from __future__ import annotations

import json
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.engine.spec_decode.config import SpeculativeConfig

DType = Literal["float32", "bfloat16", "float16", "auto"]
# decode: what a failed KV load does (vLLM's name): fail the request, or compute the prompt here
KVLoadFailurePolicy = Literal["fail", "recompute"]
# where the weights come from (vLLM's name): "auto" the checkpoint's files, "dummy" random weights
# made in memory from its config.json alone (model/dummy.py; benchmarks, no checkpoint to write)
LoadFormat = Literal["auto", "dummy"]
KVCacheDType = Literal["auto", "fp8"]
# the weights' format (vLLM's flag name): None follows the checkpoint's quantization_config (FP8
# block-scaled: kept FP8 on the device); "fp8" requires FP8 weights (load_format dummy: makes
# them); "none" dequantizes FP8 checkpoints at load into `dtype` (debugging). model/fp8.py.
Quantization = Literal["fp8", "none"]
# FP4 experts (V4): "w4a16" (FP4 weights x 16-bit activations), "mxfp8" (activations quantized to
# MXFP8, block-scaled e4m3 MMAs: sm_120's FP4-era tensor cores), "auto" (kernels/configs.py, per GPU)
Fp4MoEBackend = Literal["auto", "w4a16", "mxfp8"]
# the engine's part in KV transfer (vLLM's kv_role): kv_consumer is a decode worker, whose prompts'
# KV is loaded from a prefill worker; kv_producer a prefill worker; kv_both anything else
KVRole = Literal["kv_both", "kv_producer", "kv_consumer"]


def check_device(d: str) -> str:
    if d != "cpu" and d != "cuda" and not (d.startswith("cuda:") and d[5:].isdigit()):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {d!r}")
    return d


# KV memory on CPU when neither num_kv_blocks nor kv_cache_memory_gb is given (CUDA plans the pool
# in gpu_memory_utilization of the GPU: engine/memory.py). Capped by what max_num_seqs sequences of
# max_model_len tokens could ever use.
DEFAULT_CPU_KV_GB = 1.0


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str  # checkpoint folder
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    # ranks of one engine (vLLM's name): rank r runs on cuda:N+r (N from device) or on the CPU
    # (gloo). Rank 0 is this process; it starts ranks 1.. itself (pdserve.engine.tp_ranks).
    tensor_parallel_size: int = Field(1, ge=1)
    dtype: DType = "auto"  # auto: the checkpoint's torch_dtype on CUDA, float32 on CPU
    load_format: LoadFormat = "auto"
    kv_block_size: int = Field(64, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    # CUDA: the share of the WHOLE GPU this engine may use (vLLM's meaning): weights, profiled peak
    # activations and the KV pool together; several engines on one GPU each take their share
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # device memory taken outside the pool after it is sized (the KV transfer's staging / landing
    # arenas: set by the worker from transfer.staging), kept out of the gpu_memory_utilization budget
    reserved_memory_mib: int = Field(0, ge=0)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)  # token budget per step; longer prompts are chunked
    max_model_len: int | None = Field(None, ge=2)  # None: min(max_position_embeddings, KV capacity)
    seed: int = 0
    skip_tokenizer_init: bool = False
    # torch intra-op threads on CPU (process-wide; None: torch's default). Small models on a busy
    # machine run far faster with 1: spinning threads of several processes fight for the cores.
    cpu_threads: int | None = Field(None, ge=1)
    # "raw_logprobs": log_softmax of the model's logits before penalties/temperature/filters
    # (vLLM V1's default); "processed_logprobs": of the logits the token was sampled from.
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    # CUDA graphs for decode steps (engine/cuda_graphs.py); enforce_eager turns them off (vLLM's
    # name), cuda_graph_max_bs is the largest batch captured (SGLang's; default min(max_num_seqs, 256))
    enforce_eager: bool = False
    # the overlapped loop (vLLM's async scheduling; llm_engine.py): step n + 1 launched before step
    # n's tokens are read. None: on CUDA devices, off on the CPU (where nothing runs beside the host)
    async_scheduling: bool | None = None
    cuda_graph_max_bs: int | None = Field(None, ge=1)
    # the KV records (vLLM's name): "auto" = the model dtype; "fp8" = FP8 e4m3 latent records with
    # per-128 scales (656 bytes a token-layer for V3 / V3.2, kernels/kv_fp8.py)
    kv_cache_dtype: KVCacheDType = "auto"
    # weights kept as the checkpoint ships them (None), FP8 ("fp8"), or dequantized ("none"); the
    # KV layout does not depend on it, so it is not part of the KV compatibility hash
    quantization: Quantization | None = None
    # the kernel path of FP4 routed experts (Fp4MoEBackend; docs/kernels.md says which GPU runs which)
    fp4_moe_backend: Fp4MoEBackend = "auto"
    # automatic prefix caching (vLLM's name): full KV blocks kept by a hash of their tokens and
    # reused by later requests with the same prefix (engine/prefix_cache.py)
    enable_prefix_caching: bool = True
    # set by a PD worker from its role. A kv_consumer's prefix cache reuses blocks for loads and
    # keeps no DeepSeek-V4 checkpoints: each load brings the window and compressor state
    kv_role: KVRole = "kv_both"
    # speculative decoding (vLLM's name and shape): {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": .., "prompt_lookup_max": ..}; engine/spec_decode/
    speculative_config: SpeculativeConfig | None = None

    @field_validator("device")
    @classmethod
    def _device(cls, d: str) -> str:
        return check_device(d)

    @field_validator("model")
    @classmethod
    def _model_dir(cls, m: str) -> str:
        if not os.path.isfile(os.path.join(m, "config.json")):
            raise ValueError(f"model folder {m!r} has no config.json")
        return m

    def checkpoint_dtype(self) -> str | None:
        """The checkpoint's declared dtype (transformers 5 writes `dtype`, older ones `torch_dtype`)."""
        with open(os.path.join(self.model, "config.json")) as f:
            cfg = json.load(f)
        return cfg.get("dtype") or cfg.get("torch_dtype")

    def generation_config(self) -> dict:
        path = os.path.join(self.model, "generation_config.json")
        if not os.path.isfile(path):
            return {}
        with open(path) as f:
            return json.load(f)

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        if self.device == "cpu":
            return "float32"
        ckpt = self.checkpoint_dtype()
        return ckpt if ckpt in ("float32", "bfloat16", "float16") else "bfloat16"
