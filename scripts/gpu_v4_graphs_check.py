"""DeepSeek-V4 decode as CUDA graphs against eager on a GPU: the same greedy tokens, and the time.

    python scripts/gpu_v4_graphs_check.py [--device cuda:0] [--dtypes float32,bfloat16] [--out DIR]

The tiny V4 checkpoint, 8 prompts x 32 greedy tokens (EOS ignored, one continuous batch) through
the engine twice: decode graphs captured (sizes up to 16) and `enforce_eager`. Both engines run
the same model, whose bf16 routed experts are swapped for an equal sum without a host sync:
v4_moe.Experts loops over `ids.unique().tolist()`, which no graph can capture (FP4 experts run in
a kernel and need no swap; this check is about the attention, compressor and pool path). Writes
v4_graphs_check.json to --out. Exit status 1 if a float32 run differs or graphs were not used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.model.v4_loader import load_v4_model
from pdserve.model.v4_moe import _swiglu
from pdserve.model.v4_paged import PagedDeepseekV4
from pdserve.sampling_params import SamplingParams
from pdserve.tiny_model import make_tiny_model

NEW_TOKENS = 32


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 200, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 5, 64, 12, 40)]


def sync_free_experts(experts: torch.nn.Module) -> None:
    """Every expert over every token, weighted by its routing weight (0 where not chosen)."""

    def forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        E = experts.gate_up_proj.shape[0]
        w = torch.zeros(x.shape[0], E, dtype=weights.dtype, device=x.device).scatter_add_(1, ids, weights)  # [T, E]
        gate, up = torch.einsum("th,eih->tei", x, experts.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("tei,ehi->teh", _swiglu(gate, up, experts.limit), experts.down_proj)  # [T, E, hidden]
        return (y * w[..., None].to(y.dtype)).sum(1).to(x.dtype)

    experts.forward = forward


def run(path: str, device: str, dtype: str, eager: bool) -> tuple[list[list[int]], float, bool]:
    model = PagedDeepseekV4(load_v4_model(path, getattr(torch, dtype), torch.device(device)))
    for layer in model.model.model.layers:
        sync_free_experts(layer.mlp.experts)
    model.supports_cuda_graphs = True
    cfg = EngineConfig(model=path, device=device, dtype=dtype, kv_block_size=16, kv_cache_memory_gb=0.25,
                       skip_tokenizer_init=True, enforce_eager=eager, cuda_graph_max_bs=16, max_model_len=256)
    eng = LLMEngine(cfg, model=model)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def generate(tag: str) -> list[list[int]]:
        for i, p in enumerate(prompts()):
            eng.add_request(Request(request_id=f"{tag}{i}", prompt_token_ids=p, params=params))
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        return [done[f"{tag}{i}"] for i in range(len(prompts()))]

    generate("warm")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = generate("run")
    torch.cuda.synchronize()
    stats = eng.get_stats()
    if stats.kv_blocks_used or stats.kv_window_blocks_used or stats.kv_state_slots_used:
        raise RuntimeError(f"blocks still in use after every request finished: {stats}")
    return tokens, time.perf_counter() - t0, eng.runner.graphs is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows, bad = [], False
    with tempfile.TemporaryDirectory() as root:
        path = str(make_tiny_model(os.path.join(root, "v4"), arch="deepseek_v4", seed=0))
        for dt in args.dtypes.split(","):
            g_tok, g_s, used = run(path, args.device, dt, eager=False)
            e_tok, e_s, _ = run(path, args.device, dt, eager=True)
            div = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(g_tok, e_tok)]
            same = sum(d is None for d in div)
            bad |= dt == "float32" and same != len(div) or not used
            rows.append(dict(arch="deepseek_v4", dtype=dt, graphs_used=used, identical=same, first_divergence=div,
                             graphs_s=g_s, eager_s=e_s, tokens=len(div) * NEW_TOKENS))
            print(f"deepseek_v4 {dt:<9} graphs={used} agree {same}/{len(div)} "
                  f"{' '.join('-' if d is None else str(d) for d in div)}  generate: graphs {g_s * 1e3:.0f} ms, "
                  f"eager {e_s * 1e3:.0f} ms ({e_s / g_s:.2f}x)", flush=True)
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               new_tokens=NEW_TOKENS, experts="dense sync-free stand-in (same sum), both runs", rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "v4_graphs_check.json"), "w") as f:
        json.dump(doc, f, indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
