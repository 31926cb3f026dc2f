"""Faults under load: SIGKILL the decode worker, the prefill worker, a tensor-parallel rank and the
router at seeded random times while requests run, then check what every client saw.

    python scripts/chaos.py [--config tiny-cpu] [--requests 1000] [--concurrency 64] [--faults 5] \
        [--seed 0] [--out chaos.json]

It starts `pdserve launch` itself, on the given cluster config with a few keys set (decode's
tensor_parallel_size, so there is a rank to kill; the router's request_timeout; prefill's lease;
a short restart backoff), and stops it at the end. The load (completions, streamed and not,
greedy with ignore_eos, a pool of seeded token-id prompts) runs until --requests are done and
every fault has been made. A client retries a refused connection (the router is restarting) and a
429, nothing else. Faults come one at a time: the next only once the cluster serves again.

Checks (exit 0 only if all hold):
- every request ends with a full answer (max_tokens tokens, the same tokens as every other answer
  to that prompt) or an OpenAI error object with a message; only a request open on the router
  when the router was killed may end with its connection lost;
- none takes longer than the router's request_timeout (plus a margin);
- after each fault the restarted process serves again by itself within --serve-again seconds,
  with the greedy tokens of before;
- errors happen only while a fault is being repaired (from the kill to serving again, + 5 s);
- at the end every worker holds 0 KV blocks (within the prefill lease).
The report (stdout, and --out as JSON) gives each fault's target, time and cost (seconds to serve
again, requests that failed in its window), and the totals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pdserve.config import load_config, parse_config  # noqa: E402

TARGETS = ("decode", "prefill", "tp_rank", "router")
MODEL = "chaos"
WINDOW_MARGIN_S = 5.0
TIMEOUT_MARGIN_S = 15.0


@dataclass
class Outcome:
    index: int
    prompt: int
    kind: str = "ok"  # ok | error | connection_lost | hang | short
    code: str | None = None
    message: str = ""
    start: float = 0.0
    end: float = 0.0
    retries: int = 0
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Fault:
    target: str
    pid: int
    at: float
    serving_again_s: float | None = None
    errors: int = 0
    connections_lost: int = 0


# -- the cluster --
def cluster_yaml(args: argparse.Namespace, folder: Path) -> Path:
    data = load_config(args.config).model_dump(mode="json")
    data.update(served_model_name=MODEL, log_dir=str(folder / "logs"), restart_backoff=0.5, startup_timeout=600)
    data["router"].update(request_timeout=args.request_timeout, health_interval=0.5)
    if args.ports:
        router, prefill, decode = args.ports
        data["router"]["port"], data["prefill"][0]["port"], data["decode"][0]["port"] = router, prefill, decode
    for w in data["prefill"]:
        w["lease_seconds"] = args.lease_seconds
    data["decode"][0]["tp_size"] = args.decode_tp
    parse_config(data, "the chaos cluster")  # refuse a bad one here, not in the launcher
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Launch:
    def __init__(self, config: Path, folder: Path) -> None:
        self.folder = folder
        self.out = folder / "launch.out"
        with open(self.out, "wb") as f:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            self.proc = subprocess.Popen([sys.executable, "-m", "pdserve", "launch", "--config", str(config)],
                                         cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def wait_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while "pdserve is up" not in self.out.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not start:\n{self.out.read_text()[-3000:]}")
            time.sleep(0.5)

    def processes(self) -> dict[str, dict]:
        try:
            procs = json.loads((self.folder / "logs" / "status.json").read_text())["processes"]
        except (OSError, ValueError):
            return {}
        return {p["name"]: p for p in procs}

    def router_url(self, timeout: float) -> str:
        """The router's URL from the launcher's status file (written beside "pdserve is up", not before it)."""
        deadline = time.monotonic() + timeout
        while "router" not in (procs := self.processes()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no router in {self.folder / 'logs' / 'status.json'} after {timeout:g} s")
            time.sleep(0.2)
        return procs["router"]["url"]

    def pid_of(self, target: str) -> int:
        procs = self.processes()
        if target == "tp_rank":
            worker = procs["decode-0"]["pid"]
            with open(f"/proc/{worker}/task/{worker}/children") as f:
                return int(f.read().split()[0])
        return procs["router" if target == "router" else f"{target}-0"]["pid"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# -- the load --
class Load:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        rng = random.Random(args.seed)
        self.args = args
        self.url = url + "/v1/completions"
        self.prompts = [[rng.randrange(10, 800) for _ in range(rng.randrange(4, 40))] for _ in range(16)]
        self.max_tokens = [rng.randrange(2, args.max_tokens + 1) for _ in self.prompts]
        self.rng = rng
        self.outcomes: list[Outcome] = []
        self.faults_done = asyncio.Event()

    async def run(self, client: httpx.AsyncClient) -> None:
        async def worker() -> None:
            while len(self.outcomes) < self.args.requests or not self.faults_done.is_set():
                out = Outcome(len(self.outcomes), self.rng.randrange(len(self.prompts)))
                self.outcomes.append(out)
                await self.one(client, out, stream=self.rng.random() < 0.5)

        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))

    async def one(self, client: httpx.AsyncClient, out: Outcome, stream: bool) -> None:
        body = {"model": MODEL, "prompt": self.prompts[out.prompt], "max_tokens": self.max_tokens[out.prompt],
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": stream}  # fmt: skip
        out.start = time.monotonic()
        deadline = out.start + self.args.request_timeout + TIMEOUT_MARGIN_S
        while True:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    retry = await (self._stream(client, body, out) if stream else self._whole(client, body, out))
                if not retry:
                    break
            except httpx.ConnectError:  # nothing listens: the router is restarting, as a client would, retry
                retry = True
            except TimeoutError:
                out.kind, out.message = "hang", f"no answer within {self.args.request_timeout + TIMEOUT_MARGIN_S:.0f} s"
                break
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                out.kind, out.message = "connection_lost", type(e).__name__
                break
            except ValueError as e:  # not JSON: not an OpenAI answer
                out.kind, out.message = "short", f"not JSON: {e}"
                break
            out.retries += 1
            await asyncio.sleep(0.5)
        out.end = time.monotonic()
        if out.kind == "ok" and len(out.token_ids) != body["max_tokens"]:
            out.kind, out.message = "short", f"{len(out.token_ids)} of {body['max_tokens']} tokens"

    async def _whole(self, client: httpx.AsyncClient, body: dict, out: Outcome) -> bool:
        resp = await client.post(self.url, json=body)
        data = resp.json()
        if resp.status_code != 200:
            return self._refused(out, resp.status_code, resp.headers, data)
        out.token_ids = data["choices"][0]["token_ids"]
        return False

    async def _stream(self, client: httpx.AsyncClient, body: dict, out: Outcome) -> bool:
        async with client.stream("POST", self.url, json=body) as resp:
            if resp.status_code != 200:
                return self._refused(out, resp.status_code, resp.headers, json.loads(await resp.aread()))
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return _error(out, chunk)
                for choice in chunk.get("choices", []):
                    out.token_ids += choice.get("token_ids") or []
        return False

    def _refused(self, out: Outcome, status: int, headers: httpx.Headers, data: dict) -> bool:
        """Retry (True) a 429, or a 503 with Retry-After while time remains, as the openai client does."""
        deadline = out.start + self.args.request_timeout
        if status == 429 or (status == 503 and "retry-after" in headers and time.monotonic() + 1 < deadline):
            return True
        return _error(out, data)


def _error(out: Outcome, data: dict) -> bool:
    """An OpenAI error object: clear if it has a message (else it counts as a bad answer)."""
    err = data.get("error") or {}
    out.kind = "error" if err.get("message") else "short"
    out.code, out.message = err.get("code"), err.get("message", json.dumps(data)[:200])
    return False


# -- the faults --
async def probe(client: httpx.AsyncClient, url: str) -> list[int] | None:
    body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    try:
        resp = await client.post(url + "/v1/completions", json=body, timeout=30)
    except httpx.HTTPError:
        return None
    return resp.json()["choices"][0]["token_ids"] if resp.status_code == 200 else None


async def make_faults(args, launch: Launch, load: Load, client, url: str, want: list[int]) -> list[Fault]:
    rng = random.Random(f"{args.seed}:faults")
    targets = [t for t in TARGETS if t != "tp_rank" or args.decode_tp > 1]
    order = [targets[i % len(targets)] for i in range(args.faults)]
    rng.shuffle(order)
    faults = []
    for target in order:
        await asyncio.sleep(rng.uniform(args.min_gap, args.max_gap))
        name = "decode-0" if target == "tp_rank" else "router" if target == "router" else f"{target}-0"
        before = launch.processes()[name]["pid"]
        pid = launch.pid_of(target)
        os.kill(pid, signal.SIGKILL)
        fault = Fault(target, pid, time.monotonic())
        faults.append(fault)
        while time.monotonic() - fault.at < args.serve_again:
            replaced = launch.processes().get(name, {}).get("pid") not in (None, before)
            if replaced and await probe(client, url) == want:
                fault.serving_again_s = round(time.monotonic() - fault.at, 2)
                break
            await asyncio.sleep(0.25)
        print(f"fault {len(faults)}: SIGKILL {target} (pid {pid}): serving again after {fault.serving_again_s} s")
        if fault.serving_again_s is None:
            break
    load.faults_done.set()
    return faults


async def blocks_left(launch: Launch, wait_s: float) -> dict[str, int]:
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        while True:
            used = {}
            for name, p in launch.processes().items():
                if name != "router":
                    used[name] = (await client.get(p["url"] + "/health")).json()["kv_blocks_used"]
            if not any(used.values()) or time.monotonic() > deadline:
                return used
            await asyncio.sleep(0.5)


# -- the run --
async def chaos(args: argparse.Namespace, launch: Launch, url: str) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(trust_env=False, timeout=None, limits=limits) as client:
        want = await probe(client, url)
        load = Load(args, url)
        t0 = time.monotonic()
        faults, _ = await asyncio.gather(make_faults(args, launch, load, client, url, want), load.run(client))
        after = await probe(client, url)
        duration = time.monotonic() - t0
    blocks = await blocks_left(launch, args.lease_seconds + 5)
    return verdict(args, load, faults, blocks, want, after, duration)


def verdict(args, load: Load, faults: list[Fault], blocks: dict[str, int], want, after, duration: float) -> dict:
    outs = load.outcomes
    answers: dict[int, list[int]] = {}
    mismatched = 0
    for o in outs:
        if o.kind == "ok":
            mismatched += answers.setdefault(o.prompt, o.token_ids) != o.token_ids
    windows = [(f, f.at, f.at + (f.serving_again_s or args.serve_again) + WINDOW_MARGIN_S) for f in faults]
    unexplained = []
    for o in outs:
        if o.kind in ("error", "connection_lost"):
            hit = next((f for f, a, b in reversed(windows) if a <= o.end <= b), None)  # the latest fault
            if hit is None:
                unexplained.append(o)
            elif o.kind == "error":
                hit.errors += 1
            else:
                hit.connections_lost += 1
    lost_off_router = [o for o in outs if o.kind == "connection_lost"
                       and not any(f.target == "router" and a <= o.end <= b for f, a, b in windows)]  # fmt: skip
    kinds: dict[str, int] = {}
    codes: dict[str, int] = {}
    for o in outs:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
        if o.kind == "error":
            codes[o.code or "?"] = codes.get(o.code or "?", 0) + 1
    checks = {
        f"{args.faults} faults made": len(faults) == args.faults,
        "serving again after every fault": all(f.serving_again_s is not None for f in faults),
        "every answer full and equal per prompt": kinds.get("short", 0) == 0 and mismatched == 0,
        "no request past request_timeout": kinds.get("hang", 0) == 0,
        "connections lost only when the router died": not lost_off_router,
        "errors only while a fault is repaired": not unexplained,
        "greedy tokens as before": after == want,
        "0 KV blocks held at the end": not any(blocks.values()),
    }
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "requests": len(outs),
        "outcomes": kinds,
        "error_codes": codes,
        "error_messages": sorted({o.message for o in outs if o.kind == "error"}),
        "mismatched_answers": mismatched,
        "unexplained": [asdict(o) | {"token_ids": None} for o in unexplained[:10]],
        "faults": [asdict(f) | {"at": round(f.at - outs[0].start, 2) if outs else 0} for f in faults],
        "blocks_at_end": blocks,
        "duration_s": round(duration, 1),
        "args": {k: v for k, v in vars(args).items()},
    }


def report_text(r: dict) -> str:
    lines = [f"{r['requests']} requests in {r['duration_s']} s: {r['outcomes']}; error codes {r['error_codes']}"]
    lines += [f"  error: {m}" for m in r["error_messages"][:8]]
    lines.append("fault  target    at (s)  serving again (s)  errors  connections lost")
    for i, f in enumerate(r["faults"], 1):
        lines.append(
            f"{i:<6} {f['target']:<9} {f['at']:<7} {f['serving_again_s']!s:<18} {f['errors']:<7} {f['connections_lost']}"
        )
    lines.append(f"KV blocks at the end: {r['blocks_at_end']}")
    lines += [f"[{'ok' if v else 'FAILED'}] {k}" for k, v in r["checks"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--config", default="tiny-cpu", help="cluster config (a path or a name in configs/)")
    p.add_argument("--requests", type=int, default=1000, help="at least this many requests (more while faults remain)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16, help="each prompt's max_tokens is drawn from 2..this")
    p.add_argument("--faults", type=int, default=5, help="SIGKILLs, cycling decode, prefill, TP rank, router")
    p.add_argument("--min-gap", type=float, default=2.0, help="seconds from serving again to the next fault, at least")
    p.add_argument("--max-gap", type=float, default=8.0, help="... and at most")
    p.add_argument("--serve-again", type=float, default=60.0, help="seconds a fault may take to repair")
    p.add_argument("--request-timeout", type=float, default=60.0, help="the router's request_timeout")
    p.add_argument("--lease-seconds", type=float, default=10.0, help="prefill's KV lease")
    p.add_argument("--decode-tp", type=int, default=2, help="decode's tensor_parallel_size (a rank to kill)")
    p.add_argument("--ports", type=lambda s: [int(x) for x in s.split(",")], help="router,prefill,decode ports")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report here as JSON")
    p.add_argument("--work-dir", help="keep the cluster's config and logs here (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp:
        folder = Path(args.work_dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        launch = Launch(cluster_yaml(args, folder), folder)
        try:
            launch.wait_up(600)
            url = launch.router_url(30)
            result = asyncio.run(chaos(args, launch, url))
        finally:
            launch.stop()
    print(report_text(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
