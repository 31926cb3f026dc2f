"""Kernel launches of one DeepSeek-V4 decode forward, counted on the CPU (no GPU needed): every aten
op that computes (views and allocations left out) is one launch, and every Triton kernel launch
one (interpreted: the launches a GPU makes; the torch ops inside it not counted). Only the
counted forward's launches count (not the warm-up step's, nor weight loading's). Counted per
model file and function (--lines: and line), so the per-layer glue (mHC, norms, rope, router)
stands apart from the step's metadata (step.py) and the kernels proper. A CUDA-graph replay pays
roughly one launch gap per kernel, so this is what the B=1 step's "launch gaps" scale with.

    PYTHONPATH=. python benchmarks/engine/count_v4_launches.py [--batch 1] [--context 300] \
        [--quantization none|fp8|fp4] [--backend torch] [--lines] [--verify-k K]

--backend triton (default) takes the paths a GPU takes (the Triton kernels, interpreted; some
fused paths exist only there); torch counts the CPU's paths. --quantization fp4: V4-Flash's
release formats (FP8 projections, FP4 experts), as `bench-engine --dtype fp4` runs it.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL = {
    "view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "slice", "select", "t", "transpose", "permute",
    "as_strided", "alias", "detach", "split", "unbind", "split_with_sizes", "chunk", "narrow", "empty",
    "empty_strided", "lift_fresh", "new_empty", "new_empty_strided", "empty_like", "_reshape_alias", "unfold",
    "view_as_real", "view_as_complex", "_assert_async", "sym_size", "sym_stride", "sym_numel", "is_nonzero",
}  # fmt: skip


MAYBE_VIEWS = {"to", "contiguous", "reshape", "type_as", "flatten", "view_as", "_to_copy"}


def _shares(out, x) -> bool:
    """Whether out is x or a view of x's memory."""
    if not (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor)):
        return False
    return out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.by_where: collections.Counter = collections.Counter()
        self.muted = 0
        self.on = False  # inside the counted forward (the ops wrappers see every call)

    def __enter__(self):
        self.on = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.on = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        same = name in MAYBE_VIEWS and _shares(out, args[0] if args else None)  # a view: nothing to do
        if not self.muted and name not in NO_KERNEL and not same:
            self.by_where[_where()] += 1
        return out


LINES = False  # --lines: the op's line too


def _where() -> str:
    """The model file and function (and line) the op came from."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/pdserve/model/" in frame.filename:
            line = f":{frame.lineno}" if LINES else ""
            return f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.name}{line}"
    return "other"


def _count_triton(counter: Count) -> None:
    """Each Triton kernel launch (interpreted: the GPU's launch) counts one, under its kernel's
    name, and the torch ops the interpreter runs inside it none."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *a, warmup=False, **kw):
        if counter.on and not counter.muted and not warmup:
            counter.by_where[f"triton:{self.fn.__name__}"] += 1
        counter.muted += 1
        try:
            return run(self, *a, warmup=warmup, **kw)
        finally:
            counter.muted -= 1

    InterpretedFunction.run = counted


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument(
        "--quantization", choices=("none", "fp8", "fp4"), default="none", help="fp4: V4-Flash's release formats"
    )
    p.add_argument(
        "--backend", choices=("triton", "torch"), default="triton", help="triton: the GPU's paths, interpreted"
    )
    p.add_argument("--lines", action="store_true", help="count by line, not by function")
    p.add_argument("--verify-k", type=int, default=0, help="count a verify step of k drafts a sequence instead")
    args = p.parse_args()
    global LINES
    LINES = args.lines
    if args.backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import
    from pdserve.bench.engine.decode import DecodeBench
    from pdserve.bench.engine.models import bench_config, write_config
    from pdserve.engine.config import EngineConfig
    from pdserve.model import ops

    ops.set_backend(args.backend)
    counter = Count()
    if args.backend == "triton":
        _count_triton(counter)
    with tempfile.TemporaryDirectory() as folder:
        model = write_config(
            bench_config("tiny-v4", args.num_layers, None if args.quantization == "none" else args.quantization),
            Path(folder),
        )
        cfg = EngineConfig(
            model=str(model), device="cpu", dtype="bfloat16", load_format="dummy", kv_block_size=16,
            num_kv_blocks=4 * args.batch * (args.context // 16 + 4), max_num_seqs=args.batch,
            max_model_len=args.context + 8, seed=0,
            speculative_config={"method": "ngram", "num_speculative_tokens": args.verify_k} if args.verify_k else None,
        )  # fmt: skip
        bench = DecodeBench(cfg)
    seqs = bench.make_batch(args.batch, args.context)
    bench.step(seqs)
    forward = bench.runner.model.forward

    def counted(*a, **kw):
        with counter:
            return forward(*a, **kw)

    bench.runner.model.forward = counted
    with torch.inference_mode():
        if args.verify_k:
            from pdserve.bench.engine.verify import verify_step

            verify_step(bench, seqs, args.verify_k)
        else:
            bench.step(seqs)
    total = sum(counter.by_where.values())
    what = f"verify forward (k = {args.verify_k})" if args.verify_k else "decode forward"
    print(f"{total} launches in one {what} ({args.num_layers} layers, B={args.batch}):")
    for where, n in counter.by_where.most_common():
        print(f"  {n:5d}  {where}")


if __name__ == "__main__":
    main()
