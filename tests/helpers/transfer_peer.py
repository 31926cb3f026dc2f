"""A prefill-side NIXL peer for tests/unit/test_transfer.py, run as its own process.

It fills a KVCache with seeded random data, registers it with a NixlConnector, serves the connector's
metadata at http://127.0.0.1:<free port>/metadata, prints one JSON line {"metadata_url": ...} and
then answers JSON-line commands on stdin, one JSON line each on stdout:

    {"op": "prefill", "request_id": str, "block_ids": [int], "num_tokens": int,
     "kv_to": optional {"engine_id": str, "metadata": str}: the decode engine it goes to} -> {"handle": KVHandle}
    {"op": "poll"}  -> {"released": [str], "leases": int, "leases_released": int, "lease_expirations": int,
                        "staging_used": int (bytes of the staging arena in slabs)}
    {"op": "handoff", "engine_id": str, "metadata": str (a decode connector's peer_metadata()), "payload": str}
                    -> {"sent": true} | {"error": str}   (send_handoff to that decode connector)
    {"op": "flip", "region": str, "block": int} -> {"flipped": true}   (the low bit of that block's
                    first byte in layer 0: the pool corrupted after the lease)
    {"op": "exit"}  -> {"bye": true}, after shutdown()

All connector calls happen on the main thread; the HTTP thread serves bytes built at registration.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from pdserve.model.kv_cache import KVCache, KVRegionSpec

SPECS = [KVRegionSpec("latent", 40), KVRegionSpec("index_k", 16)]
NUM_LAYERS, BLOCK_SIZE = 3, 4


def make_kv(dtype: torch.dtype, seed: int, num_blocks: int, device: str = "cpu") -> KVCache:
    """A pool of random records, the same for the same (dtype, seed, num_blocks) in every process."""
    kv = KVCache(SPECS, NUM_LAYERS, num_blocks, BLOCK_SIZE, dtype, device)
    gen = torch.Generator().manual_seed(seed)
    for t in kv.regions.values():
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(dtype))
    return kv


def serve_metadata(body: bytes) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metadata":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    # nixl's Python logger writes to sys.stdout; keep stdout for the replies only
    replies, sys.stdout = sys.stdout, sys.stderr
    from pdserve.disagg.base import PeerMetadata
    from pdserve.disagg.factory import StagingOptions
    from pdserve.disagg.nixl.connector import NixlConnector

    p = argparse.ArgumentParser()
    p.add_argument("--engine-id", required=True)
    p.add_argument("--model-id", default="tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=32)
    p.add_argument("--device", default="cpu", help="the pool's device (cuda: exported through CUDA IPC)")
    p.add_argument("--lease-s", type=float, default=60.0)
    p.add_argument("--staging-mib", type=int, default=0, help="a staging arena of this size (0: staging off)")
    p.add_argument("--poll-ms", type=float, default=20.0, help="the engine loop's poll interval while it holds KV")
    p.add_argument("--progress-interval-ms", type=float, default=1.0, help="the connector's progress thread (0: none)")
    args = p.parse_args()

    staging = StagingOptions(
        mode="on" if args.staging_mib else "off", prefill_arena_mib=args.staging_mib, decode_arena_mib=0
    )
    conn = NixlConnector(
        args.engine_id,
        model_id=args.model_id,
        lease_s=args.lease_s,
        progress_thread=False,
        role="prefill",
        staging=staging,
        progress_interval_ms=args.progress_interval_ms,
    )  # as a worker runs it
    conn.register_kv_cache(make_kv(getattr(torch, args.dtype), args.seed, args.num_blocks, args.device))
    server = serve_metadata(conn.peer_metadata())
    conn.metadata_url = f"http://127.0.0.1:{server.server_address[1]}/metadata"

    # what a prefill worker's engine loop does while it holds KV: poll the connector every 20 ms
    # (beside the connector's own progress thread, which advances the peer's side of a read)
    lock, released, stop = threading.Lock(), [], threading.Event()

    def poller() -> None:
        while not stop.wait(args.poll_ms / 1000):
            with lock:
                released.extend(conn.poll_releases())

    threading.Thread(target=poller, daemon=True).start()

    def reply(doc: dict) -> None:
        replies.write(json.dumps(doc) + "\n")
        replies.flush()

    reply({"metadata_url": conn.metadata_url})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "prefill":
            to = cmd.get("kv_to")
            kv_to = (
                PeerMetadata(engine_id=to["engine_id"], instance_id=None, data=to["metadata"].encode()) if to else None
            )
            with lock:
                handle = conn.on_prefill_finished(cmd["request_id"], cmd["block_ids"], cmd["num_tokens"], kv_to=kv_to)
            reply({"handle": handle.model_dump()})
        elif cmd["op"] == "poll":
            with lock:
                released.extend(conn.poll_releases())
                done, released[:] = list(released), []
                s = conn.stats
                used = conn.staging_arena.used_bytes if conn.staging_arena is not None else 0
                reply({"released": done, "leases": len(conn.leases), "leases_released": s.leases_released,
                       "lease_expirations": s.lease_expirations, "staging_used": used})  # fmt: skip
        elif cmd["op"] == "handoff":
            peer = PeerMetadata(engine_id=cmd["engine_id"], instance_id=None, data=cmd["metadata"].encode())
            try:
                with lock:
                    conn.send_handoff(peer, cmd["payload"].encode())
                reply({"sent": True})
            except Exception as e:
                reply({"error": f"{type(e).__name__}: {e}"})
        elif cmd["op"] == "flip":
            with lock:
                conn.kv.regions[cmd["region"]][0, cmd["block"]].view(-1).view(torch.uint8)[0] ^= 1
            reply({"flipped": True})
        elif cmd["op"] == "exit":
            break
        else:
            reply({"error": f"unknown op {cmd['op']!r}"})
    stop.set()
    with lock:
        conn.shutdown()
    server.shutdown()
    reply({"bye": True})


if __name__ == "__main__":
    main()
