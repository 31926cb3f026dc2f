"""DeepSeek-V4 with tensor parallelism on CPU: gloo ranks as real processes, float32.

- each rank loads exactly its slice of the split weights (query heads with their sinks, output
  groups, experts' and shared expert's intermediate dims), everything else replicated
- TP2 and TP4 logits of a flat batch (chunked prefills beside decodes, sequences joining late)
  equal TP1's within 1e-5 relative (only the all-reduce summation order differs) and
  transformers' within 1e-4 (the parity tests' bound), with the same argmax at every position
- the engine's greedy tokens at TP2 / TP4 equal transformers' generate, and so do prefill TP2 ->
  decode TP1 and TP1 -> TP2 (fake connector: the KV lands in decode rank 0's pool, and every
  region is copied to rank 1); 0 blocks left in use, and the ranks exit 0 on shutdown
- sizes that do not split are refused before any rank starts, naming the dimension
- with the prefix cache at TP2, a hit restores its checkpoint's window and state on every rank:
  the tokens stay transformers'; a TP2 decode worker reusing its cached blocks for a conversation's
  next turn loads (and copies to rank 1) only the rest, with the tokens of a TP1 decode without cache

Models: the tiny checkpoint (4 heads, 2 output groups: TP2 only) and TP8, made by transformers
(8 heads in 4 groups, expert width 32: TP2 holds two groups a rank, TP4 one).
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import torch

from pdserve.distributed.group import TPGroup
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v4.config import CSA, HCA, SLIDING
from pdserve.model.deepseek_v4.loader import load_v4_model
from pdserve.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdserve.tiny_model import make_tiny_model
from tests.helpers import v4_tp_rank
from tests.helpers.v4 import (
    PROMPT_LENS,
    V4_SPLIT,
    engine,
    hf_v4_model,
    pd_hand_off,
    ranks_logits,
    requests,
    run,
    split_params,
    transformers_greedy,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("restore_torch_threads")]

TP8 = dict(
    num_hidden_layers=4, layer_types=[HCA, CSA, SLIDING, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 8}, hc_mult=2, sliding_window=8, num_attention_heads=8, o_groups=4,
    o_lora_rank=16, index_topk=3, partial_rotary_factor=8 / 32,
)  # fmt: skip
ENGINE = dict(cpu_threads=1, kv_block_size=4, max_num_batched_tokens=11)  # chunked prefill beside decodes


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4_tp")
    hf_v4_model(TP8).save_pretrained(root / "tp8")
    return {"tiny": make_tiny_model(root / "tiny", arch="deepseek_v4", seed=0), "tp8": root / "tp8"}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(4, 300, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_loads_its_slice(models, size):
    full = load_v4_model(models["tp8"], torch.float32)
    for rank in range(size):
        part = load_v4_model(models["tp8"], torch.float32, tp=TPGroup(rank=rank, size=size))
        assert split_params(full, part, rank) == V4_SPLIT
        attn = part.model.layers[0].self_attn
        assert (attn.heads, attn.o_a_proj.groups, part.model.layers[0].mlp.experts.inter) == (
            8 // size,
            4 // size,
            32 // size,
        )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("size", [2, 4])
def test_logits_equal_tp1_and_transformers(models, tmp_path, size):
    import transformers

    got = ranks_logits(models["tp8"], size, tmp_path / "logits.pt")
    tp1 = v4_tp_rank.run_steps(load_v4_model(models["tp8"], torch.float32))
    ref = transformers.AutoModelForCausalLM.from_pretrained(models["tp8"], dtype=torch.float32).eval()
    for seq, g, t in zip(v4_tp_rank.SEQUENCES, got, tp1):
        with torch.no_grad():
            expected = ref(torch.tensor([seq])).logits[0]  # [n, V], the whole sequence at once
        assert _rel(g, t) < 1e-5 and _rel(g, expected) < 1e-4
        assert torch.equal(g.argmax(-1), t.argmax(-1))


@pytest.mark.parametrize("name,size", [("tiny", 2), ("tp8", 4)])
def test_engine_greedy_equals_transformers(models, prompts, name, size):
    eng = engine(models[name], tensor_parallel_size=size, **ENGINE)
    procs = list(eng.runner.ranks.procs)
    try:
        out = run(eng, requests(prompts))
        assert [out[str(i)].outputs[0].token_ids for i in range(len(prompts))] == transformers_greedy(
            models[name], prompts
        )
        assert eng.get_stats().kv_blocks_used == 0
    finally:
        eng.shutdown()
    assert [p.returncode for p in procs] == [0] * (size - 1)  # left on STOP, not killed


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_pd_with_tp_equals_transformers(models, prompts, prefill_tp, decode_tp):
    """The handle names prefill rank 0's blocks; at decode TP2 they land in rank 0's pool and
    rank 1 computes from the copy of every region rank 0 sends it. (One process group per
    process: the two engines of this test cannot both be TP; tests/e2e/test_tp.py runs such PD pairs
    as real workers for V3.2.)"""
    final, prefill, decode, _ = pd_hand_off(
        models["tiny"], prompts, dict(ENGINE, tensor_parallel_size=prefill_tp),
        dict(ENGINE, tensor_parallel_size=decode_tp, num_kv_blocks=300),
    )  # fmt: skip
    try:
        assert [final[str(i)].outputs[0].token_ids for i in range(len(prompts))] == transformers_greedy(
            models["tiny"], prompts
        )
        assert prefill.get_stats().kv_blocks_used == 0 and decode.get_stats().kv_blocks_used == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_sizes_that_do_not_split_are_refused_before_any_rank_starts(models):
    before = psutil.Process().children(recursive=True)
    for size, match in ((3, r"num_attention_heads \(4\)"), (4, r"o_groups \(2\)")):
        with pytest.raises(ValueError, match=match + f" is not divisible by tensor_parallel_size {size}"):
            engine(models["tiny"], tensor_parallel_size=size, **ENGINE)
    assert psutil.Process().children(recursive=True) == before
    wide = ModelConfig.from_dict(
        {**json.loads((models["tp8"] / "config.json").read_text()), "moe_intermediate_size": 30}
    )
    with (
        torch.device("meta"),
        pytest.raises(ValueError, match=r"moe_intermediate_size \(30\) is not divisible by tensor_parallel_size 4"),
    ):
        DeepseekV4ForCausalLM(wide, TPGroup(rank=0, size=4))


def test_prefix_cache_hit_at_tp2_equals_transformers(models):
    """Blocks of 16 (every compressor rate of the tiny model divides them): the second prompt
    extends the first and hits its first 2 blocks; the checkpoint's window and state copies are
    done by rank 1 in its own pool too (engine/tp_protocol.py's COPY)."""
    g = torch.Generator().manual_seed(17)
    first = torch.randint(4, 300, (40,), generator=g).tolist()
    prompts = [first, first + torch.randint(4, 300, (9,), generator=g).tolist()]
    eng = engine(models["tiny"], tensor_parallel_size=2, cpu_threads=1, kv_block_size=16)
    try:
        assert eng.runner.num_checkpoints > 0
        reqs = requests(prompts)
        out = {**run(eng, reqs[:1]), **run(eng, reqs[1:])}
        assert out["1"].num_cached_tokens == 32
        assert [out[str(i)].outputs[0].token_ids for i in range(2)] == transformers_greedy(models["tiny"], prompts)
        assert eng.get_stats().kv_blocks_used == 0
    finally:
        eng.shutdown()


def test_decode_tp2_reuses_its_cached_blocks(models):
    from tests.unit.test_prefix_cache_decode import pd_pair, two_turns

    g = torch.Generator().manual_seed(21)
    conversation = (
        torch.randint(4, 280, (37,), generator=g).tolist(),
        torch.randint(4, 280, (11,), generator=g).tolist(),
    )
    prefill, decode, _ = pd_pair(models["tiny"], reuse=False)
    want = [t.outputs[0].token_ids for t in two_turns(prefill, decode, conversation)[:2]]
    prefill, decode, conn = pd_pair(models["tiny"], tensor_parallel_size=2, cpu_threads=1)
    try:
        got = [t.outputs[0].token_ids for t in two_turns(prefill, decode, conversation)[:2]]
        assert got == want and conn.stats.bytes_saved > 0
        assert decode.get_stats().kv_blocks_used == 0
    finally:
        decode.shutdown()
