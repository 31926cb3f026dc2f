"""Same-host KV transfer (pdserve/disagg/cuda_ipc.py): a decode worker maps a prefill worker's pool
through CUDA IPC and copies a request's blocks out of it itself.

On CPU the one step that needs a GPU - exporting and opening the CUDA IPC handles - is replaced:
both connectors live in this process (each with its own real NIXL agent, which still carries the
metadata, the release message and any fallback READ) and "opening" the prefill pool returns the
prefill connector's own region tensors, which is what the mapping gives on a GPU. Everything else
runs as on a GPU: the choice of path, the copy (the kernel's reference here; the kernel itself:
tests/kernels/test_kernels_block_copy.py), the release, the prefill side skipping its gather, the
fallbacks. The last test runs the real thing between two processes on a GPU (skipped without
CUDA; run on the H200, docs/pd-gpu.md).
"""

from __future__ import annotations

import base64
import logging
import time
import uuid

import pytest
import torch
from test_staged_transfer import DST, DST_WIN, SRC, SRC_WIN, TOKENS, make_pool

from pdserve.disagg.base import PeerMetadata, TransferStage
from pdserve.disagg.cuda_ipc import CopyQueue, IdRing, IpcRegion, open_pool
from pdserve.disagg.factory import ConnectorSettings, StagingOptions, make_connector
from pdserve.disagg.layout import KVLayout, region_blocks
from pdserve.disagg.nixl import connector as nc
from pdserve.disagg.staging import payload_bytes
from pdserve.worker.metrics import WorkerMetrics

pytestmark = pytest.mark.timeout(120)

POOLS: dict[str, dict[str, torch.Tensor]] = {}  # prefill engine id -> its regions (what a mapping opens)


def fake_set_up(self, kv_cache) -> None:
    """_set_up_cuda_ipc for a pool in host memory: export it by name, map peers."""
    if self.role != "decode":
        POOLS[self.engine_id] = kv_cache.regions
        tag = base64.b64encode(self.engine_id.encode()).decode()
        self._exported = {
            name: IpcRegion(handle=tag, storage_bytes=t.numel() * t.element_size(), storage_offset=0, offset_bytes=0,
                            nbytes=t.numel() * t.element_size(), ref_counter_handle="", ref_counter_offset=0,
                            event_handle="", event_sync_required=False)
            for name, t in kv_cache.regions.items()
        }  # fmt: skip
    if self.role != "prefill":
        self._maps_peers = True
        self._copies = CopyQueue(torch.device("cpu"))


def fake_open(exported, layout, device):
    regions = POOLS[base64.b64decode(next(iter(exported.values())).handle).decode()]
    return {name: t.view(torch.uint8).view(-1) for name, t in regions.items()}


@pytest.fixture
def same_host(monkeypatch):
    monkeypatch.setattr(nc.NixlConnector, "_set_up_cuda_ipc", fake_set_up)
    monkeypatch.setattr(nc, "open_pool", fake_open)
    made = []

    def pair(kind: str = "v3", staging_mib: int = 1, **kw):
        def conn(role: str, seed: int, blocks: int):
            staging = StagingOptions(
                mode="on" if staging_mib else "off", prefill_arena_mib=staging_mib, decode_arena_mib=staging_mib
            )
            settings = ConnectorSettings(model_id="m", lease_margin_s=0.0, role=role, staging=staging, **kw)
            c = make_connector("nixl", f"{role}-{uuid.uuid4().hex[:8]}", settings)
            c.register_kv_cache(make_pool(kind, blocks, seed))
            made.append(c)
            return c

        return conn("prefill", 1, 24), conn("decode", 2, 30)

    yield pair
    for c in made:
        c.shutdown()
    POOLS.clear()


def meta(c) -> PeerMetadata:
    return PeerMetadata(engine_id=c.engine_id, instance_id=c.instance_id, data=c.peer_metadata())


def hand_off(pre, dec, rid: str, kind: str, to_decode: bool = True):
    v4 = kind == "v4"
    handle = pre.on_prefill_finished(rid, SRC, TOKENS, window_block_ids=SRC_WIN if v4 else None, state_slot=2 if v4 else -1,
                                     kv_to=meta(dec) if to_decode else None)  # fmt: skip
    dec.start_load(
        handle, DST, meta(pre), local_window_block_ids=DST_WIN if v4 else None, local_state_slot=1 if v4 else -1
    )
    return handle


def wait_done(dec, rid: str, limit_s: float = 5.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, failed = dec.poll_loads()
        if done or failed:
            return done, failed
        time.sleep(0.002)
    raise AssertionError(f"load of {rid} neither finished nor failed in {limit_s} s")


def wait_released(pre, dec, rid: str, limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        dec.poll_handoffs()  # as the decode engine's loop does every step: UCX progresses the release's send
        if rid in pre.poll_releases():
            return
        time.sleep(0.005)
    raise AssertionError(f"prefill never released {rid}")


def assert_moved(pre, dec, kind: str) -> None:
    """Every needed block of every region arrived, byte for byte."""
    v4 = kind == "v4"
    layout = KVLayout.from_kv_cache(pre.kv)
    s = region_blocks(layout, SRC, TOKENS, SRC_WIN if v4 else None, 2 if v4 else -1)
    d = region_blocks(layout, DST, TOKENS, DST_WIN if v4 else None, 1 if v4 else -1, "decode")
    for name in s:
        got, want = dec.kv.regions[name][:, d[name]], pre.kv.regions[name][:, s[name]]
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("kind", ["v3", "v32_fp8", "v4"])
def test_same_host_decode_copies_from_the_mapped_pool_and_prefill_gathers_nothing(same_host, kind):
    pre, dec = same_host(kind)
    handle = hand_off(pre, dec, "r1", kind)
    assert handle.staged is None and pre.stats.staged == {
        ("prefill", "peer_copies"): 1
    }  # no slab for this decode worker
    assert wait_done(dec, "r1") == (["r1"], [])
    assert_moved(pre, dec, kind)
    assert dec.stats.paths == {"cuda_ipc": 1} and dec.stats.descriptors_sum == 0
    assert dec.stats.bytes_transferred == payload_bytes(
        dec.layout,
        region_blocks(dec.layout, DST, TOKENS, DST_WIN if kind == "v4" else None, 1 if kind == "v4" else -1, "decode"),
    )
    wait_released(pre, dec, "r1")  # the release still travels over NIXL once the copy is done
    assert len(pre.leases) == 0 and dec.landing_arena.used_bytes == 0


def test_a_staged_handle_is_copied_from_the_pool_too_and_its_slab_freed(same_host):
    pre, dec = same_host("v3")
    handle = hand_off(
        pre, dec, "r2", "v3", to_decode=False
    )  # the router posts it: prefill did not know the decode worker
    assert handle.staged is not None and pre.staging_arena.used_bytes > 0
    assert wait_done(dec, "r2") == (["r2"], [])
    assert_moved(pre, dec, "v3")
    assert dec.stats.paths == {"cuda_ipc": 1}
    wait_released(pre, dec, "r2")
    assert pre.staging_arena.used_bytes == 0


def test_a_pool_that_cannot_be_mapped_is_read_over_nixl_with_a_warning(same_host, monkeypatch, caplog):
    def refuse(*a):
        raise RuntimeError("CUDA error: peer access is not supported between these two devices")

    monkeypatch.setattr(nc, "open_pool", refuse)
    pre, dec = same_host("v3")
    with caplog.at_level(logging.WARNING, logger="pdserve.disagg.nixl"):
        hand_off(pre, dec, "r3", "v3")  # prefill skipped the slab: decode said it maps same-host pools
        assert wait_done(dec, "r3") == (["r3"], [])
    assert_moved(pre, dec, "v3")
    assert dec.stats.paths == {"blocks": 1} and dec.stats.control_failures == {"cuda_ipc": 1}
    assert "peer access is not supported" in caplog.text and "cuda_ipc: false" in caplog.text
    wait_released(pre, dec, "r3")


def test_another_host_is_staged_and_read_over_nixl(same_host):
    pre, dec = same_host("v3")
    dec.host_id = "another-machine"
    dec._metadata = dec._metadata.replace(pre.host_id.encode(), b"another-machine")  # what its metadata says
    handle = hand_off(pre, dec, "r4", "v3")
    assert handle.staged is not None and ("prefill", "staged") in pre.stats.staged
    assert wait_done(dec, "r4") == (["r4"], [])
    assert_moved(pre, dec, "v3")
    assert dec.stats.paths == {"staged": 1}
    wait_released(pre, dec, "r4")


class SlowCopy:
    """A copy that finishes at `done_at` (monotonic; None: never)."""

    def __init__(self, done_at: float | None) -> None:
        self.done_at = done_at

    def query(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.query() and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.query()


def test_prefill_is_told_to_free_its_blocks_only_once_the_copy_is_done(same_host, monkeypatch, caplog):
    pre, dec = same_host("v3", transfer_timeout_s=0.3)
    copies: list[SlowCopy] = []

    def slow(*a, **kw):
        copies.append(SlowCopy(time.monotonic() + 0.1 if len(copies) == 0 else None))
        return copies[-1]

    monkeypatch.setattr(dec._copies, "start", slow)
    # cancelled while copying: cancel_load waits for the copy (0.1 s), then releases
    hand_off(pre, dec, "c1", "v3")
    t0 = time.monotonic()
    dec.cancel_load("c1")
    assert copies[0].query() and time.monotonic() - t0 >= 0.05
    wait_released(pre, dec, "c1")
    # a copy that never finishes: the load times out, prefill is not told (its lease frees the blocks)
    monkeypatch.setattr(nc, "COPY_SETTLE_S", 0.05)
    hand_off(pre, dec, "c2", "v3")
    with caplog.at_level(logging.ERROR, logger="pdserve.disagg.nixl"):
        done, failed = wait_done(dec, "c2")
    assert done == [] and failed[0].stage is TransferStage.READING and "did not finish within 0.3 s" in failed[0].reason
    assert "still running" in caplog.text
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        dec.poll_handoffs()
        assert "c2" not in pre.poll_releases()
        time.sleep(0.01)
    assert "c2" in pre.leases


class Flag:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_the_id_ring_never_hands_out_ids_a_queued_copy_still_reads():
    """Random requests against a small ring, copies finishing oldest first as on one stream: every
    live range keeps its ids, ranges start even (16-byte aligned), a request finding no room gets
    its own buffer, and the ring wraps."""
    import random

    rng = random.Random(0)
    ring = IdRing(64, pin=False)
    live: list[tuple[int, list[int], Flag]] = []  # (start, ids, until), oldest first
    own = wrapped = 0
    for step in range(2000):
        while live and rng.random() < 0.4:  # the oldest copies finish
            live.pop(0)[2].done = True
        ids = [rng.randrange(1 << 40) for _ in range(rng.randint(1, 24))]
        buf, start = ring.put(ids)
        assert buf.tolist() == ids
        if start < 0:
            own += 1
            assert not ring.buf.data_ptr() <= buf.data_ptr() < ring.buf.data_ptr() + 8 * 64
            continue
        assert start % 2 == 0 and buf.data_ptr() == ring.buf.data_ptr() + 8 * start
        wrapped += bool(live) and start < live[-1][0]
        flag = Flag()
        ring.hold(start, len(ids), flag)
        live.append((start, ids, flag))
        for s, want, _ in live:  # nothing still read was written over
            assert ring.buf[s : s + len(want)].tolist() == want, step
    assert own > 0 and wrapped > 0  # both the fallback and the wrap were exercised
    big, start = ring.put(list(range(65)))  # larger than the whole ring
    assert start == -1 and big.tolist() == list(range(65))


def test_load_paths_are_exported_as_metrics(same_host):
    pre, dec = same_host("v3")
    hand_off(pre, dec, "m1", "v3")
    wait_done(dec, "m1")
    metrics = WorkerMetrics()
    metrics.sync_transfer(dec.stats)
    metrics.sync_transfer(dec.stats)  # counted once
    assert metrics.registry.get_sample_value("pdserve_kv_transfer_path_total", {"path": "cuda_ipc"}) == 1
    pm = WorkerMetrics()
    pm.sync_transfer(pre.stats)
    assert (
        pm.registry.get_sample_value("pdserve_kv_transfer_staged_total", {"side": "prefill", "result": "peer_copies"})
        == 1
    )


def test_open_pool_refuses_an_export_that_does_not_match_the_layout():
    kv = make_pool("v3", 4, seed=0)
    layout = KVLayout.from_kv_cache(kv)
    nbytes = layout.regions[0].bytes
    region = IpcRegion(handle="", storage_bytes=nbytes, storage_offset=0, offset_bytes=0, nbytes=nbytes - 2,
                       ref_counter_handle="", ref_counter_offset=0, event_handle="", event_sync_required=False)  # fmt: skip
    with pytest.raises(ValueError, match="does not match"):
        open_pool({"latent": region}, layout, torch.device("cpu"))
    with pytest.raises(ValueError, match="does not match"):
        open_pool({}, layout, torch.device("cpu"))


def test_the_option_reaches_the_connector():
    settings = ConnectorSettings(model_id="m", options={"cuda_ipc": False})
    c = make_connector("nixl", "opt", settings)
    assert c._cuda_ipc is False
    with pytest.raises(Exception, match="cuda_ipc"):
        nc.NixlOptions.model_validate({"cuda_ipc": "sometimes"})


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="the copy queue's GPU path needs CUDA: run on the H100 / H200 (docs/pd-gpu.md)",
)
def test_copy_queue_on_a_gpu_copies_through_its_ring_and_through_a_buffer_of_its_own():
    """CopyQueue's GPU path (bound kernels, ids by address): two regions of odd word counts, a
    request whose ids fill the ring exactly, larger ones that get a pinned buffer of their own, one
    that copies a single region; every byte checked, nothing else touched."""
    import random

    from pdserve_kernels.ref import copy_blocks_ref

    rng, dev = random.Random(0), torch.device("cuda", torch.cuda.current_device())
    queue = CopyQueue(dev, ring_ids=8)
    gen = torch.Generator().manual_seed(0)
    src = {
        name: torch.randint(-(2**62), 2**62, (3, 20, 37), generator=gen, dtype=torch.int64).to(dev)
        for name in ("a", "b")
    }
    dst = {name: torch.randint(-(2**62), 2**62, (3, 24, 37), generator=gen, dtype=torch.int64).to(dev) for name in src}
    regions = queue.bind({name: (src[name], dst[name]) for name in src})
    for n, names in ((1, "ab"), (3, "ab"), (5, "ab"), (2, "a")):  # 2 x (2 + 2) ids fill the ring; 2 x (4 + 4) do not
        s = {name: rng.sample(range(20), n) if name in names else [] for name in src}
        d = {name: rng.sample(range(24), n) if name in names else [] for name in src}
        want = {name: t.clone() for name, t in dst.items()}
        for name in names:
            copy_blocks_ref(src[name], want[name], torch.tensor(s[name]), torch.tensor(d[name]))
        torch.cuda.synchronize()  # the copy stream does not wait for the default one
        assert queue.start(regions, s, d).wait(10.0), n
        for name in src:
            assert torch.equal(dst[name], want[name]), (n, name)


@pytest.mark.slow  # starts a prefill peer process
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU: run on the H200 (docs/pd-gpu.md)")
def test_real_cuda_ipc_between_two_processes_on_one_gpu():
    from test_transfer import Peer, fetch, nixl_decode_on

    peer = Peer("bfloat16", seed=7, staging_mib=1, device="cuda")
    decode = nixl_decode_on("bfloat16", "cuda", landing_mib=1)
    try:
        src_ids, dst_ids = [3, 4, 5, 9, 20, 21], [7, 8, 9, 0, 30, 31]
        to = {"engine_id": decode.engine_id, "metadata": decode.peer_metadata().decode()}
        handle = peer.prefill("g1", src_ids, kv_to=to)
        assert handle.staged is None  # same host: no gather for this decode worker
        decode.start_load(handle, dst_ids, fetch(handle))
        assert wait_done(decode, "g1") == (["g1"], [])
        want = peer.kv()
        for name, t in decode.kv.regions.items():
            assert torch.equal(
                t[:, dst_ids].cpu().view(torch.int16), want.regions[name][:, src_ids].view(torch.int16)
            ), name
        assert decode.stats.paths == {"cuda_ipc": 1}
        deadline = time.monotonic() + 5.0
        while "g1" not in peer.cmd(op="poll")["released"]:  # the release, over NIXL
            assert time.monotonic() < deadline, "prefill never released g1"
            decode.poll_handoffs()  # as decode's engine loop does every step: its UCX sends the release
            time.sleep(0.01)
    finally:
        decode.shutdown()
        peer.stop()


def test_same_host_copy_of_a_pool_flipped_after_the_lease_fails_at_verify(same_host):
    pre, dec = same_host("v3")
    handle = pre.on_prefill_finished("flip", SRC, TOKENS, kv_to=meta(dec))
    assert handle.staged is None and handle.checksums is not None
    pre.kv.regions["latent"][1, SRC[0]].view(-1).view(torch.uint8)[7] ^= 4  # after the lease
    dec.start_load(handle, DST, meta(pre))
    assert dec.poll_loads() == ([], [])  # the first copy (done at once on CPU) does not check: copied again
    done, failed = dec.poll_loads()
    assert done == [] and failed[0].stage is TransferStage.VERIFY and "latent" in failed[0].reason
    assert dec.stats.verify_failures == 2 and dec.stats.paths == {}
    wait_released(pre, dec, "flip")


@pytest.mark.slow  # starts a prefill peer process
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU: run on the H200 (docs/pd-gpu.md)")
def test_real_cuda_ipc_copy_of_a_flipped_pool_fails_at_verify():
    from test_transfer import Peer, fetch, nixl_decode_on

    peer = Peer("bfloat16", seed=7, staging_mib=1, device="cuda")
    decode = nixl_decode_on("bfloat16", "cuda", landing_mib=1)
    try:
        to = {"engine_id": decode.engine_id, "metadata": decode.peer_metadata().decode()}
        handle = peer.prefill("g2", [3, 4], kv_to=to)
        peer.cmd(op="flip", region="latent", block=4)
        decode.start_load(handle, [7, 8], fetch(handle))
        failed: list = []
        deadline = time.monotonic() + 5.0
        while not failed:
            assert time.monotonic() < deadline, "the load neither failed nor finished"
            done, failed = decode.poll_loads()
            assert done == []
            time.sleep(0.002)
        assert failed[0].stage is TransferStage.VERIFY and decode.stats.verify_failures == 2
        assert decode.stats.failures_by_stage == {"VERIFY": 1}
    finally:
        decode.shutdown()
        peer.stop()
