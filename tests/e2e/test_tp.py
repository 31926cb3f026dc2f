"""Tensor parallelism on CPU: gloo ranks as real processes, the tiny V3 / V3.2 models (4 heads,
8 experts), float32.

- each rank loads exactly its slice of every split weight, the rest replicated
- TP2 and TP4 greedy tokens equal TP1's, token for token (one batch: chunked prefills, decodes)
- ranks stop cleanly (exit 0) on shutdown; a dead rank fails the next step with its name
- PD with TP on both sides, real NIXL: prefill TP2 -> decode TP1, TP1 -> TP2, TP2 -> TP2 give the
  colocated engine's tokens and every worker ends with 0 KV blocks used; a SIGKILLed worker takes
  its ranks with it (PR_SET_PDEATHSIG) and a stopped one leaves none behind
"""

from __future__ import annotations

import os
import random
import signal

import httpx
import psutil
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.distributed.group import TPGroup
from pdserve.engine import tp_protocol as protocol
from pdserve.model.loader import load_model
from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster, wait_blocks_free

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("restore_torch_threads")]

ARCHS = ("deepseek_v3", "deepseek_v32")
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(4, 800) for _ in range(n)] for n in (1, 3, 6, 11, 17, 24, 33)]
MAX_TOKENS = (9, 4, 12, 1, 7, 10, 5)
# small blocks and a 16-token step budget: prefills are chunked and share steps with decodes
ENGINE = dict(cpu_threads=1, kv_block_size=4, num_kv_blocks=128, max_num_batched_tokens=16, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    return {arch: str(make_tiny_model(root / arch, arch)) for arch in ARCHS}


def _generate(llm: LLM, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def tp1_tokens(models) -> dict[str, list[list[int]]]:
    return {arch: _generate(LLM(models[arch], **ENGINE)) for arch in ARCHS}


def test_each_rank_loads_its_slice(models):
    full = dict(load_model(models["deepseek_v32"], torch.float32, progress=False).named_parameters())
    split: set[str] = set()
    for rank in range(2):
        part = load_model(models["deepseek_v32"], torch.float32, progress=False, tp=TPGroup(rank=rank, size=2))
        for name, p in part.named_parameters():
            f = full[name]
            if p.shape == f.shape:
                assert torch.equal(p, f), name  # replicated
                continue
            split.add(name.split(".", 3)[-1] if name.startswith("model.layers.") else name)
            dim = next(d for d in range(f.dim()) if p.shape[d] != f.shape[d])
            n = p.shape[dim]
            if name.endswith("gate_up_proj"):  # gate rows and up rows are split separately
                gate, up = f.chunk(2, dim=1)
                want = torch.cat([gate.narrow(1, rank * n // 2, n // 2), up.narrow(1, rank * n // 2, n // 2)], dim=1)
            else:
                want = f.narrow(dim, rank * n, n)
            assert torch.equal(p, want), name
    assert split == {
        "self_attn.q_b_proj.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
        "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight",
        "mlp.shared_experts.down_proj.weight",
    }  # fmt: skip  (embedding, lm_head, q_a/kv_a, norms, router and indexer stay replicated)


def test_sizes_that_do_not_split_are_refused_before_any_rank_starts(models):
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size 3"):
        LLM(models["deepseek_v3"], tensor_parallel_size=3, **ENGINE)
    assert psutil.Process().children(recursive=True) == before


@pytest.mark.parametrize(
    "arch,tp,overlap",
    [("deepseek_v3", 2, False), ("deepseek_v3", 4, False), ("deepseek_v32", 2, False), ("deepseek_v32", 4, False),
     ("deepseek_v3", 2, True), ("deepseek_v32", 4, True)],
)  # fmt: skip
def test_greedy_tokens_equal_tp1(models, tp1_tokens, arch, tp, overlap):
    """overlap: the overlapped loop, rank 0 sending each step's ids with its in-flight tokens."""
    llm = LLM(models[arch], tensor_parallel_size=tp, async_scheduling=overlap, **ENGINE)
    procs = list(llm.engine.runner.ranks.procs)
    sent, send = [], protocol.send_forward

    def spy(group, step, command=protocol.Command.FORWARD, fed: bool = False) -> None:
        sent.append(fed)
        send(group, step, command, fed=fed)

    protocol.send_forward = spy
    try:
        assert len(procs) == tp - 1
        assert _generate(llm) == tp1_tokens[arch]
        assert any(sent) == overlap, sent
    finally:
        protocol.send_forward = send
        llm.engine.shutdown()
    assert [p.returncode for p in procs] == [0] * (tp - 1)  # left on STOP, not killed
    llm.engine.shutdown()  # idempotent


def test_a_dead_rank_fails_the_next_step_with_its_name(models):
    llm = LLM(models["deepseek_v3"], tensor_parallel_size=2, **ENGINE)
    rank1 = llm.engine.runner.ranks.procs[0]
    try:
        rank1.kill()
        rank1.wait()
        with pytest.raises(RuntimeError, match=rf"tensor-parallel rank 1 \(pid {rank1.pid}\) exited"):
            _generate(llm)
    finally:
        llm.engine.shutdown()


# -- PD with tensor parallelism on both sides (real processes, real NIXL) --
def _complete(router, prompt: list[int], max_tokens: int) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_pd_with_unequal_tp_sizes_equals_colocated(models, tmp_path):
    """V3.2: decode ranks 1.. must get both the latent and the indexer keys from rank 0."""
    model = models["deepseek_v32"]
    colocated = _generate(LLM(model, **ENGINE))
    with Cluster(model, tmp_path / "logs", kv_blocks=64) as c:
        p1 = c.worker("prefill")
        p2 = c.worker("prefill", "--tensor-parallel-size", "2")
        d1 = c.worker("decode", peers=[p2])
        d2 = c.worker("decode", "--tensor-parallel-size", "2", peers=[p1, p2])
        routers = {"TP2->TP1": c.router(prefill=[p2], decode=[d1]), "TP1->TP2": c.router(prefill=[p1], decode=[d2]),
                   "TP2->TP2": c.router(prefill=[p2], decode=[d2])}  # fmt: skip
        c.wait_healthy()
        ranks = [r for w in (p2, d2) for r in psutil.Process(w.popen.pid).children(recursive=True)]  # p2's, d2's
        assert len(ranks) == 2
        for name, router in routers.items():
            got = [_complete(router, p, m) for p, m in zip(PROMPTS, MAX_TOKENS)]
            assert got == colocated, name
        assert not any(wait_blocks_free([p1, p2, d1, d2]).values())
        os.kill(d2.popen.pid, signal.SIGKILL)  # the worker alone, not its process group
        d2.popen.wait()
        _, alive = psutil.wait_procs(ranks[1:], timeout=15)
        assert not alive, f"rank orphaned by a killed worker: {alive}"
    _, alive = psutil.wait_procs(ranks, timeout=15)
    assert not alive, f"rank outlived its stopped worker: {alive}"
