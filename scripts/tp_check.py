"""Tensor parallelism and PD with TP on both sides, on a machine with 2+ GPUs (not run in CI).

    python scripts/tp_check.py [--model DIR | --arch deepseek_v3,deepseek_v32,deepseek_v4] [--tp 2,4]
                               [--pd 1x1,2x1,1x2,2x2,4x4] [--dtype float32] [--out tp_check.json]
                               [--device cuda|cpu] [--speculative-config JSON]

1. greedy: for each model, `LLM(device="cuda")` with TP1 on GPU 0, then with each TP N of --tp on
   GPUs 0..N-1 (NCCL): the greedy tokens of a batch of prompts must equal TP1's. float32 by default:
   in bf16 another all-reduce order may flip a near-tie of a random model.
2. PD: for each "AxB" of --pd, `pdserve launch` with a generated config: a prefill worker with TP A
   on GPUs 0..A-1, a decode worker with TP B on GPUs A..A+B-1, a router. KV goes VRAM to VRAM
   over NIXL/UCX (decode rank 0 reads prefill rank 0, then copies to its own ranks over NCCL).
   Greedy output through the router must equal step 1's TP1 tokens; 0 KV blocks in use after;
   the decode worker's KV bytes and read time are reported (tiny requests: latency, not bandwidth).
3. the bandwidth figure: `benchmarks/transfer/bench_transfer.py --device cuda:1 --peer-device cuda:0` (NIXL
   READ GPU0 -> GPU1 between two processes against a peer-to-peer copy_), when 2 GPUs are visible.

Pairs and sizes that need more GPUs than are visible are skipped (and listed as skipped), and so are
those the model does not split into (the tiny V4's 2 output groups: TP4 is refused). NVLink
multicast (NVLS) is left off: NCCL_NVLS_ENABLE=0 for every process started here. Prints one JSON
summary (also to --out); exit 1 if any comparison differs or a step fails.

`--speculative-config` (vLLM's JSON, e.g. '{"method": "mtp", "num_speculative_tokens": 2}') runs
steps 1 and 2 with it (the TP1 reference without): TP N and PD with drafts (MTP on both PD workers,
another method on the decode worker) must give the same tokens; the decode worker's draft count
is reported.

`--device cpu` runs the same steps with gloo ranks on the CPU (no GPU count limit, no step 3):
a check of this script itself; tests/e2e/test_tp.py is the CPU test of the feature.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.tiny_model import make_tiny_model  # noqa: E402

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(4, 800) for _ in range(n)] for n in (1, 5, 17, 40, 97, 200)]
MAX_TOKENS = 16
STARTUP_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy(model: str, tp: int, dtype: str, device: str, spec: dict | None = None) -> list[list[int]]:
    llm = LLM(
        model, device=device, tensor_parallel_size=tp, dtype=dtype, skip_tokenizer_init=True, kv_cache_memory_gb=1.0,
        **({"speculative_config": spec} if spec else {}),
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    finally:
        llm.engine.shutdown()
        del llm
        if device == "cuda":
            torch.cuda.empty_cache()


def _worker(port: int, gpus: list[int], dtype: str, device: str, spec: dict | None = None) -> dict:
    placement = {"gpus": gpus} if device == "cuda" else {}
    placement.update({"speculative_config": spec} if spec else {})
    return {
        "port": port,
        "device": device,
        "tp_size": len(gpus),
        "numa_node": None,
        "dtype": dtype,
        "num_kv_blocks": 256,
        **placement,
    }


def pd_run(model: str, a: int, b: int, dtype: str, device: str, log_dir: Path, spec: dict | None = None) -> dict:
    """Launch prefill TP a + decode TP b + router; greedy tokens and transfer counters. spec: the
    decode worker's speculative_config (and the prefill worker's, for MTP)."""
    pre_spec = spec if spec and spec["method"] == "mtp" else None
    router, prefill, decode = free_port(), free_port(), free_port()
    cfg = {
        "model": model,
        "served_model_name": "m",
        "router": {"port": router, "health_interval": 0.5},
        "prefill": [_worker(prefill, list(range(a)), dtype, device, pre_spec)],
        "decode": [_worker(decode, list(range(a, a + b)), dtype, device, spec)],
        "transfer": {"backend": "nixl", "timeout": 60},
        "log_dir": str(log_dir),
        "startup_timeout": STARTUP_S,
    }
    path = log_dir / "cluster.yaml"
    log_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    with open(log_dir / "launch.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "launch", "--config", str(path)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{router}"
    try:
        _wait_healthy(url, proc, log_dir)
        tokens = [_complete(url, p) for p in PROMPTS]
        metrics = _scrape(f"http://127.0.0.1:{decode}")
        used = {
            w: _scrape(f"http://127.0.0.1:{p}").get("pdserve_kv_blocks_used", -1)
            for w, p in (("prefill", prefill), ("decode", decode))
        }
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    nbytes, secs = (
        metrics.get("pdserve_kv_transfer_bytes_total", 0.0),
        metrics.get("pdserve_kv_transfer_seconds_sum", 0.0),
    )
    return {
        "tokens": tokens,
        "kv_bytes": nbytes,
        "kv_read_s": secs,
        "kv_gbps": nbytes / secs / 1e9 if secs else None,
        "drafts": metrics.get("pdserve_spec_decode_num_drafts_total", 0.0),
        "blocks_used_after": used,
    }


def _wait_healthy(url: str, proc: subprocess.Popen, log_dir: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve launch exited with {proc.returncode}; see {log_dir}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"router not healthy after {STARTUP_S} s; see {log_dir}")


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def _scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def bench_transfer() -> str:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.transfer.bench_transfer",
        "--device",
        "cuda:1",
        "--peer-device",
        "cuda:0",
        "--sizes",
        "16,64,256",
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600).stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint folder (default: the tiny models of --arch)")
    p.add_argument("--arch", default="deepseek_v3,deepseek_v32,deepseek_v4")
    p.add_argument("--tp", default="2,4", help="TP sizes compared with TP1")
    p.add_argument("--pd", default="1x1,2x1,1x2,2x2,4x4", help="prefill x decode TP sizes")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="tp_check.json")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--speculative-config", type=json.loads, help="TP N and PD runs with these drafts (vLLM's JSON)")
    args = p.parse_args()
    spec = args.speculative_config
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off, for this process and all it starts
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    room = gpus if args.device == "cuda" else float("inf")  # CPU ranks need no GPUs
    work = Path(tempfile.mkdtemp(prefix="tp_check-"))
    models = (
        {"model": args.model} if args.model else {a: str(make_tiny_model(work / a, a)) for a in args.arch.split(",")}
    )
    report: dict = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" and gpus else "cpu", "gpus": gpus, "date": time.strftime("%Y-%m-%d"),
                    "torch": torch.__version__, "speculative_config": spec, "greedy": {}, "pd": {}, "skipped": [], "ok": True}  # fmt: skip
    for name, model in models.items():
        ref = greedy(model, 1, args.dtype, args.device)
        refused: set[int] = set()  # TP sizes the model does not split into
        for tp in map(int, args.tp.split(",")):
            if tp > room:
                report["skipped"].append(f"{name} TP{tp}: {gpus} GPUs")
                continue
            try:
                same = greedy(model, tp, args.dtype, args.device, spec) == ref
            except ValueError as e:  # refused before any rank starts, naming the dimension
                refused.add(tp)
                report["skipped"].append(f"{name} TP{tp}: {e}")
                continue
            report["greedy"][f"{name} TP{tp}"] = same
            report["ok"] &= same
        for pair in args.pd.split(","):
            a, b = map(int, pair.split("x"))
            if a + b > room:
                report["skipped"].append(f"{name} PD {pair}: needs {a + b} GPUs, {gpus} visible")
                continue
            if {a, b} & refused:
                report["skipped"].append(f"{name} PD {pair}: TP{max({a, b} & refused)} refused")
                continue
            try:
                run = pd_run(model, a, b, args.dtype, args.device, work / f"{name}-pd-{pair}", spec)
                run["equal_to_tp1"] = run.pop("tokens") == ref
                run["ok"] = run["equal_to_tp1"] and not any(run["blocks_used_after"].values())
            except (RuntimeError, httpx.HTTPError, subprocess.TimeoutExpired) as e:
                run = {"ok": False, "error": str(e)}
            report["pd"][f"{name} {pair}"] = run
            report["ok"] &= run["ok"]
    if args.device == "cuda" and gpus >= 2:
        report["bench_transfer"] = bench_transfer()
    text = json.dumps(report, indent=2)
    print(text)
    Path(args.out).write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
