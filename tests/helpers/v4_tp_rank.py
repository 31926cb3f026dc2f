"""One gloo rank of a tensor-parallel DeepSeek-V4 for tests/e2e/test_v4_tp.py, run as its own process:

    python tests/helpers/v4_tp_rank.py --rank R --size N --store-port P --model DIR --out FILE

joins the group through the test's TCPStore, loads its shard, runs `run_steps` over SEQUENCES and
(rank 0) saves the logits of every token to FILE. `run_steps` is also what the test runs at TP1.

Legend: B sequences, n tokens of a sequence, V vocab.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.distributed.group import join  # noqa: E402
from pdserve.model.deepseek_v4.loader import load_v4_model  # noqa: E402
from pdserve.model.deepseek_v4.model import DeepseekV4ForCausalLM  # noqa: E402
from tests.helpers.v4_pool import PoolRunner  # noqa: E402

# prompt lengths around the rates (4, 8) and the window (8); each sequence: prompt + 6 fed tokens
PROMPT_LENS = (3, 8, 9, 17, 30)
DECODE = 6
_g = torch.Generator().manual_seed(11)
SEQUENCES = [torch.randint(4, 300, (n + DECODE,), generator=_g).tolist() for n in PROMPT_LENS]
CHUNK = 7  # prefill chunk size: longer prompts take several steps beside the others' decodes


@torch.no_grad()
def run_steps(model: DeepseekV4ForCausalLM) -> list[torch.Tensor]:
    """Feed SEQUENCES as an engine would: sequence b joins at step b % 3, its prompt in chunks of
    CHUNK, then one token a step; all running sequences in one flat forward over a paged pool (v4_pool.py). Logits [n, V] each."""
    pool = PoolRunner(model)
    seqs = [pool.new_sequence() for _ in SEQUENCES]
    fed, out = [0] * len(SEQUENCES), [[] for _ in SEQUENCES]
    step = 0
    while any(f < len(s) for f, s in zip(fed, SEQUENCES)):
        work = []  # (sequence, tokens fed this step)
        for b, (seq, n_prompt) in enumerate(zip(SEQUENCES, PROMPT_LENS)):
            if step >= b % 3 and fed[b] < len(seq):
                n = min(CHUNK, n_prompt - fed[b]) if fed[b] < n_prompt else 1
                work.append((b, seq[fed[b] : fed[b] + n]))
        lens = [len(toks) for _, toks in work]
        hidden = pool(torch.tensor([t for _, toks in work for t in toks]), lens, [seqs[b] for b, _ in work])
        for (b, _), logits in zip(work, pool.compute_logits(hidden).split(lens)):
            out[b].append(logits)
            fed[b] += logits.shape[0]
        step += 1
    return [torch.cat(o) for o in out]


def main() -> int:
    p = argparse.ArgumentParser()
    for flag in ("--rank", "--size", "--store-port"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.store_port, args.size, is_master=False, timeout=timedelta(seconds=120))
    tp = join(store, args.rank, args.size, torch.device("cpu"))
    logits = run_steps(load_v4_model(args.model, torch.float32, tp=tp))
    if tp.is_driver:
        torch.save(logits, args.out)
    tp.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
