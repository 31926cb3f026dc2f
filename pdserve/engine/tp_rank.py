"""One tensor-parallel rank process, ranks 1..N-1 (started by rank 0's RankProcesses, tp_ranks.py):

    die with rank 0 (PR_SET_PDEATHSIG) -> "ready/<r>" -> join -> load its shard ->
    ModelRunner.serve_forever() (FORWARD / MTP / SYNC_KV / COPY / STOP from rank 0) -> exit 0

Its own module so that model_runner -> tp_ranks and tp_rank -> model_runner do not form a circle.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta

import torch.distributed as dist

from pdserve.distributed.group import join, rank_device
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tp_ranks import RANK_START_TIMEOUT_S
from pdserve.lifetime import die_with_parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.engine.tp_rank", description="one tensor-parallel rank (started by rank 0)"
    )
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--config", required=True, help="the engine's EngineConfig as JSON")
    args = p.parse_args(argv)
    die_with_parent(args.parent_pid, signal.SIGKILL)
    # a stop signal to the worker's process group is rank 0's to handle (it drains, then sends STOP)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = EngineConfig.model_validate_json(args.config)
    timeout = timedelta(seconds=RANK_START_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", args.store_port, args.size, is_master=False, timeout=timeout)
    store.set(f"ready/{args.rank}", str(os.getpid()))
    tp = join(store, args.rank, args.size, rank_device(config.device, args.rank))

    runner = ModelRunner(config, tp=tp)
    runner.serve_forever()
    tp.destroy()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (seconds of torch module cleanup): nothing is left to do
