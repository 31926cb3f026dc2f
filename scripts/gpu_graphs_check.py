"""CUDA graphs against eager decode on a GPU: the same greedy tokens, and the decode time of each.

    python scripts/gpu_graphs_check.py [--device cuda:0] [--dtypes bfloat16,float32] [--verify-k 1,3] [--out DIR]

For each tiny architecture (DeepSeek-V3, V3.2, V4) this writes the checkpoint, runs 8
prompts x 32 greedy tokens (EOS ignored, one continuous batch) through `pdserve.LLM` twice, with
CUDA graphs (the default) and with `enforce_eager=True`, and prints per prompt the first token
that differs, and the wall time of the generate call (after a warm-up generate on each engine);
where a prompt differs, the eager run's gap between its two most likely tokens at that step (a
near tie is what rounding flips; the median gap over all tokens for scale).
With --verify-k, also for each architecture and k: the same with speculative decoding (V3 and
V3.2: n-gram drafts, k a step; V4: its MTP layer's, k a step, so that most verify steps have
chunks of one length), whose verify steps replay graphs too (engine/cuda_graphs.py: V3/V3.2 a
chunk's tokens as decode rows, V4 graphs of equal chunks): graphs against eager with drafts, and
against eager without them; the row counts the verify steps and how many of them the graphs
replayed (it must be > 0).
Writes graphs_check.json to --out. Exit status 1 if a float32 run differs or a graphed run
replayed no verify step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.tiny_model import make_tiny_model

NEW_TOKENS = 32


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 200, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 5, 64, 12, 40)]


def margins(out) -> list[float]:
    """Per generated token: the log-prob gap between the two most likely tokens (small: a near tie)."""
    gaps = []
    for step in out.outputs[0].logprobs:
        top = sorted((lp.logprob for lp in step.values()), reverse=True)
        gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return gaps


def speculative(arch: str, k: int) -> dict:
    """V4: MTP drafts (k a step: chunks of one length); V3/V3.2: n-gram drafts."""
    if arch == "deepseek_v4":
        return {"method": "mtp", "num_speculative_tokens": k}
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def count_verify_replays(llm) -> list[int]:
    """Counts the verify steps (steps that sample, with more tokens than sequences) and the
    runner's graph replays of them: [replayed, all]."""
    runner, seen = llm.engine.runner, [0, 0]
    prepare, graphs = runner.prepare, runner.graphs

    def prepared(sched):
        step, sampling = prepare(sched)
        verify = step.input_ids.numel() > step.lens.numel() and bool(step.samples.all())
        seen[1] += verify
        seen[0] += verify and graphs is not None and graphs.fits(step)
        return step, sampling

    runner.prepare = prepared
    return seen


def run(
    path: str, device: str, dtype: str, eager: bool, k: int = 0, arch: str = ""
) -> tuple[list[list[int]], float, bool, list[list[float]], list[int]]:
    llm = LLM(
        path,
        device=device,
        dtype=dtype,
        kv_block_size=16,
        kv_cache_memory_gb=0.25,
        skip_tokenizer_init=True,
        enforce_eager=eager,
        **({"speculative_config": speculative(arch, k)} if k else {}),
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    llm.generate(prompt_token_ids=prompts(), sampling_params=params)  # warm-up
    verify_replays = count_verify_replays(llm)  # [replayed, all] of the timed run's verify steps
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=params)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    graphs = llm.engine.runner.graphs is not None
    used = llm.engine.get_stats().kv_blocks_used
    if used:
        raise RuntimeError(f"{used} KV blocks still in use after every request finished")
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, took, graphs, [margins(o) for o in outs], verify_replays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--archs", default="deepseek_v3,deepseek_v32,deepseek_v4")
    ap.add_argument("--verify-k", default="", help="comma-separated k: also compare with speculation (V4: MTP)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows, bad = [], False
    with tempfile.TemporaryDirectory() as root:
        for arch in args.archs.split(","):
            path = str(make_tiny_model(os.path.join(root, arch), arch=arch, seed=0))
            for dt in args.dtypes.split(","):
                g_tok, g_s, used_graphs, _, _ = run(path, args.device, dt, eager=False)
                e_tok, e_s, _, e_gap, _ = run(path, args.device, dt, eager=True)
                div = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(g_tok, e_tok)]
                # where a run differs: how close eager's top two tokens were there (a near tie flips on rounding)
                tie = [None if d is None else e_gap[p][d] for p, d in enumerate(div)]
                same = sum(d is None for d in div)
                bad |= dt == "float32" and same != len(div) or not used_graphs
                rows.append(
                    dict(
                        arch=arch,
                        dtype=dt,
                        graphs_used=used_graphs,
                        identical=same,
                        first_divergence=div,
                        eager_top2_gap_at_divergence=tie,
                        median_top2_gap=sorted(g for gs in e_gap for g in gs)[len(e_gap) * NEW_TOKENS // 2],
                        graphs_s=g_s,
                        eager_s=e_s,
                        tokens=len(div) * NEW_TOKENS,
                    )
                )
                print(
                    f"{arch:<13} {dt:<9} graphs={used_graphs} agree {same}/{len(div)} "
                    f"{' '.join('-' if d is None else str(d) for d in div)}  generate: graphs {g_s * 1e3:.0f} ms, "
                    f"eager {e_s * 1e3:.0f} ms ({e_s / g_s:.2f}x)",
                    flush=True,
                )
                if same != len(div):
                    print(
                        f"    eager's top-2 log-prob gap where they differ: {' '.join('-' if t is None else f'{t:.4f}' for t in tie)} "
                        f"(median gap over all tokens {rows[-1]['median_top2_gap']:.3f})",
                        flush=True,
                    )
            for k in [int(k) for k in args.verify_k.split(",") if k.strip()]:
                bad |= check_verify(path, arch, args.device, k, args.dtypes.split(","), rows)
    doc = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        new_tokens=NEW_TOKENS,
        rows=rows,
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "graphs_check.json"), "w") as f:
        json.dump(doc, f, indent=1)
    sys.exit(1 if bad else 0)


def check_verify(path: str, arch: str, device: str, k: int, dtypes: list[str], rows: list[dict]) -> bool:
    """Graphs with drafts against eager with and without drafts; True when it failed."""
    bad = False
    for dt in dtypes:
        g_tok, g_s, used_graphs, _, (replays, steps) = run(path, device, dt, eager=False, k=k, arch=arch)
        e_tok, e_s, _, _, _ = run(path, device, dt, eager=True, k=k, arch=arch)
        plain, _, _, _, _ = run(path, device, dt, eager=True)
        same = sum(a == b for a, b in zip(g_tok, e_tok))
        same_plain = sum(a == b for a, b in zip(g_tok, plain))
        bad |= not used_graphs or replays == 0 or dt == "float32" and (same != len(g_tok) or same_plain != len(g_tok))
        rows.append(dict(arch=arch, dtype=dt, verify_k=k, graphs_used=used_graphs, verify_replays=replays,
                         verify_steps=steps, identical=same, identical_to_plain=same_plain, graphs_s=g_s,
                         eager_s=e_s))  # fmt: skip
        print(
            f"{arch:<13} {dt:<9} k={k} graphs={used_graphs} verify steps replayed {replays}/{steps}: graphs == eager "
            f"{same}/{len(g_tok)}, == no speculation {same_plain}/{len(g_tok)}; generate: graphs {g_s * 1e3:.0f} ms, "
            f"eager {e_s * 1e3:.0f} ms",
            flush=True,
        )
    return bad


if __name__ == "__main__":
    main()
