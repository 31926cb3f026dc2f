"""Kernel launches of one DeepSeek-V4 decode forward, counted on the CPU (no GPU needed): every aten
op that computes (views and allocations left out) is one launch, and every `pdserve.model.ops`
call one launch too, its inside not counted (on a GPU it is a Triton kernel; `hc_pre` is two).
Counted per module kind, so the per-layer glue (mHC, norms, rope, router) stands apart from the
step's metadata (step.py) and the kernels proper. A CUDA-graph replay pays roughly one launch
gap per kernel, so this is what the B=1 step's "launch gaps" scale with.

    PYTHONPATH=. python benchmarks/engine/count_v4_launches.py [--batch 1] [--context 300] [--backend torch]

--backend triton (default) takes the paths a GPU takes (the Triton kernels, interpreted; some
fused paths exist only there); torch counts the CPU's paths.
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
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
KERNELS = {"hc_pre": 2}  # ops functions that launch more than one kernel on a GPU


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.by_where: collections.Counter = collections.Counter()
        self.muted = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        same = name in ("to", "contiguous", "reshape", "type_as") and args and out is args[0]  # nothing to do
        if not self.muted and name not in NO_KERNEL and not same:
            self.by_where[_where()] += 1
        return out


def _where() -> str:
    """The model file (and function) the op came from."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/pdserve/model/" in frame.filename:
            return f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.name}"
    return "other"


def _mute_ops(counter: Count) -> None:
    """Each ops.* call: one launch (KERNELS: more), its inside muted."""
    from pdserve.model import ops

    for name, fn in list(vars(ops).items()):
        if (
            not inspect.isfunction(fn)
            or name.startswith("_")
            or fn.__module__ != ops.__name__
            or name in ("set_backend", "uses_triton")
        ):
            continue

        @functools.wraps(fn)
        def wrapped(*a, _fn=fn, _name=name, **kw):
            if not counter.muted:
                counter.by_where[f"ops.{_name}"] += KERNELS.get(_name, 1)
            counter.muted += 1
            try:
                return _fn(*a, **kw)
            finally:
                counter.muted -= 1

        setattr(ops, name, wrapped)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument(
        "--backend", choices=("triton", "torch"), default="triton", help="triton: the GPU's paths, interpreted"
    )
    args = p.parse_args()
    if args.backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import
    from pdserve.bench.engine.decode import DecodeBench
    from pdserve.bench.engine.models import bench_config, write_config
    from pdserve.engine.config import EngineConfig
    from pdserve.model import ops

    ops.set_backend(args.backend)
    counter = Count()
    _mute_ops(counter)
    with tempfile.TemporaryDirectory() as folder:
        model = write_config(bench_config("tiny-v4", args.num_layers, None), Path(folder))
        cfg = EngineConfig(
            model=str(model), device="cpu", dtype="bfloat16", load_format="dummy", kv_block_size=16,
            num_kv_blocks=4 * args.batch * (args.context // 16 + 4), max_num_seqs=args.batch,
            max_model_len=args.context + 8, seed=0,
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
        bench.step(seqs)
    total = sum(counter.by_where.values())
    print(f"{total} launches in one decode forward ({args.num_layers} layers, B={args.batch}):")
    for where, n in counter.by_where.most_common():
        print(f"  {n:5d}  {where}")


if __name__ == "__main__":
    main()
