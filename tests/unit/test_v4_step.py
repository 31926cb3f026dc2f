"""V4Step's indices (pdserve/model/deepseek_v4/step.py) against pool rows labelled by hand: random block
tables, window tables and steps (decode-only and mixed); every row a query may read is named
with what it holds, and each query's indices must name exactly the keys it may read, each
compressor group exactly its positions, each write its own row."""

from __future__ import annotations

import random

import torch

from pdserve.model.batch import ForwardBatch, StepInputs
from pdserve.model.deepseek_v4.step import build_step
from pdserve.model.rope import RotaryEmbedding


class _Rope(RotaryEmbedding):
    def __init__(self) -> None:
        torch.nn.Module.__init__(self)

    def forward(self, positions: torch.Tensor):  # only the shapes matter here
        return positions[:, None].float(), positions[:, None].float()


def _step(rng: random.Random, decode: bool, window: int, rates: tuple[int, ...], bs: int):
    B = rng.randint(1, 5)
    starts = [rng.choice([0, 1, 3, window, 4 * window + 1, rng.randint(0, 70)]) for _ in range(B)]
    lens = [1 if decode else rng.randint(1, 12) for _ in range(B)]
    width = -(-(max(s + n for s, n in zip(starts, lens))) // bs)
    perm = torch.randperm(B * width * 2, generator=torch.Generator().manual_seed(rng.randint(0, 99)))
    tables, wtables = perm[: B * width].view(B, width), perm[B * width :].view(B, width).clone()
    K = window - 1
    for b, (n, ln) in enumerate(zip(starts, lens)):  # as engine/block_manager.py: window blocks for
        first_new = max(n, n + ln - K)  # the last K positions before the step and the step's last K
        for i in range(width):
            if (i + 1) * bs <= n - K or (n == 0 or (n - 1) // bs < i) and i < first_new // bs:
                wtables[b, i] = -1
    ids = torch.arange(sum(lens))
    step = StepInputs(
        ids, torch.tensor(lens), torch.tensor(starts), torch.ones(B, dtype=torch.bool), tables, wtables, torch.arange(B)
    )
    return ForwardBatch.build(step, bs), starts, lens, tables, wtables


def test_indices_name_exactly_the_keys_each_query_may_read():
    rng = random.Random(0)
    for trial in range(60):
        window, bs = rng.choice([2, 5, 8]), rng.choice([4, 8, 16])
        rates = tuple(sorted({rng.choice([4, 16]), rng.choice([4, 8, 16, 32])}))
        decode = trial % 2 == 0
        batch, starts, lens, tables, wtables = _step(rng, decode, window, rates, bs)
        if batch.prefill is not None and decode:
            continue
        step = build_step(
            batch, {"main": _Rope(), "compress": _Rope()}, window, {rates[0]}, set(rates[1:]) or {rates[0]}
        )
        queries = [(b, n + i) for b, (n, ln) in enumerate(zip(starts, lens)) for i in range(ln)]
        wlabel = {
            int(wtables[b, p // bs]) * bs + p % bs: (b, p)
            for b in range(len(starts))
            for p in range(starts[b] + lens[b])
            if wtables[b, p // bs] >= 0
        }
        if step.window_old is None:  # decode: rows of the window region
            keys = wlabel
        else:  # rows of the key buffer: W-1 records before each chunk, then the new tokens
            K = window - 1
            keys = {b * K + j: (b, n - K + j) for b, n in enumerate(starts) for j in range(K) if n - K + j >= 0}
            keys |= {len(starts) * K + t: q for t, q in enumerate(queries)}
            for r, lab in keys.items():
                if r < len(starts) * K:
                    assert wlabel[int(step.window_old[r])] == lab
        for t, (b, p) in enumerate(queries):
            got = [keys[r] for r in step.window[t].tolist() if r >= 0]
            assert got == [(b, q) for q in range(max(0, p - window + 1), p + 1)]  # ascending
            src = t if step.window_src is None else int(step.window_src[t])
            dst = int(step.window_write[t])
            assert wlabel[dst] == queries[src] and queries[src][0] == b  # its own record, or its sequence's last one
            if wtables[b, p // bs] >= 0:
                assert src == t
        for m, ix in step.entries.items():
            rpb = -(-bs // m)
            elabel = {
                int(tables[b, e * m // bs]) * rpb + (e * m % bs) // m: (b, e)
                for b in range(len(starts))
                for e in range((starts[b] + lens[b] + m - 1) // m)
            }
            assert ix.seen.tolist() == [(p + 1) // m for _, p in queries]
            if ix.visible is not None:
                for t, (b, p) in enumerate(queries):
                    assert sorted(elabel[r] for r in ix.visible[t].tolist() if r >= 0) == [
                        (b, e) for e in range((p + 1) // m)
                    ]
            g = ix.groups
            want = [(b, e) for b, (n, ln) in enumerate(zip(starts, lens)) for e in range(n // m, (n + ln - 1) // m + 1)]
            got = [elabel[int(r)] for r in g.slot]
            assert got[: len(want)] == want and set(got[len(want) :]) <= {want[-1]}  # padding repeats the last group
            B, T = len(starts), len(queries)
            for u, (b, e) in enumerate(want):
                for j in range(m):
                    q = e * m + j
                    assert bool(g.present[u, j]) == (q < starts[b] + lens[b])
                    if g.present[u, j]:
                        r = int(g.src[u, j])
                        assert (
                            (r == b * (m - 1) + j)
                            if q < starts[b]
                            else (r - B * (m - 1) < T and queries[r - B * (m - 1)] == (b, q))
                        )
                assert bool(g.first[u]) == (e == starts[b] // m) and bool(g.has_prev[u]) == (e >= 1)
                if not g.first[u]:
                    assert want[int(g.prev[u])] == (b, e - 1)
            assert [want[int(u)] for u in g.last] == [
                (b, (n + ln - 1) // m) for b, (n, ln) in enumerate(zip(starts, lens))
            ]
            assert g.pending.tolist() == [(n + ln) % m for n, ln in zip(starts, lens)]


def test_decode_group_plan_is_group_plan():
    """The decode step's short path gives the general plan's groups (its first B: the real ones)."""
    from pdserve.model.deepseek_v4.step import decode_group_plan, entry_table, group_plan

    rng = random.Random(7)
    for _ in range(200):
        bs, m = rng.choice([4, 8, 16]), rng.choice([4, 16, 128])
        batch, *_ = _step(rng, True, 8, (m,), bs)
        table, page = entry_table(batch.block_tables, m, bs)
        fast, general = (
            decode_group_plan(batch, m, table, page, _Rope()),
            group_plan(batch, m, table, page, False, _Rope()),
        )
        B = batch.starts.shape[0]
        for name in ("seq", "src", "present", "first", "prev", "has_prev", "slot"):
            assert torch.equal(getattr(fast, name), getattr(general, name)[:B]), name
        assert torch.equal(fast.last, general.last) and torch.equal(fast.pending, general.pending)
        assert torch.equal(fast.rope[0], general.rope[0][:B]) and torch.equal(fast.rope[1], general.rope[1][:B])
