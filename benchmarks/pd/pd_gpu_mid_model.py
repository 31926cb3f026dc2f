"""A mid-size random checkpoint for `benchmarks/pd/pd_gpu_bench.sh` (docs/pd-gpu.md) and
`prefix_cache_bench.sh` (docs/benchmarking.md), without its weights:
a tiny DeepSeek-V3 checkpoint (tokenizer, config) whose config.json gets V3's layer dimensions; the
workers then draw the weights themselves (`load_format: dummy`), in seconds instead of a 6.4 GiB
write and three reads.

    python -m benchmarks.pd.pd_gpu_mid_model /tmp/mid
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pdserve.tiny_model import make_tiny_model

# DeepSeek-V3's layer dimensions, 4 layers (docs/pd-gpu.md)
MID = dict(
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=16, num_experts_per_tok=8, n_group=8, topk_group=4,
    max_position_embeddings=16384,  # room for prefix_cache_bench.sh's 8K-token conversations (the tiny has 4096)
)  # fmt: skip


def main(out_dir: str) -> None:
    make_tiny_model(out_dir, dtype="bfloat16")
    path = Path(out_dir) / "config.json"
    config = json.loads(path.read_text())
    unknown = sorted(set(MID) - set(config))
    if unknown:
        raise SystemExit(f"the tiny config has no {unknown}")
    config.update(MID)
    path.write_text(json.dumps(config, indent=2))
    print(json.dumps({k: config[k] for k in ("num_hidden_layers", "first_k_dense_replace", "vocab_size", *MID)}))


if __name__ == "__main__":
    main(sys.argv[1])
