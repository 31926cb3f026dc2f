"""Speculative decoding on a GPU: greedy tokens with drafts against the same engine without.

    python scripts/gpu_spec_check.py [--device cuda] [--archs deepseek_v32,deepseek_v3]
        [--dtypes float32,bfloat16] [--methods mtp,ngram] [--ks 1,2,3] [--out DIR]

For each tiny checkpoint (`pdserve.tiny_model`, V3 / V3.2 / V4 with their MTP layer) and dtype, runs 8
prompts x 32 greedy tokens (EOS ignored, one continuous batch) through `pdserve.LLM` without
speculation (decode steps as CUDA graphs), then with each method and k (verify steps eager; MTP's
layer after every step), and prints per run the prompts whose tokens differ (first differing
index), the drafts and accepted tokens (random weights accept about none: this checks exactness,
not speed) and the KV blocks left in use. float32 must agree on every token; bfloat16 rows are
printed the same way (a verify chunk's attention and the graphed decode step round differently,
so a bfloat16 near-tie may flip: the report says where). Writes spec_check.json to --out
(default $OUT or the working directory). Exit status 1 if a float32 run differs or leaks a block.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from pdserve import LLM, SamplingParams
from pdserve.tiny_model import make_tiny_model

PROMPTS = [
    [(7 * i + 3) % 500 + 2 for i in range(40)],
    [9, 8, 7] * 6,
    list(range(10, 90)),
    [50, 51] * 9,
    [(13 * i) % 300 + 5 for i in range(5)],
    [42] * 12,
    [(3 * i * i) % 400 + 2 for i in range(150)],
    [100, 200, 300, 400, 500] * 4,
]
NEW_TOKENS = 32


def run(path: str, device: str, dtype: str, spec: dict | None) -> dict:
    llm = LLM(
        path, device=device, dtype=dtype, kv_block_size=16, kv_cache_memory_gb=0.25, skip_tokenizer_init=True,
        **({"speculative_config": spec} if spec else {}),
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    seconds = time.perf_counter() - t
    s = llm.engine.spec.stats if llm.engine.spec is not None else None
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "seconds": round(seconds, 2),
        "blocks_left": llm.engine.get_stats().kv_blocks_used,
        "drafts": s.num_drafts if s else 0,
        "draft_tokens": s.num_draft_tokens if s else 0,
        "accepted": s.num_accepted_tokens if s else 0,
    }


def differs(a: list[list[int]], b: list[list[int]]) -> dict[int, int]:
    """prompt index -> first differing token index, for the prompts that differ."""
    out = {}
    for p, (x, y) in enumerate(zip(a, b)):
        i = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
        if i is not None or len(x) != len(y):
            out[p] = i if i is not None else min(len(x), len(y))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--archs", default="deepseek_v32,deepseek_v3")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--methods", default="mtp,ngram")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    rows, bad = [], False
    with tempfile.TemporaryDirectory() as root:
        for arch in a.archs.split(","):
            path = str(make_tiny_model(os.path.join(root, arch), arch))
            for dtype in a.dtypes.split(","):
                plain = run(path, a.device, dtype, None)
                print(f"{arch} {dtype} plain: {plain['seconds']}s, {plain['blocks_left']} blocks left", flush=True)
                for method in a.methods.split(","):
                    for k in map(int, a.ks.split(",")):
                        spec = {"method": method, "num_speculative_tokens": k}
                        if method == "ngram":
                            spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
                        r = run(path, a.device, dtype, spec)
                        diff = differs(plain["tokens"], r["tokens"])
                        fail = dtype == "float32" and (diff or r["blocks_left"])
                        bad |= bool(fail)
                        print(
                            f"{arch} {dtype} {method} k={k}: {'EQUAL' if not diff else f'DIFFERS {diff}'}, "
                            f"{r['drafts']} drafts / {r['draft_tokens']} draft tokens / {r['accepted']} accepted, "
                            f"{r['blocks_left']} blocks left, {r['seconds']}s{'  <-- FAIL' if fail else ''}",
                            flush=True,
                        )
                        rows.append({"arch": arch, "dtype": dtype, "method": method, "k": k, "differs": diff,
                                     **{key: v for key, v in r.items() if key != "tokens"}})  # fmt: skip
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "spec_check.json"), "w") as f:
        json.dump({"device": a.device, "new_tokens": NEW_TOKENS, "runs": rows}, f, indent=1)
    print("FAIL" if bad else "OK: every float32 run equals plain decoding")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
