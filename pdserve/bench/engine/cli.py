"""`pdserve bench-engine`: decode steps of the engine on one device against their floor.

    pdserve bench-engine --model v4-flash [--num-layers N] [--batch-sizes 1,16,64,128]
        [--context 4096] [--long-context 131072] [--verify-k 1,2,3] [--out FILE]

Random weights at the real layer dimensions (`load_format dummy`: models.py), as many layers as
fit (or --num-layers), a pool of random KV (decode.py), per row: warm-up steps, timed steps
(median), one step that counts the routed experts the batch touches, the floor (floor.py)
against ceilings measured in the same run (ceilings.py), and a profiled step by kernel class
(profile.py). A naive baseline: the B=1 row again on the torch reference kernels. Prints a
table, writes JSON (--out). Nothing here changes how the engine runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import platform
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from pdserve.bench.engine import ceilings, plan, profile, verify
from pdserve.bench.engine.floor import attention_cost, step_cost
from pdserve.bench.engine.models import MODELS, bench_config, engine_quantization, write_config
from pdserve.bench.engine.report import format_baseline, format_header, format_row


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(MODELS), default="v4-flash", help="layer dimensions (tiny-*: test models)")
    p.add_argument("--num-layers", type=int, help="layers to build (default: as many as fit on a GPU; all on the CPU)")
    p.add_argument("--load-format", default="dummy", help="dummy: random weights made in memory (the only one here)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="weights: bfloat16 | float16 | float32 | fp8 (= bfloat16 activations, --quantization fp8) | fp4 (DeepSeek-V4's release formats: FP4 routed experts, FP8 projections, bfloat16 activations)",
    )
    p.add_argument(
        "--quantization",
        "-q",
        choices=("fp8",),
        help="fp8: FP8 e4m3 weights with 128 x 128 block scales, kept FP8 (V3.2)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the weights' dtype) | fp8 (V3.2: 656-byte latent records; V4: 584-byte fp8_ds_v4 window and entry records)",
    )
    p.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (the engine captures decode graphs by default)"
    )
    p.add_argument(
        "--fp4-moe-backend",
        default="auto",
        choices=("auto", "w4a16", "mxfp8"),
        help="with --dtype fp4: the FP4 experts' kernel path (auto: per GPU, docs/kernels.md)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-sizes", default="1,16,64,128", help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=4096, help="tokens in each sequence's cache")
    p.add_argument("--long-context", type=int, default=131072, help="context of the extra B=1 row (0: no such row)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps a row (the median is reported)")
    p.add_argument("--profile-steps", type=int, default=1, help="profiled steps a row (0: no profile)")
    p.add_argument("--baseline-steps", type=int, default=3, help="timed steps of the naive baseline (0: none)")
    p.add_argument("--kv-block-size", type=int, default=64)
    p.add_argument(
        "--tp-shard",
        type=int,
        default=1,
        help="N > 1: one rank's share of a tensor-parallel-N worker (heads, o_groups, expert widths split), "
        "on one device; the step's all-reduces are not in it; needs --num-layers",
    )
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of free GPU memory the layers + KV may take"
    )
    p.add_argument(
        "--verify-k",
        default="",
        help="comma-separated draft counts k: also time speculative decoding's verify steps of k drafts per row",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON report here")


def check_args(args: argparse.Namespace) -> None:
    """Refuse what the engine cannot run, saying why (ValueError)."""
    if args.load_format != "dummy":
        raise ValueError(
            f"--load-format {args.load_format}: bench-engine builds its model from --model's dimensions; only 'dummy'"
        )
    if args.dtype == "fp4":  # V4-Flash as released: FP4 e2m1 routed experts, FP8 projections, bf16 activations
        if "v4" not in args.model:
            raise ValueError(
                f"--dtype fp4: FP4 routed experts are DeepSeek-V4's (--model v4-flash or tiny-v4), not {args.model}'s"
            )
        args.dtype, args.quantization = "bfloat16", "fp4"
    if args.dtype == "fp8":  # FP8 weights, bf16 activations
        args.dtype, args.quantization = "bfloat16", "fp8"
    if args.quantization == "fp8" and MODELS[args.model]()["model_type"] == "deepseek_v4":
        raise ValueError(
            "--quantization fp8: for DeepSeek-V4 use --dtype fp4 (its release formats: FP4 routed experts, FP8 projections); the bench has no V4 variant with FP8 experts"
        )
    if args.dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"--dtype {args.dtype}: choose bfloat16, float16 or float32")
    if args.kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype}: auto (the weights' dtype) or fp8")
    if args.tp_shard < 1 or (args.tp_shard > 1 and not args.num_layers):
        raise ValueError("--tp-shard must be >= 1, and a shard needs --num-layers (layers are fitted unsharded)")
    if any(k < 1 for k in verify_ks(args)):
        raise ValueError("--verify-k: draft counts must be >= 1")
    if min(batch_sizes(args)) < 1 or args.context < 1 or args.long_context < 0 or args.steps < 1 or args.warmup < 0:
        raise ValueError("batch sizes, --context and --steps must be >= 1; --long-context and --warmup >= 0")


def batch_sizes(args: argparse.Namespace) -> list[int]:
    return [int(b) for b in args.batch_sizes.split(",") if b.strip()]


def verify_ks(args: argparse.Namespace) -> list[int]:
    return [int(k) for k in args.verify_k.split(",") if k.strip()]


def _verify_config(args: argparse.Namespace) -> dict | None:
    """--verify-k: the engine runs verify chunks of up to max k drafts (and captures their graphs)."""
    ks = verify_ks(args)
    return {"method": "ngram", "num_speculative_tokens": max(ks)} if ks else None


def rows_of(args: argparse.Namespace) -> list[tuple[int, int]]:
    rows = [(b, args.context) for b in batch_sizes(args)]
    return rows + ([(1, args.long_context)] if args.long_context else [])


def run(args: argparse.Namespace) -> dict:
    check_args(args)
    from pdserve.bench.engine.decode import DecodeBench
    from pdserve.engine.config import EngineConfig

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = rows_of(args)
    extra = args.warmup + args.steps + 1 + args.profile_steps + args.baseline_steps + 1
    if verify_ks(args):  # plain steps of the verify table, then room for the drafts
        extra += args.warmup + args.steps + max(verify_ks(args))
    blocks = plan.pool_blocks(rows, args.kv_block_size, extra)
    roof = ceilings.measure(device, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the ceilings' buffers: free before layers are fitted
    layers = args.num_layers or _fitting_layers(args, device, dtype, blocks)
    model_json = bench_config(args.model, layers, args.quantization, args.tp_shard)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-engine-") as folder:
        config = EngineConfig(
            model=str(write_config(model_json, Path(folder))), device=args.device, dtype=args.dtype,
            load_format="dummy", quantization=engine_quantization(args.quantization), kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
            fp4_moe_backend=args.fp4_moe_backend,
            kv_block_size=args.kv_block_size, num_kv_blocks=blocks,
            max_num_seqs=max(b for b, _ in rows), max_model_len=max(c for _, c in rows) + extra + 1, seed=args.seed,
            speculative_config=_verify_config(args),
        )  # fmt: skip
        bench = DecodeBench(config)
    report = {
        "environment": environment(device),
        "settings": settings(args, model_json, blocks, bench.runner.graphs is not None),
        "ceilings": roof,
        "rows": [],
    }
    print(format_header(report), flush=True)
    for b, c in rows:
        report["rows"].append(_row(bench, args, b, c, roof))
        print(format_row(report["rows"][-1]), flush=True)
        if args.out:  # after every row: a run stopped early keeps what it measured
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


def _fitting_layers(args, device: torch.device, dtype: torch.dtype, blocks: int) -> int:
    if device.type != "cuda":
        return bench_config(args.model)["num_hidden_layers"]
    free, _ = torch.cuda.mem_get_info(device)
    budget = args.gpu_memory_utilization * free - 6 * 2**30  # activations, logits, the profiler
    return plan.fit_layers(
        args.model,
        dtype,
        args.kv_cache_dtype,
        args.kv_block_size,
        blocks,
        max(batch_sizes(args)),
        budget,
        quantization=args.quantization,
    )


def _row(bench, args, batch: int, context: int, roof: dict) -> dict:
    """One (batch, context) row; an error (out of memory, say) is kept in the row, not raised."""
    row: dict = {"batch": batch, "context": context}
    seqs = []
    try:
        seqs = bench.make_batch(batch, context)
        for _ in range(args.warmup):
            bench.step(seqs)
        times = bench.timed_steps(seqs, args.steps)
        step_ms = 1e3 * statistics.median(times)
        touched = bench.experts_touched(seqs)
        cost = step_cost(
            bench.runner.model,
            bench.runner.model.config,
            batch,
            context,
            bench.kv_itemsize,
            touched,
            record_bytes=bench.kv_record_bytes,
        )
        floor = cost.floor_ms(roof["copy_bytes_per_s"], roof["matmul_flops_per_s"])
        row.update(step_ms=step_ms, step_ms_all=[1e3 * t for t in times], tok_s=1e3 * batch / step_ms, **floor)
        row.update(ratio=step_ms / floor["floor_ms"], cost=cost.as_dict(), experts_touched=touched)
        if args.profile_steps:
            try:
                row["profile"] = profile.breakdown(lambda: bench.step(seqs), bench.device, args.profile_steps, step_ms)
            except Exception as e:  # the profiler's own failure: keep the row's timings
                row["profile_error"] = f"{type(e).__name__}: {e}"[:500]
        if args.baseline_steps and batch == 1 and context == args.context:
            with bench.reference_kernels():
                bench.step(seqs)
                base = 1e3 * statistics.median(bench.timed_steps(seqs, args.baseline_steps))
            row["baseline"] = {"what": "the same step, eager, on the torch reference kernels", "step_ms": base}
        if verify_ks(args) and context == args.context:
            floor_of = functools.partial(_verify_floor, bench, batch, context, roof)
            row["verify"] = verify.measure(bench, seqs, verify_ks(args), args.warmup, args.steps, floor_of)
    except (RuntimeError, ValueError) as e:  # torch's out-of-memory is a RuntimeError
        row["error"] = f"{type(e).__name__}: {e}"[:500]
        row["where"] = traceback.format_exc(limit=-4)[-1500:]
    finally:
        bench.free(seqs)
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _verify_floor(bench, batch: int, context: int, roof: dict, k: int) -> float:
    """The floor (ms) of a step of `batch` sequences verifying k drafts each: weights and the experts
    B (k + 1) tokens are expected to touch, each sequence's KV read once (k = 0: a plain step)."""
    model = bench.runner.model
    cost = step_cost(
        model, model.config, batch * (k + 1), context, bench.kv_itemsize, record_bytes=bench.kv_record_bytes
    )
    kv, _ = attention_cost(model.config, batch, context, bench.kv_itemsize, bench.kv_record_bytes)
    cost = dataclasses.replace(cost, kv_bytes=kv)
    return cost.floor_ms(roof["copy_bytes_per_s"], roof["matmul_flops_per_s"])["floor_ms"]


def environment(device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
    }  # fmt: skip


def settings(args: argparse.Namespace, model_json: dict, blocks: int, graphs: bool) -> dict:
    keys = ("layer_types", "mlp_layer_types", "first_k_dense_replace")
    return {
        **{k: v for k, v in vars(args).items() if k != "out"},
        "kv_cache_dtype": args.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
        "cuda_graphs": graphs,  # the runner captured decode graphs (and replays them for these rows)
        "num_layers": model_json["num_hidden_layers"], "kv_blocks": blocks,
        "layer_kinds": {k: model_json[k] for k in keys if k in model_json},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pdserve bench-engine", description="Engine decode steps against their floor, one device."
    )
    add_args(p)
    args = p.parse_args(argv)
    try:
        report = run(args)
    except ValueError as e:
        print(f"pdserve bench-engine: {e}", file=sys.stderr)
        return 2
    print(format_baseline(report))
    if verify_ks(args):
        print(verify.format_verify(report))
    if args.out:
        print(f"wrote {args.out}")
    return 0
