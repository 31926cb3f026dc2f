"""DeepSeek-V4 (model_type deepseek_v4): config, shared-KV attention over a sliding window and
compressed entries (compressor.py: the CSA / HCA compressors and the indexer), hash / routed MoE,
hyper-connections, the per-step pool indices (step.py), the causal LM, its KV cache regions and
its checkpoint loader. Found through pdserve/model/registry.py; shared layers live in pdserve/model/."""
