"""The router's own cost per streamed token, with no engine behind it.

    python -m benchmarks.router.bench_router [--concurrency 8,32,64] [--step-ms 5] [--output-len 256] [--profile FILE]

A fake worker (this script with --fake-worker: the worker protocol from pdserve.wire.protocol,
no model) emits one token for every open request each `--step-ms`, as a decode step of a batch
does, and streams them as NDJSON chunks. The real router (`python -m pdserve serve --role router`,
colocated pool of that one worker) joins and formats them; `pdserve bench` streams completions
through it. Per concurrency level: tokens through the router per second, the router process's
CPU time per token (psutil, over the level), and the client's inter-token latency against the
step (what the router and the client add on top of it). The worker's own CPU per token is shown
too: it is the floor a Python HTTP hop costs in this set-up. On a machine with fewer cores than
processes (3 here: worker, router, client) the latencies include waiting for a core; the CPU
times per token do not.

--profile FILE samples the router with py-spy (`pip install py-spy`) for the whole sweep and writes
its stacks there, collapsed (one line a stack, a count at its end: flamegraph.pl's input); the top
functions by own time are printed.
"""

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

TOKEN_ID, TOKEN_TEXT = 65, "A"  # a byte-level token: its text is one character


def fake_worker(port: int, step_ms: float, model: str) -> None:
    """A colocated worker that decodes nothing: every step_ms each open request gets one token."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi import Request as FastAPIRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from pdserve import __version__
    from pdserve.wire.protocol import GenerateChunk, Request, WorkerHealth, WorkerInfo

    tick = asyncio.Event()
    state = {"open": 0}
    info = WorkerInfo(
        role="colocated", engine_id="fake-0", model=model, max_model_len=1 << 20, kv_block_size=64, num_kv_blocks=1 << 20,
        max_num_seqs=1024, device="cpu", dtype="float32", transfer_backend=None, pdserve_version=__version__,
    )  # fmt: skip

    async def clock() -> None:  # one "decode step" for all open requests
        nonlocal tick
        while True:
            await asyncio.sleep(step_ms / 1e3)
            tick.set()
            tick = asyncio.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.get_running_loop().create_task(clock())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> JSONResponse:
        h = WorkerHealth(status="ok", role="colocated", engine_id=info.engine_id, num_requests_running=state["open"])
        return JSONResponse(h.model_dump())

    @app.get("/internal/info")
    async def get_info() -> JSONResponse:
        return JSONResponse(info.model_dump())

    @app.get("/metrics")
    async def metrics():
        return Response("")

    @app.post("/internal/abort")
    async def abort():
        return {"ok": True}

    @app.post("/internal/generate")
    async def generate(raw: FastAPIRequest) -> StreamingResponse:
        req = Request.model_validate_json(await raw.body())
        n = req.params.max_tokens

        async def lines():
            state["open"] += 1
            try:
                for i in range(n):
                    await tick.wait()
                    chunk = GenerateChunk(
                        request_id=req.request_id, token_offset=i, token_ids=[TOKEN_ID], text_offset=i, text=TOKEN_TEXT,
                        finish_reason="length" if i == n - 1 else None, num_prompt_tokens=len(req.prompt_token_ids),
                    )  # fmt: skip
                    yield chunk.model_dump_json(exclude_none=True).encode() + b"\n"
            finally:
                state["open"] -= 1

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a process exited before {url} was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not healthy within {timeout_s} s")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _cpu(procs: list[psutil.Process]) -> float:
    """User + system seconds of these processes so far."""
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def print_top(path: str, n: int = 25) -> None:
    """Own time by function from py-spy's collapsed stacks ("frame;frame;leaf count" lines)."""
    own, total = {}, 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        own[leaf] = own.get(leaf, 0) + int(count)
        total += int(count)
    print(f"router: own time by function, {total} samples")
    for leaf, c in sorted(own.items(), key=lambda kv: -kv[1])[:n]:
        print(f"{100 * c / total:5.1f}%  {leaf}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="8,32,64")
    p.add_argument(
        "--step-ms", type=float, default=5.0, help="the fake decode step: one token per open request this often"
    )
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="requests per level = rounds x concurrency")
    p.add_argument("--api-server-count", type=int, default=1, help="router processes (CPU is summed over them)")
    p.add_argument("--profile", help="sample the router with py-spy; collapsed stacks go here")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--fake-worker", nargs=3, metavar=("PORT", "STEP_MS", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fake_worker:
        fake_worker(int(args.fake_worker[0]), float(args.fake_worker[1]), args.fake_worker[2])
        return

    from pdserve.tiny_model import make_tiny_model

    if args.profile and shutil.which("py-spy") is None:
        raise SystemExit("--profile needs py-spy on PATH: pip install py-spy")

    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        make_tiny_model(model_dir)
        wport, rport = free_port(), free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        log = open(Path(tmp) / "procs.log", "w")
        worker = subprocess.Popen(
            [sys.executable, __file__, "--fake-worker", str(wport), str(args.step_ms), "tiny"],
            env=env,
            stdout=log,
            stderr=log,
        )
        router = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "serve", "--role", "router", "--port", str(rport), "--model", str(model_dir),
             "--served-model-name", "tiny", "--colocated", f"http://127.0.0.1:{wport}", "--health-interval", "1",
             "--api-server-count", str(args.api_server_count)],
            env=env, stdout=log, stderr=log,
        )  # fmt: skip
        procs = [router, worker]
        rows, ok = [], False
        try:
            wait_healthy(f"http://127.0.0.1:{wport}", procs)
            wait_healthy(f"http://127.0.0.1:{rport}", procs)
            rprocs, wproc = (
                [psutil.Process(router.pid), *psutil.Process(router.pid).children(recursive=True)],
                psutil.Process(worker.pid),
            )
            if args.profile:
                spy = subprocess.Popen(
                    [
                        "py-spy",
                        "record",
                        "--pid",
                        str(router.pid),
                        "--rate",
                        "250",
                        "--format",
                        "raw",
                        "--output",
                        args.profile,
                        "--nonblocking",
                        "--subprocesses",
                    ],
                    stdout=log,
                    stderr=log,
                )
                procs.insert(0, spy)
            for c in levels:
                n = args.rounds * c
                out = Path(tmp) / f"c{c}.json"
                r0, w0, t0 = _cpu(rprocs), _cpu([wproc]), time.monotonic()
                res = subprocess.run(
                    [sys.executable, "-m", "pdserve", "bench", "--base-url", f"http://127.0.0.1:{rport}", "--input-len", str(args.input_len),
                     "--output-len", str(args.output_len), "--concurrency", str(c), "--num-prompts", str(n), "--disable-tqdm",
                     "--tokenizer", str(model_dir), "--out", str(out)],
                    env=env, capture_output=True, text=True,
                )  # fmt: skip
                if res.returncode != 0 or json.loads(out.read_text())["results"][0]["failed"]:
                    raise SystemExit(f"pdserve bench failed at c={c}:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
                wall = time.monotonic() - t0
                r1, w1 = _cpu(rprocs), _cpu([wproc])
                level = json.loads(out.read_text())["results"][0]
                tokens = n * args.output_len
                rows.append({
                    "concurrency": c, "requests": n, "tokens": tokens, "wall_s": wall,
                    "router_cpu_us_per_token": 1e6 * (r1 - r0) / tokens, "worker_cpu_us_per_token": 1e6 * (w1 - w0) / tokens,
                    "output_tok_s": level["output_throughput"], "itl_median_ms": level["median_itl_ms"], "itl_p99_ms": level["p99_itl_ms"],
                    "ttft_median_ms": level["median_ttft_ms"], "completed_tokens": level["total_output_tokens"],
                })  # fmt: skip
            ok = True
            if args.profile:  # SIGINT makes py-spy write its file
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
        finally:
            stop(procs)
            log.close()
            if not ok or any(p.returncode not in (0, -signal.SIGTERM, -signal.SIGINT) for p in procs):
                print((Path(tmp) / "procs.log").read_text()[-3000:], file=sys.stderr)
    print(
        f"router per streamed token: fake worker step {args.step_ms} ms, {args.output_len} tokens a request, {args.api_server_count} router process(es), {os.cpu_count()} cores"
    )
    print(
        "| c | tokens | output tok/s | router CPU us/token | worker CPU us/token | ITL median ms | ITL p99 ms | median ITL - step ms |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['tokens']} | {r['output_tok_s']:.0f} | {r['router_cpu_us_per_token']:.0f} | {r['worker_cpu_us_per_token']:.0f} "
            f"| {r['itl_median_ms']:.2f} | {r['itl_p99_ms']:.2f} | {r['itl_median_ms'] - args.step_ms:.2f} |"
        )
    if args.profile:
        print_top(args.profile)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "cores": os.cpu_count(),
                    "step_ms": args.step_ms,
                    "api_server_count": args.api_server_count,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
