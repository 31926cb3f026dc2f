"""Two workers' memory plans on one GPU (issue 29, item 2), as `configs/pd-1gpu.yaml` runs them.

    python -m benchmarks.pd.pd_gpu_mid_model /tmp/mid      # the mid-size model pd-1gpu serves
    python scripts/memory_check.py [--config pd-1gpu] [--model /tmp/mid] [--share 0.45] [--largest] [--out FILE]

Builds the config's first prefill worker's engine on --device (cuda:0) in one process and, while that one holds
its memory, the first decode worker's in a second: each profiles its peak activations and plans its
pool in its share of the GPU (engine/memory.py). Each then runs one full prefill step (prompts
filling max_num_batched_tokens) and reports its plan, its pool, and the peak it reached against what
the plan allowed. With both alive the GPU's used memory is printed beside the shares' sum.
--share sets both workers' gpu_memory_utilization (default: each worker's own); --largest drops the
configured num_kv_blocks so each plans the largest pool. A refused plan prints its message. Exit 1
if a plan is refused, a step runs out of memory, or the two workers use more than their shares.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from pathlib import Path

GiB = 2**30


def worker(name: str, engine_json: str, conn) -> None:
    """One worker's engine: plan, a full prefill step, the numbers; then hold until told to end."""
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.request import Request
    from pdserve.sampling_params import SamplingParams

    config = EngineConfig.model_validate_json(engine_json)
    try:
        engine = LLMEngine(config)
    except ValueError as e:
        conn.send({"name": name, "refused": str(e)})
        conn.recv()
        return
    runner = engine.runner
    device = runner.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    each = (
        min(config.max_model_len or runner.max_model_len, config.max_num_batched_tokens) - 2
    )  # room for the 2 sampled
    n = max(config.max_num_batched_tokens // each, 1)
    for i in range(n):
        prompt = [(7 * i + j) % 800 + 1 for j in range(each)]
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        engine.add_request(Request(request_id=f"{name}-{i}", prompt_token_ids=prompt, params=params))
    error = None
    try:
        while engine.has_unfinished_requests():
            engine.step()
    except torch.OutOfMemoryError as e:
        error = f"OutOfMemoryError: {e}"
    if cuda:
        torch.cuda.synchronize(device)
    f = runner.memory_figures
    conn.send(
        {
            "name": name,
            "share": config.gpu_memory_utilization,
            "num_kv_blocks": runner.num_kv_blocks,
            "plan": f.summary() if f else None,
            "figures": vars(f) if f else None,
            "pool_gib": runner.num_kv_blocks * f.block_bytes / GiB if f else None,
            "allowed_gib": config.gpu_memory_utilization * f.total / GiB if f else None,
            # the process's peak during the step: torch's reserved memory and its non-torch memory
            "step_peak_gib": (torch.cuda.max_memory_reserved(device) + f.non_torch) / GiB if f else None,
            # what the plan predicts the step allocates (weights, pool, profiled activations) against
            # what it did: the allocator's peak of live tensors (reserved above adds its caching)
            "planned_allocated_gib": (f.weights + runner.num_kv_blocks * f.block_bytes + f.peak_activation) / GiB
            if f
            else None,
            "step_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GiB if cuda else None,
            "prompts": f"{n} x {each} tokens",
            "oom": error,
        }
    )
    conn.recv()  # hold the memory until the other worker has reported
    engine.shutdown()


def _report(name: str, proc, conn) -> dict:
    """The worker's report, or why there is none (it died: its traceback is on stderr)."""
    while not conn.poll(1.0):
        if not proc.is_alive():
            return {"name": name, "refused": f"the worker process exited with code {proc.exitcode}"}
    return conn.recv()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="pd-1gpu")
    p.add_argument("--model", help="checkpoint folder (default: the config's)")
    p.add_argument("--share", type=float, help="both workers' gpu_memory_utilization (default: each one's)")
    p.add_argument("--largest", action="store_true", help="drop num_kv_blocks: plan the largest pool that fits")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--device", default="cuda:0", help="cuda:N; cpu runs the same steps with nothing to plan")
    args = p.parse_args()

    import torch

    from pdserve.config import resolve_model
    from pdserve.launch.flags import load_cluster

    cluster = load_cluster(args.config)
    model = resolve_model(args.model or cluster.model)
    ctx = mp.get_context("spawn")
    results, procs, conns = [], [], []
    for name, workers in (("prefill", cluster.prefill), ("decode", cluster.decode)):
        update = {"device": args.device, "gpus": [], "numa_node": None}
        if args.share is not None:
            update["gpu_memory_utilization"] = args.share
        if args.largest:
            update["num_kv_blocks"] = None
        w = workers[0].model_copy(update=update)
        engine = w.engine_config(model)
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(name, engine.model_dump_json(), theirs))
        proc.start()
        results.append(_report(name, proc, ours))  # the next starts once this one holds its pool
        procs.append(proc)
        conns.append(ours)
    free, total = torch.cuda.mem_get_info(args.device) if args.device != "cpu" else (0, 0)
    used = (total - free) / GiB
    shares = sum(r.get("share", 0) for r in results) * total / GiB
    for proc, conn in zip(procs, conns):
        if proc.is_alive():
            conn.send("end")
    for proc in procs:
        proc.join(timeout=120)
    for r in results:
        print(json.dumps(r, indent=2))
    print(
        f"{args.device} with both workers up: {used:.2f} GiB used of {total / GiB:.2f}; the shares allow {shares:.2f} GiB"
    )
    if args.out:
        args.out.write_text(json.dumps({"workers": results, "used_gib": used, "shares_gib": shares}, indent=2))
    over = [r["name"] for r in results if r.get("allowed_gib") and r["step_peak_gib"] > r["allowed_gib"]]
    if over:
        print(f"over their share: {over}")
    bad = any("refused" in r or r.get("oom") for r in results) or used > shares or bool(over)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
