"""Speculative decoding's exactness on a GPU: greedy tokens with drafts equal those without.

    python scripts/gpu_spec_v4_check.py [--device cuda] [--archs deepseek_v4,deepseek_v32] [--dtype float32]
        [--tokens 64] [--out DIR]

For each tiny architecture this runs 8 prompts (some repeating themselves, so n-gram lookups hit)
x --tokens greedy tokens (EOS ignored) through `pdserve.LLM` without speculation (decode steps as CUDA
graph replays, V4's compressors through the decode kernel), then the same engine with
`speculative_config` for k = 1, 2, 3 (verify steps replay CUDA graphs where they fit:
engine/cuda_graphs.py), each with two proposers:

- `ngram`: the method users run (random weights accept few drafts);
- `mixed`: the run without drafts' own tokens with one draft made wrong at a place cycling over
  0..k (none wrong every k + 1-th time), so every accepted length occurs: on V4 a rejection
  sometimes keeps the verify chunk's new compressor state and sometimes recomputes the accepted
  tokens (engine/spec_decode/spare_states.py).

Printed per run: the first token index where a prompt's tokens differ from the run without drafts
(none: equal), drafts, acceptance, V4's recomputes; blocks and state slots left in use must be 0.
Writes spec_v4_check.json to --out (default $OUT or the working directory). Exit status 1 if a float32
run differs or leaks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from pdserve import LLM, SamplingParams
from pdserve.tiny_model import make_tiny_model

PROMPTS = [
    [7, 21, 33, 42, 5] * 4,
    [9, 8, 7] * 6 + [1],
    [50, 51] * 10,
    list(range(10, 50)),
    [3, 4, 5],
    list(range(100, 117)) * 2,
    [11] * 9,
    list(range(200, 231)),
]
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}


class Mixed:
    """The expected tokens, one draft wrong at (call count) % (k + 1) (k: all right)."""

    def __init__(self, expected: dict[tuple, list[int]], vocab: int, k: int) -> None:
        self.expected, self.vocab, self.k, self.calls = expected, vocab, k, {}

    def propose(self, seq, limit: int) -> list[int]:
        key, n = tuple(seq.prompt_token_ids), seq.num_output_tokens
        self.calls[key] = self.calls.get(key, -1) + 1
        bad = self.calls[key] % (self.k + 1)
        return [t if i != bad else (t + 1) % self.vocab for i, t in enumerate(self.expected[key][n : n + limit])]


def run(path: str, device: str, dtype: str, n: int, k: int | None, proposer: str | None, plain=None) -> dict:
    spec = {"speculative_config": {**NGRAM, "num_speculative_tokens": k}} if k else {}
    llm = LLM(
        path, device=device, dtype=dtype, kv_block_size=16, kv_cache_memory_gb=0.25, skip_tokenizer_init=True, **spec
    )
    if proposer == "mixed":
        vocab = llm.engine.runner.model.config.vocab_size
        llm.engine.spec.proposer = Mixed({tuple(p): t for p, t in zip(PROMPTS, plain)}, vocab, k)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    s = llm.engine.get_stats()
    out = {"tokens": tokens, "leaked": s.kv_blocks_used + s.kv_window_blocks_used + s.kv_state_slots_used}
    if k:
        st, spare = llm.engine.spec.stats, llm.engine.spec.spare
        out |= {"drafts": st.num_drafts, "draft_tokens": st.num_draft_tokens, "accepted": st.num_accepted_tokens,
                "recomputes": spare.num_recomputes if spare is not None else 0}  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--archs", default="deepseek_v4,deepseek_v32")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    report, ok = {}, True
    with tempfile.TemporaryDirectory() as root:
        for arch in args.archs.split(","):
            path = str(make_tiny_model(os.path.join(root, arch), arch=arch, seed=0))
            plain = run(path, args.device, args.dtype, args.tokens, None, None)
            report[arch] = {"plain": plain}
            for k in (1, 2, 3):
                for proposer in ("ngram", "mixed"):
                    r = run(path, args.device, args.dtype, args.tokens, k, proposer, plain["tokens"])
                    diverge = [next((i for i, (a, b) in enumerate(zip(s, t)) if a != b), None)
                               for s, t in zip(r["tokens"], plain["tokens"])]  # fmt: skip
                    r["first_divergence"] = diverge
                    report[arch][f"k{k}-{proposer}"] = r
                    good = all(d is None for d in diverge) and r["leaked"] == 0
                    ok &= good or args.dtype != "float32"
                    print(f"{arch} {args.dtype} k={k} {proposer:5}: first divergence {diverge}, drafts {r['drafts']}, "
                          f"accepted {r['accepted']}/{r['draft_tokens']}, recomputes {r['recomputes']}, "
                          f"leaked {r['leaked']} -> {'OK' if good else 'DIFFERS'}")  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "spec_v4_check.json"), "w") as f:
        json.dump(report, f)
    print("all equal" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
