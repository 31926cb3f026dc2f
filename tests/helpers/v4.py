"""What the DeepSeek-V4 tests share: small random transformers models (the oracle) with every
bias, sink and position bias non-zero; prompt lengths around the tiny model's rates (CSA 4, HCA 16)
and window (8), an engine on the tiny checkpoint, and a run-to-completion loop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import FirstToken, Request
from pdserve.sampling_params import SamplingParams
from tests.helpers import v4_tp_rank

VOCAB = 300
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
    q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, index_n_heads=16, index_head_dim=16,
    initializer_range=0.1, max_position_embeddings=512, eos_token_id=1, bos_token_id=0,
)  # fmt: skip
PROMPT_LENS = (3, 4, 7, 8, 9, 15, 16, 17, 31, 33)
NEW_TOKENS = [4 + (i * 7) % 15 for i in range(len(PROMPT_LENS))]  # 4..18: decode crosses 8, 16, 32, 48


def engine(tiny, connector=None, **kw) -> LLMEngine:
    cfg = dict(model=str(tiny), dtype="float32", kv_block_size=8, num_kv_blocks=256, skip_tokenizer_init=True)
    return LLMEngine(EngineConfig(**{**cfg, **kw}), connector)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(eng: LLMEngine, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        eng.add_request(r)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def requests(prompts, **kw) -> list[Request]:
    return [
        Request(request_id=str(i), prompt_token_ids=p, params=greedy(n), **kw)
        for i, (p, n) in enumerate(zip(prompts, NEW_TOKENS))
    ]


def pd_hand_off(tiny, prompts, prefill_kw, decode_kw, staging=None) -> tuple[dict, LLMEngine, LLMEngine, FakeConnector]:
    """Prefill `prompts` on one engine, hand the KV to another through the fake connector (onto
    other block ids: decode's pool is partly taken) and decode there; (decode's final outputs by
    request id, prefill engine, decode engine, decode's connector). staging: both connectors'
    StagingOptions (None: off, as on CPU by default)."""
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0, staging=staging) for e in ("P", "D")]
    prefill, decode = engine(tiny, conns[0], **prefill_kw), engine(tiny, conns[1], **decode_kw)
    decode.add_request(Request(request_id="other", prompt_token_ids=prompts[-1], params=greedy(3)))
    decode.step()  # decode's pool is partly taken: the request's blocks land on other ids
    firsts = run(prefill, requests(prompts, hold_kv=True))
    assert prefill.has_held_kv() and prefill.get_stats().kv_blocks_used > 0
    keep = prefill.runner.model.config.v4.sliding_window - 1
    for seq in prefill.scheduler.held.values():  # held for decode: only the blocks of the last W - 1 positions
        n, bs = seq.num_computed_tokens, prefill.block_manager.block_size
        assert [i for i, b in enumerate(seq.window_table) if b >= 0] == list(range(max(0, n - keep) // bs, -(-n // bs)))
    handoff = []
    for i, p in enumerate(prompts):
        out = firsts[str(i)]
        first = FirstToken(token_id=out.outputs[0].token_ids[0])
        handoff.append(
            Request(
                request_id=str(i),
                prompt_token_ids=p,
                params=greedy(NEW_TOKENS[i]),
                kv_handle=out.kv_handle,
                first_token=first,
            )
        )
    final = run(decode, handoff)
    prefill.step()  # takes the release notifications
    return final, prefill, decode, conns[1]


def hf_v4_model(extra: dict, seed: int = 0) -> DeepseekV4ForCausalLM:
    """transformers' DeepseekV4ForCausalLM of BASE updated by `extra`, random weights, float32;
    norms, sinks, hc base/scale and position biases perturbed, hash tables random."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**{**BASE, **extra}, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("position_bias"):  # norms, sinks, hc base/scale, position bias
                p.add_(torch.randn_like(p) * 0.3)
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                gate.tid2eid.copy_(torch.rand(VOCAB, gate.num_experts).argsort(-1)[:, : gate.top_k])
            else:
                gate.e_score_correction_bias.normal_(0, 0.1)
    model.generation_config.eos_token_id = None  # random models emit EOS by chance; run every step
    model.generation_config.pad_token_id = 0
    return model


def transformers_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """The oracle: transformers' greedy tokens in float32, each prompt alone, NEW_TOKENS[i] of
    prompt i (EOS off: random models emit it by chance)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id, ref.generation_config.pad_token_id = None, 0
    out = []
    for p, n in zip(prompts, NEW_TOKENS):
        ids = ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(ids[0, len(p) :].tolist())
    return out


def split_params(full: torch.nn.Module, part: torch.nn.Module, rank: int) -> set[str]:
    """Check that every parameter of `part` (rank `rank`'s shard) is the full model's own tensor
    (replicated) or its rank-th contiguous slice along the one dim that differs (stacked gate_up:
    gate rows and up rows each); returns the split names, without their layer prefix."""
    whole, split = dict(full.named_parameters()), set()
    for name, p in part.named_parameters():
        f = whole[name]
        if p.element_size() == 1:  # FP8 / packed FP4: compare the bytes
            p, f = p.view(torch.uint8), f.view(torch.uint8)
        if p.shape == f.shape:
            assert torch.equal(p, f), name
            continue
        split.add(name.split(".", 3)[-1] if name.startswith("model.layers.") else name)
        dim = next(d for d in range(f.dim()) if p.shape[d] != f.shape[d])
        n = p.shape[dim]
        if name.endswith(("gate_up_proj", "gate_up_proj_scale_inv")):
            gate, up = f.chunk(2, dim=1)
            want = torch.cat([gate.narrow(1, rank * n // 2, n // 2), up.narrow(1, rank * n // 2, n // 2)], dim=1)
        else:
            want = f.narrow(dim, rank * n, n)
        assert torch.equal(p, want), name
    return split


# what tensor parallelism splits in a V4 layer; the rest (embedding, lm_head, mHC, norms, q_a_proj,
# kv_proj, compressors, indexer, router, hash table) is replicated
V4_SPLIT = {
    "self_attn.q_b_proj.weight", "self_attn.sinks", "self_attn.o_a_proj.weight", "self_attn.o_b_proj.weight",
    "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
    "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight",
}  # fmt: skip
# and, with the weights kept as V4-Flash ships them, the scales of the split FP8 and FP4 ones
V4_SCALES = {
    "self_attn.q_b_proj.weight_scale_inv", "self_attn.o_a_proj.weight_scale_inv", "self_attn.o_b_proj.weight_scale_inv",
    "mlp.experts.gate_up_proj_scale_inv", "mlp.experts.down_proj_scale_inv", "mlp.shared_experts.gate_proj.weight_scale_inv",
    "mlp.shared_experts.up_proj.weight_scale_inv", "mlp.shared_experts.down_proj.weight_scale_inv",
}  # fmt: skip


def ranks_logits(model_dir: Path, size: int, out: Path) -> list[torch.Tensor]:
    """v4_tp_rank.run_steps on `size` gloo rank processes; rank 0's logits."""
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    script = Path(v4_tp_rank.__file__)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                "--rank",
                str(r),
                "--size",
                str(size),
                "--store-port",
                str(store.port),
                "--model",
                str(model_dir),
                "--out",
                str(out),
            ]
        )  # fmt: skip
        for r in range(size)
    ]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0] * size
    return torch.load(out)


def cache_bytes(config, bytes_per_value: int = 2) -> dict[str, int | float]:
    """A reference count of one V4 sequence's cache state over all layers, at `bytes_per_value`
    (2: bf16), from the layer kinds alone (the pool's regions hold the same: deepseek_v4/cache.py).
    "per_token": growth per token (compressed entries and indexer keys: CSA (D + Di) / m, HCA
    D / m), "window": the sliding windows (W-1 records of D, fixed once n >= W-1), "running_max":
    the compressors' running state at its largest (pending kv + gate of m-1 tokens; CSA: two series
    and the overlap)."""
    from pdserve.model.deepseek_v4.config import CSA, HCA

    v4, D, Di = config.v4, config.v4.head_dim, config.index_head_dim
    per_token = window = running = 0.0
    for i, kind in enumerate(v4.layer_types):
        window += (v4.sliding_window - 1) * D
        m = v4.compress_rate(i)
        if kind == HCA:
            per_token += D / m
            running += (m - 1) * 2 * D  # pending kv + gate
        elif kind == CSA:
            per_token += (D + Di) / m
            running += (m - 1) * 2 * (2 * D + 2 * Di) + m * 2 * (D + Di)  # pending (two series) + overlap
    b = bytes_per_value
    return {"per_token": per_token * b, "window": int(window * b), "running_max": int(running * b)}
