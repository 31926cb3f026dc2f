"""Prefix caching on a device: for each tiny model (V3, V3.2, V4), greedy tokens of prompts that share
prefixes (ending inside a block, at a block boundary, a repeat, a conversation's next turn) with the
cache on equal those with it off, the decode steps through CUDA graphs; prints the cached tokens per
prompt, the prefill tokens computed with and without the cache, and the host's hashing cost.

    python -m benchmarks.engine.check_prefix_cache [--device cuda] [--dtype float32]

Exits 1 when any prompt's tokens differ. float32 by default: a hit computes the rest of the prompt
in another chunk than a cold prefill, so in bf16 the sums round differently and a near tie can flip.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.engine.prefix_cache import block_hashes, root_hash  # noqa: E402
from pdserve.tiny_model import make_tiny_model  # noqa: E402

BS, NEW = 16, 16


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    p = torch.randint(4, vocab, (200,), generator=g).tolist()
    tail = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (9, 7, 30)]
    return [p[:150], p[:70] + tail[0], p[:70] + tail[1], p[:96] + tail[2], p[:150], p[:200]]


def run(llm: LLM, ps: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return [llm.generate(prompt_token_ids=[p], sampling_params=params)[0] for p in ps]


def check(arch: str, device: str, dtype: str, root: str) -> bool:
    path = str(make_tiny_model(os.path.join(root, arch), arch=arch, seed=0))
    kw = dict(device=device, dtype=dtype, kv_block_size=BS, skip_tokenizer_init=True, max_num_batched_tokens=64)
    warm, cold = LLM(path, **kw), LLM(path, enable_prefix_caching=False, **kw)
    ps = prompts(warm.engine.runner.model.config.vocab_size)
    first = run(warm, ps[:1])[0]
    ps.append(ps[0] + first.outputs[0].token_ids + ps[1][-9:])  # the next turn of a conversation
    hot, ref = run(warm, ps), run(cold, ps)
    same = [h.outputs[0].token_ids == r.outputs[0].token_ids for h, r in zip(hot, ref)]
    cached = [h.num_cached_tokens for h in hot]
    total = sum(len(p) for p in ps)
    print(
        f"{arch:18s} tokens equal: {all(same)} {same}\n{'':18s} cached per prompt: {cached}; "
        f"prefill tokens computed {total - sum(cached)} of {total}"
    )
    return all(same)


def hashing_cost() -> None:
    tokens = list(range(100_000, 100_000 + 2**16))
    for bs in (64, 128):
        t0 = time.perf_counter()
        block_hashes(root_hash("check"), tokens, bs)
        print(f"hashing, blocks of {bs}: {(time.perf_counter() - t0) * 1e6 / 64:.1f} us per 1K tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        ok = [check(a, args.device, args.dtype, root) for a in ("deepseek_v3", "deepseek_v32", "deepseek_v4")]
    hashing_cost()
    sys.exit(0 if all(ok) else 1)


if __name__ == "__main__":
    main()
