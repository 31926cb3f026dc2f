"""LLMEngine batching, preemption, aborts, stop conditions and PD hooks, on a fake model.

`FakeModel` is a TEST DOUBLE for DeepseekForCausalLM: it checks the engine's batching and KV
bookkeeping, not modeling. Each token's record (embedding + position embedding) is written to the
paged cache at its slot, and each token's hidden state is read back ONLY through the cache at its
context slots, so a wrong slot mapping, block table, context or chunk boundary changes the tokens.
`reference_greedy` computes the same function without any cache, one sequence at a time.

`CopyConnector` is a TEST DOUBLE for a KVConnector: it copies blocks between two engines' KV
caches in-process, so the PD hooks can be tested without NIXL.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

import pytest
import torch

from pdserve.disagg.base import KVConnector, KVHandle, KVPeerRef, PeerMetadata, TransferError, TransferStage
from pdserve.disagg.stats import TransferStats
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import FirstToken, Handoff, Request
from pdserve.model.batch import ForwardBatch
from pdserve.model.kv_cache import KVCache, KVRegionSpec
from pdserve.sampling_params import SamplingParams
from pdserve_kernels.ref import paged_slots

pytestmark = pytest.mark.timeout(120)

VOCAB, DIM, EOS = 64, 16, 1


def add(
    engine: LLMEngine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams | None = None,
    *,
    first_token: int | None = None,
    **kw,
) -> None:
    """engine.add_request with a Request built from the pieces the tests vary."""
    first = FirstToken(token_id=first_token) if first_token is not None else None
    engine.add_request(
        Request(
            request_id=request_id, prompt_token_ids=prompt, params=params or SamplingParams(), first_token=first, **kw
        )
    )


@dataclass(frozen=True)
class FakeConfig:
    vocab_size: int = VOCAB
    max_position_embeddings: int = 256
    eos_token_ids: tuple[int, ...] = (EOS,)


class FakeModel(torch.nn.Module):
    """Test double (see module docstring): deterministic, reads context only from the KV cache."""

    num_layers = 2

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.config = FakeConfig()
        self.emb = torch.randn(VOCAB, DIM, generator=g)
        self.pos = torch.randn(self.config.max_position_embeddings, DIM, generator=g)
        self.out = torch.randn(VOCAB, DIM, generator=g) * 3

    def kv_cache_specs(self, kv_cache_dtype: str = "auto") -> list[KVRegionSpec]:
        return [KVRegionSpec("latent", DIM)]

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        record = self.emb[batch.input_ids] + self.pos[batch.positions]  # [T, D]
        context = paged_slots(
            batch.block_tables, batch.seq_ids, batch.context_lens, batch.block_size, batch.max_context
        )
        summary = torch.zeros_like(record)
        for layer in range(self.num_layers):
            cache = kv_cache.layer("latent", layer)
            cache[batch.slot_mapping] = record * (layer + 1)
            ctx = cache[context.clamp(min=0).long()]  # [T, C, D]
            ctx = ctx * (context >= 0)[..., None]
            summary = summary + ctx.sum(dim=1) / (layer + 1)
        n = (context >= 0).sum(dim=1, keepdim=True)  # [T, 1]
        return torch.tanh(summary / (2 * n.sqrt()) + self.emb[batch.input_ids])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.out.t()).float()

    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens)
        record = self.emb[ids] + self.pos[: len(tokens)]
        hidden = torch.tanh(record.sum(0) / math.sqrt(len(tokens)) + self.emb[ids[-1]])
        return hidden @ self.out.t()


def reference_greedy(model: FakeModel, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(model.reference_logits(tokens).argmax()))
    return tokens[len(prompt) :]


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "fake"}))
    return str(tmp_path)


def make_engine(model_dir, connector=None, seed=0, **kw) -> LLMEngine:
    cfg = dict(model=model_dir, skip_tokenizer_init=True, kv_block_size=4, num_kv_blocks=256, max_num_batched_tokens=32)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), connector, model=FakeModel(seed))


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, object]:
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


PROMPTS = [[(7 * i + 3 * j) % (VOCAB - 2) + 2 for j in range(n)] for i, n in enumerate([1, 3, 5, 9, 17, 30, 41, 60])]
GREEDY = SamplingParams(temperature=0, ignore_eos=True)


def greedy(max_tokens: int) -> SamplingParams:
    return GREEDY.model_copy(update={"max_tokens": max_tokens})


def test_batched_greedy_matches_cacheless_reference(model_dir):
    engine = make_engine(model_dir)
    lens = [5 + 3 * i for i in range(len(PROMPTS))]  # finish at different steps
    for i, (p, n) in enumerate(zip(PROMPTS, lens)):
        add(engine, str(i), p, greedy(n))
    final = run_all(engine)
    ref = FakeModel(0)
    for i, (p, n) in enumerate(zip(PROMPTS, lens)):
        out = final[str(i)].outputs[0]
        assert out.token_ids == reference_greedy(ref, p, n), f"request {i}"
        assert out.finish_reason == "length"
    assert engine.get_stats().kv_blocks_used == 0


def test_preemption_recomputes_and_returns_every_block(model_dir):
    # 24 blocks of 4 tokens: the prompts alone need more, so sequences are preempted and recomputed
    engine = make_engine(model_dir, num_kv_blocks=24, max_model_len=96)
    for i, p in enumerate(PROMPTS):
        add(engine, str(i), p, greedy(24))
    final = run_all(engine)
    ref = FakeModel(0)
    assert engine.get_stats().num_preemptions > 0
    for i, p in enumerate(PROMPTS):
        assert final[str(i)].outputs[0].token_ids == reference_greedy(ref, p, 24)
    assert engine.get_stats().kv_blocks_used == 0


def test_chunked_prefill_respects_the_token_budget(model_dir):
    engine = make_engine(model_dir, max_num_batched_tokens=8)
    seen = []
    original = engine.runner.launch

    def spy(sched, prev=None):
        seen.append(sched.num_batched_tokens)
        return original(sched, prev)

    engine.runner.launch = spy
    add(engine, "long", PROMPTS[-1], greedy(3))
    final = run_all(engine)
    assert max(seen) <= 8 and seen[:2] == [8, 8]
    assert final["long"].outputs[0].token_ids == reference_greedy(FakeModel(0), PROMPTS[-1], 3)


def test_seeded_sampling_does_not_depend_on_the_batch(model_dir):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = make_engine(model_dir, seed=0)
    add(alone, "x", PROMPTS[3], params)
    want = run_all(alone)["x"].outputs[0].token_ids
    crowd = make_engine(model_dir, seed=0)
    for i, p in enumerate(PROMPTS):
        add(crowd, str(i), p, SamplingParams(temperature=1.0, max_tokens=5 + i, ignore_eos=True))
        if i == 4:
            add(crowd, "x", PROMPTS[3], params)
    assert run_all(crowd)["x"].outputs[0].token_ids == want
    other = make_engine(model_dir)
    add(other, "x", PROMPTS[3], params.model_copy(update={"seed": 99}))
    assert run_all(other)["x"].outputs[0].token_ids != want


def test_stop_token_ids_eos_and_min_tokens(model_dir):
    ref = reference_greedy(FakeModel(0), PROMPTS[4], 10)
    stop_at = next(i for i, t in enumerate(ref) if t not in ref[:i])  # first occurrence is at index stop_at
    stop_at = max(stop_at, 2)
    stop_tok = ref[stop_at]
    first = ref.index(stop_tok)
    engine = make_engine(model_dir)
    add(engine, "stop", PROMPTS[4], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]))
    out = run_all(engine)["stop"].outputs[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    # EOS, unless ignore_eos: make EOS the greedy pick by naming it a stop token of the fake model
    engine.runner.eos_token_ids.add(stop_tok)
    engine.eos_token_ids.add(stop_tok)
    add(engine, "eos", PROMPTS[4], SamplingParams(temperature=0, max_tokens=10))
    out = run_all(engine)["eos"].outputs[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason is None


def test_min_tokens_masks_stop_tokens(model_dir):
    ref = reference_greedy(FakeModel(0), PROMPTS[2], 6)
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, stop_token_ids=[ref[0]])
    add(engine, "m", PROMPTS[2], params)
    out = run_all(engine)["m"].outputs[0]
    assert len(out.token_ids) == 6 and ref[0] not in out.token_ids[:6] and out.finish_reason == "length"


def test_max_model_len_finishes_with_length(model_dir):
    engine = make_engine(model_dir, max_model_len=20)
    add(engine, "a", PROMPTS[4], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    out = run_all(engine)["a"]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 20
    assert out.outputs[0].finish_reason == "length"


def test_abort_frees_blocks_and_reports(model_dir):
    engine = make_engine(model_dir)
    for i, p in enumerate(PROMPTS):
        add(engine, str(i), p, greedy(50))
    for _ in range(4):
        engine.step()
    assert engine.get_stats().kv_blocks_used > 0
    for i in range(len(PROMPTS)):
        engine.abort_request(str(i))
    outs = engine.step()
    assert {o.request_id for o in outs} == {str(i) for i in range(len(PROMPTS))}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_blocks_used == 0
    add(engine, "0", PROMPTS[0], greedy(2))  # the id is free again
    assert run_all(engine)["0"].outputs[0].token_ids == reference_greedy(FakeModel(0), PROMPTS[0], 2)


def test_logprobs_are_attached(model_dir):
    engine = make_engine(model_dir)
    add(engine, "lp", PROMPTS[3], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))
    out = run_all(engine)["lp"].outputs[0]
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert next(iter(entry)) == tok and entry[tok].rank == 1  # greedy: the sampled token is the top one
        assert len(entry) == 3
        assert sorted(e.rank for e in entry.values()) == [1, 2, 3]
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_bad_requests_raise_clear_errors(model_dir):
    engine = make_engine(model_dir, max_model_len=20)
    with pytest.raises(ValueError, match="max_model_len"):
        add(engine, "a", list(range(2, 22)), GREEDY)
    with pytest.raises(ValueError, match="empty"):
        add(engine, "a", [], GREEDY)
    with pytest.raises(ValueError, match="stop strings"):
        add(engine, "a", [2, 3], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        add(engine, "a", [2, 999], GREEDY)
    with pytest.raises(ValueError, match="connector"):
        add(engine, "a", [2, 3], GREEDY, hold_kv=True)
    add(engine, "a", [2, 3], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        add(engine, "a", [2, 3], GREEDY)


# ----------------------------------------------------------------------------- PD hooks


class CopyConnector(KVConnector):
    """Test double for a KVConnector: copies blocks between two engines' caches in-process.
    Prefill and decode each get one; they share `peers` (engine id -> connector)."""

    def __init__(self, engine_id: str, peers: dict[str, CopyConnector], fail_reads: bool = False) -> None:
        self.engine_id, self.peers, self.fail_reads = engine_id, peers, fail_reads
        peers[engine_id] = self
        self.kv: KVCache | None = None
        self.leases: dict[str, list[int]] = {}
        self.releases: list[str] = []
        self.loads: list[str] = []
        self.failures: list[TransferError] = []
        self.handoffs: list[tuple[str, bytes]] = []
        self.stats = TransferStats()
        self.instance_id, self.metadata_url = "i", "inproc://"

    def register_kv_cache(self, kv_cache: KVCache) -> None:
        self.kv = kv_cache

    def peer_metadata(self) -> bytes:
        return self.engine_id.encode()

    def on_prefill_finished(
        self, request_id, block_ids, num_tokens, window_block_ids=None, state_slot=-1, kv_to=None
    ) -> KVHandle:
        self.leases[request_id] = list(block_ids)
        return KVHandle(
            request_id=request_id,
            engine_id=self.engine_id,
            instance_id="i",
            metadata_url="inproc://",
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            compat_hash="h",
            lease_expires_at=time.time() + 60,
        )

    def send_handoff(self, peer, payload) -> None:
        self.peers[peer.engine_id].handoffs.append((self.engine_id, payload))

    def poll_handoffs(self):
        out, self.handoffs = self.handoffs, []
        return out

    def poll_releases(self) -> list[str]:
        out, self.releases = self.releases, []
        return out

    def release(self, request_id) -> None:
        self.leases.pop(request_id, None)

    def start_load(
        self, handle, local_block_ids, peer=None, local_window_block_ids=None, local_state_slot=-1, num_reused_blocks=0
    ) -> None:
        if handle.compat_hash != "h":
            raise TransferError(handle.request_id, TransferStage.HANDSHAKE, "compatibility hash mismatch")
        if self.fail_reads:
            self.failures.append(TransferError(handle.request_id, TransferStage.READING, "peer went away"))
            return
        src = self.peers[handle.engine_id]
        k = num_reused_blocks  # held here already (decode-side prefix caching): not read
        for name, region in self.kv.regions.items():
            region[:, local_block_ids[k:]] = src.kv.regions[name][:, handle.block_ids[k:]]
        src.leases.pop(handle.request_id)
        src.releases.append(handle.request_id)  # the "notification"
        self.loads.append(handle.request_id)

    def poll_loads(self):
        done, self.loads = self.loads, []
        failed, self.failures = self.failures, []
        return done, failed

    def cancel_load(self, request_id) -> None:
        self.loads = [r for r in self.loads if r != request_id]

    def shutdown(self) -> None:
        self.peers.pop(self.engine_id, None)


def pd_pair(model_dir, fail_reads=False, **kw):
    peers: dict[str, CopyConnector] = {}
    prefill = make_engine(model_dir, CopyConnector("P", peers), **kw)
    decode = make_engine(model_dir, CopyConnector("D", peers, fail_reads=fail_reads), num_kv_blocks=128, **kw)
    return prefill, decode


def test_pd_hand_off_matches_colocated(model_dir):
    prefill, decode = pd_pair(model_dir)
    lens = [4 + i for i in range(len(PROMPTS))]
    for i, (p, n) in enumerate(zip(PROMPTS, lens)):
        add(prefill, str(i), p, greedy(n), hold_kv=True)
    firsts = run_all(prefill)
    assert not prefill.has_unfinished_requests() and prefill.has_held_kv()
    held = prefill.get_stats()
    assert held.num_held == len(PROMPTS) and held.kv_blocks_used > 0
    for i, (p, n) in enumerate(zip(PROMPTS, lens)):
        out = firsts[str(i)]
        assert out.finished and out.outputs[0].finish_reason is None and len(out.outputs[0].token_ids) == 1
        h = out.kv_handle
        assert h.num_tokens == len(p) and len(h.block_ids) == math.ceil(len(p) / 4)
        add(decode, str(i), p, greedy(n), kv_handle=h, first_token=out.outputs[0].token_ids[0])
    final = run_all(decode)
    prefill.step()  # polls the releases the decode side sent
    ref = FakeModel(0)
    for i, (p, n) in enumerate(zip(PROMPTS, lens)):
        assert final[str(i)].outputs[0].token_ids == reference_greedy(ref, p, n)
    assert prefill.get_stats().kv_blocks_used == 0 and not prefill.has_held_kv()
    assert decode.get_stats().kv_blocks_used == 0


def test_pd_prefill_that_stops_on_its_first_token_holds_nothing(model_dir):
    prefill, _ = pd_pair(model_dir)
    add(prefill, "one", PROMPTS[2], greedy(1), hold_kv=True)
    out = run_all(prefill)["one"]
    assert out.outputs[0].finish_reason == "length" and out.kv_handle is None
    assert prefill.get_stats().kv_blocks_used == 0 and not prefill.has_held_kv()


def test_pd_release_kv_and_abort_of_held_request(model_dir):
    prefill, _ = pd_pair(model_dir)
    add(prefill, "a", PROMPTS[5], greedy(8), hold_kv=True)
    add(prefill, "b", PROMPTS[6], greedy(8), hold_kv=True)
    run_all(prefill)
    assert prefill.get_stats().num_held == 2
    prefill.abort_request("a")
    prefill.abort_request("b")
    prefill.step()
    assert prefill.get_stats().kv_blocks_used == 0
    assert prefill.connector.leases == {}


def test_pd_failed_load_reports_error_and_frees_blocks(model_dir):
    prefill, decode = pd_pair(model_dir, fail_reads=True)
    add(prefill, "a", PROMPTS[5], greedy(8), hold_kv=True)
    out = run_all(prefill)["a"]
    add(decode, "a", PROMPTS[5], greedy(8), kv_handle=out.kv_handle, first_token=out.outputs[0].token_ids[0])
    bad = out.kv_handle.model_copy(update={"compat_hash": "other", "request_id": "b"})
    add(decode, "b", PROMPTS[5], greedy(8), kv_handle=bad, first_token=3)
    final = run_all(decode)
    assert final["a"].outputs[0].finish_reason == "error" and "peer went away" in final["a"].error
    assert "READING" in final["a"].error
    assert final["b"].outputs[0].finish_reason == "error" and "hash mismatch" in final["b"].error
    assert decode.get_stats().kv_blocks_used == 0
    prefill.abort_request("a")
    prefill.step()
    assert prefill.get_stats().kv_blocks_used == 0


def test_pd_decode_waits_for_blocks(model_dir):
    # the decode side has room for one request's prompt at a time: the rest queue, none is lost
    peers: dict[str, CopyConnector] = {}
    prefill = make_engine(model_dir, CopyConnector("P", peers))
    decode = make_engine(model_dir, CopyConnector("D", peers), num_kv_blocks=20, max_model_len=80)
    prompts = PROMPTS[5:8]
    for i, p in enumerate(prompts):
        add(prefill, str(i), p, greedy(6), hold_kv=True)
    firsts = run_all(prefill)
    for i, p in enumerate(prompts):
        out = firsts[str(i)]
        add(decode, str(i), p, greedy(6), kv_handle=out.kv_handle, first_token=out.outputs[0].token_ids[0])
    final = run_all(decode)
    prefill.step()
    ref = FakeModel(0)
    for i, p in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference_greedy(ref, p, 6)
    assert decode.get_stats().kv_blocks_used == 0 and prefill.get_stats().kv_blocks_used == 0


def peer_of(conn: CopyConnector) -> PeerMetadata:
    return PeerMetadata(engine_id=conn.engine_id, instance_id="i", data=conn.peer_metadata())


def ref(engine_id: str) -> KVPeerRef:
    return KVPeerRef(engine_id=engine_id, metadata_url="inproc://")


def test_pd_hand_off_goes_from_engine_to_engine(model_dir):
    # the router's PD path: decode has each request before prefill is done and waits for it, with no
    # blocks, until prefill's engine sends the hand-off through its connector; colocated's tokens
    prefill, decode = pd_pair(model_dir)
    lens = [4 + i for i in range(len(PROMPTS))]
    for i, (p, n) in enumerate(zip(PROMPTS, lens)):
        decode.add_request(
            Request(request_id=str(i), prompt_token_ids=p, params=greedy(n), kv_from=ref("P")),
            peer_of(prefill.connector),
        )
        prefill.add_request(
            Request(request_id=str(i), prompt_token_ids=p, params=greedy(n), hold_kv=True, kv_to=ref("D")),
            peer_of(decode.connector),
        )
    decode.step()
    waiting = decode.get_stats()
    assert (
        waiting.num_awaiting_handoff == waiting.num_waiting_for_remote_kv == len(PROMPTS)
        and waiting.kv_blocks_used == 0
    )
    firsts = run_all(prefill)
    assert all(out.kv_handoff_sent for out in firsts.values())
    final = run_all(decode)
    prefill.step()  # polls the releases
    ref_model = FakeModel(0)
    for i, (p, n) in enumerate(zip(PROMPTS, lens)):
        assert final[str(i)].outputs[0].token_ids == reference_greedy(ref_model, p, n)
    assert decode.get_stats().kv_blocks_used == 0 and prefill.get_stats().kv_blocks_used == 0
    assert set(decode.connector.stats.handoffs) == {str(i) for i in range(len(PROMPTS))}


def test_pd_hand_off_that_arrives_mid_step_runs_in_the_next_step(model_dir):
    # decode is running one request when another's hand-off arrives during its step (here: while
    # the model computes): the engine reads that KV while the step runs, so the request's first
    # decode step is the very next one, not one step later; tokens as colocated's
    prefill, decode = pd_pair(model_dir)
    add(decode, "busy", PROMPTS[2], greedy(20))
    decode.step()  # "busy" is running
    decode.add_request(
        Request(request_id="new", prompt_token_ids=PROMPTS[4], params=greedy(6), kv_from=ref("P")),
        peer_of(prefill.connector),
    )
    prefill.add_request(
        Request(request_id="new", prompt_token_ids=PROMPTS[4], params=greedy(6), hold_kv=True, kv_to=ref("D")),
        peer_of(decode.connector),
    )
    assert run_all(prefill)["new"].kv_handoff_sent
    arriving, decode.connector.handoffs = decode.connector.handoffs, []
    decode.step()  # "new" starts waiting for its hand-off
    assert decode.get_stats().num_awaiting_handoff == 1
    forward = decode.runner.model.forward

    def forward_as_it_arrives(batch, kv_cache):
        decode.connector.handoffs.extend(arriving)  # the notification lands while the step computes
        arriving.clear()
        return forward(batch, kv_cache)

    decode.runner.model.forward = forward_as_it_arrives
    decode.step()
    stats = decode.get_stats()
    assert stats.num_awaiting_handoff == 0 and stats.num_waiting_for_remote_kv == 0  # read during that step
    assert decode.connector.stats.handoffs.keys() == {"new"}
    outs = {o.request_id: o for o in decode.step()}
    assert len(outs["new"].outputs[0].token_ids) == 2  # prefill's first token + this step's
    final = run_all(decode)
    assert final["new"].outputs[0].token_ids == reference_greedy(FakeModel(0), PROMPTS[4], 6)
    assert final["busy"].outputs[0].token_ids == reference_greedy(FakeModel(0), PROMPTS[2], 20)
    prefill.step()  # polls the release
    assert decode.get_stats().kv_blocks_used == 0 and prefill.get_stats().kv_blocks_used == 0


def test_work_until_works_at_least_once_and_until_done():
    from pdserve.engine.launched_step import work_until

    calls, answers = [], iter([False, False, True])
    work_until(lambda: next(answers), lambda: calls.append(1), poll_s=0)
    assert len(calls) == 3
    work_until(lambda: True, lambda: calls.append(1))
    assert len(calls) == 4


def test_pd_hand_off_early_posted_foreign_aborted_and_late(model_dir):
    prefill, decode = pd_pair(model_dir)
    # "early": its hand-off reaches decode before the request does; "posted": a prefill without the
    # decode engine's metadata cannot notify it, so the router posts the hand-off (deliver_handoff)
    prefill.add_request(
        Request(request_id="early", prompt_token_ids=PROMPTS[3], params=greedy(5), hold_kv=True, kv_to=ref("D")),
        peer_of(decode.connector),
    )
    prefill.add_request(
        Request(request_id="posted", prompt_token_ids=PROMPTS[4], params=greedy(5), hold_kv=True, kv_to=ref("D"))
    )
    firsts = run_all(prefill)
    assert firsts["early"].kv_handoff_sent and not firsts["posted"].kv_handoff_sent
    decode.step()  # takes "early"'s hand-off and keeps it for its request
    for rid, p in (("early", PROMPTS[3]), ("posted", PROMPTS[4])):
        decode.add_request(
            Request(request_id=rid, prompt_token_ids=p, params=greedy(5), kv_from=ref("P")), peer_of(prefill.connector)
        )
    posted = firsts["posted"]
    decode.deliver_handoff(
        Handoff(
            request_id="posted",
            kv_handle=posted.kv_handle,
            first_token=FirstToken(token_id=posted.outputs[0].token_ids[0]),
        )
    )
    final = run_all(decode)
    prefill.step()
    for rid, p in (("early", PROMPTS[3]), ("posted", PROMPTS[4])):
        assert final[rid].outputs[0].token_ids == reference_greedy(FakeModel(0), p, 5)
    assert prefill.get_stats().kv_blocks_used == 0
    # waiting: a hand-off from an engine other than kv_from's is ignored, an abort ends the wait,
    # and so does handoff_timeout_s (an error at stage PENDING); neither holds anything after
    decode.remote_kv.handoff_timeout_s = 0.0
    for rid in ("gone", "late"):
        decode.add_request(
            Request(request_id=rid, prompt_token_ids=PROMPTS[5], params=greedy(5), kv_from=ref("P")),
            peer_of(prefill.connector),
        )
    foreign = Handoff(
        request_id="late",
        kv_handle=posted.kv_handle.model_copy(update={"request_id": "late"}),
        first_token=FirstToken(token_id=3),
    )
    decode.connector.handoffs.append(("X", foreign.model_dump_json().encode()))
    decode.abort_request("gone")
    outs = run_all(decode)
    assert outs["gone"].outputs[0].finish_reason == "abort"
    late = outs["late"]
    assert late.outputs[0].finish_reason == "error" and late.outputs[0].token_ids == []
    assert late.transfer_error.stage == "PENDING" and "no hand-off from prefill engine P within 0 s" in late.error
    stats = decode.get_stats()
    assert stats.kv_blocks_used == 0 and stats.num_awaiting_handoff == 0 and not decode.has_unfinished_requests()


class SlowConnector(CopyConnector):
    """CopyConnector whose reads never finish (test double): a load stays in flight."""

    def start_load(self, handle, local_block_ids, peer=None, *args, **kw) -> None:
        self.in_flight = handle.request_id

    def cancel_load(self, request_id) -> None:
        self.cancelled = request_id


def test_pd_abort_while_loading_cancels_and_frees(model_dir):
    peers: dict[str, CopyConnector] = {}
    prefill = make_engine(model_dir, CopyConnector("P", peers))
    decode = make_engine(model_dir, SlowConnector("D", peers))
    add(prefill, "a", PROMPTS[6], greedy(5), hold_kv=True)
    out = run_all(prefill)["a"]
    add(decode, "a", PROMPTS[6], greedy(5), kv_handle=out.kv_handle, first_token=out.outputs[0].token_ids[0])
    decode.step()
    stats = decode.get_stats()
    assert stats.num_waiting_for_remote_kv == 1 and stats.kv_blocks_used == math.ceil(len(PROMPTS[6]) / 4)
    decode.abort_request("a")
    (aborted,) = decode.step()
    assert aborted.outputs[0].finish_reason == "abort" and decode.connector.cancelled == "a"
    assert decode.get_stats().kv_blocks_used == 0 and not decode.has_unfinished_requests()


def test_requests_added_from_another_thread(model_dir):
    import threading

    engine = make_engine(model_dir)
    adders = [threading.Thread(target=add, args=(engine, str(i), p, greedy(6))) for i, p in enumerate(PROMPTS)]
    for t in adders:
        t.start()
    for t in adders:
        t.join()
    final = run_all(engine)
    assert all(
        final[str(i)].outputs[0].token_ids == reference_greedy(FakeModel(0), p, 6) for i, p in enumerate(PROMPTS)
    )


def test_engine_config_validation(model_dir, tmp_path):
    with pytest.raises(ValueError, match="device"):
        EngineConfig(model=model_dir, device="tpu")
    with pytest.raises(ValueError, match="no config.json"):
        EngineConfig(model=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="kv_block_size"):
        EngineConfig(model=model_dir, kv_block_size=0)
    assert EngineConfig(model=model_dir).resolved_dtype() == "float32"  # auto on CPU
    before = torch.get_num_threads()
    try:
        make_engine(model_dir, cpu_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert EngineConfig(model=model_dir, device="cuda:1", dtype="auto").resolved_dtype() == "bfloat16"  # none declared
    with pytest.raises(ValueError, match="needs 30 KV blocks but only 8 fit"):
        make_engine(model_dir, num_kv_blocks=8, max_model_len=120)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 256"):
        make_engine(model_dir, max_model_len=300)


# ----------------------------------------------------------------------------- real tiny model + tokenizer


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from pdserve import LLM
    from pdserve.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), "deepseek_v3", seed=0)
    return LLM(str(path), kv_block_size=8, max_num_batched_tokens=64)


PROMPT = "The quick brown fox"


def test_text_is_the_decoded_tokens_and_streams_only_grow(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    (out,) = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2))
    c = out.outputs[0]
    assert out.prompt == PROMPT and out.prompt_token_ids == tok.encode(PROMPT)
    assert c.text == tok.decode(c.token_ids) and len(c.token_ids) == 24
    assert all(
        e[t].decoded_token == tok.decode([t], skip_special_tokens=False) for t, e in zip(c.token_ids, c.logprobs)
    )


def _greedy_text(llm, n=24):
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return out.outputs[0]


def test_stop_strings_cut_the_text(tiny_llm):
    full = _greedy_text(tiny_llm)
    stop = full.text[7:10]  # three characters from the middle, possibly across tokens
    first = full.text.index(stop)
    (out,) = tiny_llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["zzzz", stop])
    )
    c = out.outputs[0]
    assert c.text == full.text[:first] and c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == full.token_ids[: len(c.token_ids)] and len(c.token_ids) < 24
    (out,) = tiny_llm.generate(
        PROMPT,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
    )
    assert out.outputs[0].text == full.text[: first + len(stop)]


def test_streamed_text_never_shows_what_a_stop_string_removes(tiny_llm):
    full = _greedy_text(tiny_llm)
    stop = full.text[9:13]
    engine = tiny_llm.engine
    add(
        engine,
        "s",
        engine.tokenizer.encode(PROMPT),
        SamplingParams(temperature=0, max_tokens=24, stop=stop, ignore_eos=True),
    )
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    final = texts[-1]
    assert final == full.text[: full.text.index(stop)]
    assert all(final.startswith(t) for t in texts)  # every streamed text is a prefix of the final one


def test_chat_uses_the_template(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = tiny_llm.chat(conv, SamplingParams(temperature=0, max_tokens=4))
    assert out.prompt_token_ids == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    outs = tiny_llm.chat(
        [conv, conv + [{"role": "assistant", "content": "Paris"}, {"role": "user", "content": "Why?"}]]
    )
    assert (
        len(outs) == 2 and outs[0].outputs[0].token_ids != [] and outs[1].prompt_token_ids != outs[0].prompt_token_ids
    )


def test_llm_generate_shapes_and_errors(tiny_llm, tmp_path):
    outs = tiny_llm.generate(
        ["a", {"prompt": "bb"}, {"prompt_token_ids": [0, 5, 6]}],
        [SamplingParams(max_tokens=n, seed=n) for n in (1, 2, 3)],
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
    assert outs[2].prompt is None and outs[2].prompt_token_ids == [0, 5, 6]
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        tiny_llm.generate("a", [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="exactly one of"):
        tiny_llm.generate()
    assert tiny_llm.engine.get_stats().kv_blocks_used == 0 and not tiny_llm.engine.has_unfinished_requests()
    # token ids alone on a folder without tokenizer files
    from pdserve import LLM

    src = tiny_llm.engine.config.model
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes(open(f"{src}/{name}", "rb").read())
    bare = LLM(str(tmp_path), skip_tokenizer_init=True, num_kv_blocks=64)
    (out,) = bare.generate(
        prompt_token_ids=[0, 5, 6], sampling_params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )
    (want,) = tiny_llm.generate(
        prompt_token_ids=[0, 5, 6], sampling_params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )
    assert out.outputs[0].token_ids == want.outputs[0].token_ids and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        bare.generate("text")
