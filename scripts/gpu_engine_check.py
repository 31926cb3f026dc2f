"""Greedy token agreement of pdserve's engine with transformers on the tiny checkpoints.

    python scripts/gpu_engine_check.py [--device cuda] [--dtypes bfloat16,float32] [--archs ...] [--out DIR]

For each tiny architecture (`pdserve.tiny_model`: deepseek_v3, deepseek_v32, deepseek_v4) this
writes the checkpoint, runs 8 prompts x 32 greedy tokens (EOS ignored) through `pdserve.LLM` (on
CUDA the Triton kernels, through pdserve/model/ops.py) and through transformers'
DeepseekV3ForCausalLM / DeepseekV32ForCausalLM / DeepseekV4ForCausalLM (argmax over the full
sequence each step, no cache), each in every dtype asked for, and prints per prompt the index of
the first token that differs:

- pdserve-<dtype> vs HF-float32: the engine against the oracle;
- HF-<dtype> vs HF-float32 (dtype != float32): how far low precision alone moves the oracle,
  so the engine's low-precision divergence is compared with measured noise, not assumed;
- pdserve-float32 on the device vs pdserve-float32 on CPU (the torch reference path), when the
  device is not the CPU.
An arch named `<arch>-fp8` (deepseek_v3-fp8, deepseek_v32-fp8) is the same tiny checkpoint with
every weight DeepSeek ships in FP8 quantized per 32 x 32 block (e4m3 + weight_scale_inv, a
quantization_config): pdserve keeps it FP8 (ops.fp8_linear, ops.fused_moe_fp8), transformers
runs the dequantized weights (the oracle: the same real numbers). `deepseek_v4-fp4` is the tiny
V4 in V4-Flash's formats (`tiny_model.quantize_tiny_v4`: FP4 routed experts, FP8 projections per
32 x 32 block), kept so on the device (ops.fused_moe_fp4, ops.fp8_linear): every one of its runs
must call fused_moe_fp4, on the run's backend only.
The float32 rows must agree on every token. Each pdserve run also records its kernel calls
(`ops.<kernel>` by the backend taken, Triton or torch) and its model forwards: DeepSeek-V4 must
make exactly one sparse_mla_decode per layer per forward (its whole attention), all of them on
Triton on a GPU. Writes engine_check.json to --out (default $OUT or the working directory). Exit
status 1 if a float32 row disagrees or a V4 run breaks that call count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.tiny_model import ARCHS, make_tiny_model, quantize_tiny_v4

PROMPTS = [
    "Hello!",
    "What is the capital of France?",
    "Please write a short story about a cat who wants to learn to read.",
    "The quick brown fox",
    "A language model reads a sequence of tokens and predicts the next token, one at a time. "
    "When the model serves many users at once, it keeps the keys and values of every request.",
    "Thank you for your question.",
    "Prefill is limited by how fast the machine can compute, and decode",
    "Once upon a time there was a small cat who lived in a large house with many books. Every "
    "day she looked at the pages and wondered what the words could mean.",
]
NEW_TOKENS = 32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


OPS = (
    "sparse_mla_decode",
    "indexer_topk",
    "indexer_topk_paged",
    "mla_prefill_attention",
    "fused_moe",
    "fp8_linear",
    "fused_moe_fp8",
    "fused_moe_fp4",
    # DeepSeek-V4's fused glue (recorded, not required)
    "hc_pre",
    "hc_post",
    "rms_norm",
    "rope_tail",
    "route",
    "swiglu",
    "compress_decode",
)
FP8_BLOCK = (32, 32)  # the tiny models' widths (64 .. 256) are multiples; kv_a's 80 rows leave a partial block


@contextlib.contextmanager
def counting_kernels(model):
    """Counts each `ops.<kernel>` call by the backend it takes, and the model's forwards."""
    from pdserve.model import ops

    counts = {name: {"triton": 0, "torch": 0} for name in OPS} | {"forwards": 0}
    saved = {name: getattr(ops, name) for name in OPS}
    forward = model.forward

    def wrap(name):
        def call(*args, **kwargs):
            counts[name]["triton" if ops._use_triton(args[0]) else "torch"] += 1
            return saved[name](*args, **kwargs)

        return call

    def counted_forward(*args, **kwargs):
        counts["forwards"] += 1
        return forward(*args, **kwargs)

    for name in OPS:
        setattr(ops, name, wrap(name))
    model.forward = counted_forward
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)
        del model.forward


def pdserve_tokens(path: str, device: str, dtype: str, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    """All prompts as one continuous batch, greedy, EOS ignored; the tokens and the kernel calls."""
    llm = LLM(path, device=device, dtype=dtype, kv_block_size=16, kv_cache_memory_gb=0.25, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    model = llm.engine.runner.model
    with counting_kernels(model) as calls:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    calls["num_layers"] = model.num_layers
    used = llm.engine.get_stats().kv_blocks_used
    if used:
        raise RuntimeError(f"{used} KV blocks still in use after every request finished")
    return [list(o.outputs[0].token_ids) for o in outs], calls


def v4_calls_ok(calls: dict, device: str) -> bool:
    """DeepSeek-V4: one sparse_mla_decode per layer per forward, on Triton when on a GPU."""
    mla = calls["sparse_mla_decode"]
    backend = "torch" if device == "cpu" else "triton"
    return mla[backend] == calls["forwards"] * calls["num_layers"] and sum(mla.values()) == mla[backend]


def hf_tokens(path: str, device: str, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' model: argmax over the full sequence each step (no cache), one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], attn_implementation="eager", experts_implementation="eager"
        )
        .to(device)
        .eval()
    )
    result = []
    with torch.no_grad():
        for prompt in prompts:
            seq = torch.tensor([prompt], device=device)
            for _ in range(NEW_TOKENS):
                nxt = model(seq).logits[0, -1].float().argmax()
                seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
            result.append(seq[0, len(prompt) :].tolist())
    del model
    return result


def first_divergence(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    """Per prompt: the first index where the two continuations differ, None if they agree."""
    return [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None) for s, t in zip(a, b)]


def fp8_checkpoint(path: str) -> tuple[str, str]:
    """(FP8 copy, dequantized copy) of the tiny checkpoint at `path`: the linear weights of
    attention, indexer, MLPs and experts quantized per FP8_BLOCK (what DeepSeek ships in FP8)."""
    from safetensors.torch import load_file, save_file

    from pdserve_kernels.ref_fp8 import dequant_block_fp8, quant_block_fp8

    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "weights_proj")
    fp8, deq = {}, {}
    for name, w in load_file(os.path.join(path, "model.safetensors")).items():
        if w.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip):
            q, s = quant_block_fp8(w, FP8_BLOCK)
            fp8[name], fp8[name + "_scale_inv"], deq[name] = q, s, dequant_block_fp8(q, s, FP8_BLOCK)
        else:
            fp8[name] = deq[name] = w
    config = json.load(open(os.path.join(path, "config.json")))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}
    out = []
    for suffix, tensors, cfg in (("fp8", fp8, {**config, "quantization_config": quant}), ("deq", deq, config)):
        folder = f"{path}-{suffix}"
        shutil.copytree(path, folder)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)
        out.append(folder)
    return out[0], out[1]


def check_arch(arch: str, device: str, dtypes: list[str], root: str) -> tuple[list[dict], dict[str, dict]]:
    base, fp8, fp4 = arch.removesuffix("-fp8").removesuffix("-fp4"), arch.endswith("-fp8"), arch.endswith("-fp4")
    path = hf_path = str(make_tiny_model(os.path.join(root, arch), arch=base, seed=0))
    if fp8:
        path, hf_path = fp8_checkpoint(path)
    if fp4:
        path, hf_path = map(str, quantize_tiny_v4(path, f"{path}-fp4", f"{path}-deq", block=FP8_BLOCK))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in PROMPTS]
    runs: dict[str, list[list[int]]] = {}
    calls: dict[str, dict] = {}
    for dt in dtypes:
        t0 = time.time()
        runs[f"pdserve-{device}-{dt}"], calls[f"pdserve-{device}-{dt}"] = pdserve_tokens(path, device, dt, prompts)
        runs[f"HF-{device}-{dt}"] = hf_tokens(hf_path, device, dt, prompts)
        print(f"{arch} {dt}: pdserve + HF on {device} in {time.time() - t0:.1f}s", flush=True)
    if device != "cpu" and "float32" in dtypes:
        runs["pdserve-cpu-float32"], calls["pdserve-cpu-float32"] = pdserve_tokens(path, "cpu", "float32", prompts)
    oracle = f"HF-{device}-float32" if "float32" in dtypes else None
    pairs = []
    if oracle:
        for dt in dtypes:
            pairs.append((f"pdserve-{device}-{dt}", oracle, dt == "float32"))
            if dt != "float32":
                pairs.append((f"HF-{device}-{dt}", oracle, False))
        if device != "cpu":
            pairs.append((f"pdserve-{device}-float32", "pdserve-cpu-float32", True))
    rows = []
    for a, b, must in pairs:
        div = first_divergence(runs[a], runs[b])
        rows.append(
            dict(
                arch=arch,
                run=a,
                against=b,
                must_agree=must,
                first_divergence=div,
                prompt_lens=[len(p) for p in prompts],
                identical=sum(d is None for d in div),
                tokens=runs[a],
            )
        )
    for run, c in calls.items():
        if base == "deepseek_v4":
            c["v4_one_launch_per_layer"] = v4_calls_ok(c, run.split("-")[1])
        if fp4:  # the experts ran packed, through the run's backend only
            moe = c["fused_moe_fp4"]
            c["v4_one_launch_per_layer"] &= (
                moe["triton" if run.split("-")[1] != "cpu" else "torch"] == sum(moe.values()) > 0
            )
        mla = c["sparse_mla_decode"]
        print(
            f"{arch} {run}: {c['forwards']} forwards x {c['num_layers']} layers; sparse_mla_decode "
            f"triton {mla['triton']} torch {mla['torch']}; indexer_topk {c['indexer_topk']} paged {c['indexer_topk_paged']}; "
            f"fp8_linear {c['fp8_linear']}; fused_moe_fp8 {c['fused_moe_fp8']}; fused_moe_fp4 {c['fused_moe_fp4']}",
            flush=True,
        )
    return rows, calls


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtypes",
        default="bfloat16,float32",
        help="comma-separated; float32 is the oracle's dtype and must be included",
    )
    ap.add_argument("--archs", default=",".join([*ARCHS, "deepseek_v3-fp8", "deepseek_v32-fp8", "deepseek_v4-fp4"]))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    if "float32" not in dtypes or any(d not in DTYPES for d in dtypes):
        raise SystemExit(f"--dtypes must include float32 and name only {', '.join(DTYPES)}")
    rows, calls = [], {}
    os.makedirs(args.out, exist_ok=True)
    print(f"{len(PROMPTS)} prompts x {NEW_TOKENS} greedy tokens; first divergence per prompt ('-' = all tokens agree)")
    with tempfile.TemporaryDirectory() as root:
        for arch in args.archs.split(","):
            new, calls[arch] = check_arch(arch, args.device, dtypes, root)
            print(f"{'arch':<13} {'run':<24} {'vs':<22} {'agree':>5}  first divergence")
            for r in new:
                div = " ".join("-" if d is None else str(d) for d in r["first_divergence"])
                print(
                    f"{r['arch']:<13} {r['run']:<24} {r['against']:<22} {r['identical']:>3}/{len(PROMPTS)}  {div}",
                    flush=True,
                )
            rows += new
            with open(os.path.join(args.out, "engine_check.json"), "w") as f:
                json.dump(
                    dict(
                        device=args.device,
                        device_name=_device_name(args.device),
                        date=time.strftime("%Y-%m-%d"),
                        torch=torch.__version__,
                        transformers=_version("transformers"),
                        triton=_version("triton"),
                        rows=rows,
                        kernel_calls=calls,
                    ),
                    f,
                    indent=1,
                )
    bad = [r for r in rows if r["must_agree"] and r["identical"] != len(PROMPTS)]
    bad_calls = [run for c in calls.values() for run, k in c.items() if k.get("v4_one_launch_per_layer") is False]
    if bad or bad_calls:
        print(
            f"FAIL: {len(bad)} float32 comparison(s) disagree; {len(bad_calls)} V4 run(s) without "
            "one sparse_mla_decode per layer per forward (or, -fp4, without its experts on fused_moe_fp4)",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
