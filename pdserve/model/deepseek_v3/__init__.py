"""DeepSeek-V3 and V3.2 (model_type deepseek_v3 / deepseek_v32): config, MLA attention with V3.2's
lightning indexer, the MoE, the causal LM, its KV cache regions and its checkpoint loader.
Found through pdserve/model/registry.py; shared layers live in pdserve/model/."""
