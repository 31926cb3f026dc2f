"""`make_tiny_model`: a small random DeepSeek-V3 / V3.2 / V4 checkpoint folder.

No weights can be downloaded where pdserve is tested, so this writes a checkpoint that
both pdserve and transformers 5.24 load: config.json, model.safetensors (float32, named as
transformers' save_pretrained names them, per-expert weights), tokenizer.json (byte-level
BPE, so any UTF-8 text round-trips; every architecture with its MTP layer, as DeepSeek ships it), tokenizer_config.json (special tokens and a
DeepSeek-style chat template; deepseek_v4 has none, as its release), special_tokens_map.json
and generation_config.json.

Everything is deterministic: the same (arch, seed) gives byte-identical files. The seed
only changes the weights; the tokenizer is trained on a fixed text (tokenizer.py).

    tokenizer.py  the byte-level BPE, special tokens, chat template
    weights.py    config.json and random weights per architecture; quantize_tiny_v4
    v4_mtp.py     V4's MTP layer under the release's names
"""

import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.tiny_model.tokenizer import (
    ASSISTANT,
    BOS,
    CHAT_TEMPLATE,
    EOS,
    SPECIAL_TOKENS,
    USER,
    build_tokenizer,
    tokenizer_config,
)
from pdserve.tiny_model.v4_mtp import tiny_v4_mtp_weights
from pdserve.tiny_model.weights import (
    quantize_tiny_v4,
    tiny_config,
    tiny_mtp_weights,
    tiny_v4_config,
    tiny_v4_weights,
    tiny_weights,
    write_json,
)

ARCHS = ("deepseek_v3", "deepseek_v32", "deepseek_v4")
VOCAB_MULTIPLE = 128  # config vocab_size is padded past the tokenizer, as DeepSeek's is

__all__ = [
    "ARCHS", "ASSISTANT", "BOS", "CHAT_TEMPLATE", "EOS", "SPECIAL_TOKENS", "USER", "build_tokenizer", "make_tiny_model",
    "quantize_tiny_v4", "tiny_config", "tiny_mtp_weights", "tiny_v4_config", "tiny_v4_mtp_weights", "tiny_v4_weights", "tiny_weights",
]  # fmt: skip


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "deepseek_v3",
    seed: int = 0,
    overrides: dict | None = None,
    dtype: str = "float32",
    device: str = "cpu",
) -> Path:
    """Write a tiny random `arch` checkpoint into `out_dir` (created if missing); return its path.
    overrides: config.json keys to change (e.g. {"kv_lora_rank": 128} for FP8 KV records, or real
    layer dimensions for a mid-size model);
    dtype: of the weights (float32 or bfloat16); device: where DeepSeek-V3 / V3.2 weights are
    drawn (cuda draws a mid-size model in seconds; other values than on cpu, same per device)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(ARCHS)}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(arch)
    vocab_size = math.ceil(tokenizer.get_vocab_size() / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = tiny_v4_config(vocab_size) if arch == "deepseek_v4" else tiny_config(arch, vocab_size)
    unknown = sorted(set(overrides or {}) - set(config))
    if unknown:
        raise ValueError(f"unknown config keys for {arch}: {', '.join(unknown)}")
    config.update(overrides or {}, dtype=dtype)
    if arch == "deepseek_v4":
        weights = tiny_v4_weights(config, seed)
        if config["num_nextn_predict_layers"]:
            weights.update(tiny_v4_mtp_weights(config, seed))
    else:
        weights = tiny_weights(config, seed, device)
        if config["num_nextn_predict_layers"]:
            weights.update(tiny_mtp_weights(config, weights, seed, device))
    weights = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v).cpu() for k, v in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    write_json(out / "config.json", config)
    write_json(out / "tokenizer_config.json", tokenizer_config(arch))
    write_json(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS})
    write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1})
    return out
