"""KV transfer: layout and hash, leases, the fake backend, and real NIXL between two processes.

The NIXL tests start tests/helpers/transfer_peer.py as the prefill worker (its own process, its own agent,
metadata over HTTP) and play the decode worker in this process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import torch

from pdserve.disagg.base import KVHandle, PeerMetadata, TransferError, TransferStage
from pdserve.disagg.factory import ConnectorSettings, StagingOptions, make_connector
from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.disagg.layout import KVLayout, block_runs, build_descriptors, compat_hash, region_addrs
from pdserve.disagg.lease_table import LeaseTable
from pdserve.model.kv_cache import KVCache, KVRegionSpec
from pdserve.worker.peers import PeerMetadataFetcher
from tests.helpers.transfer_peer import make_kv, serve_metadata

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER_LEASE_S = 3.0


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_blocks_equal(dst: KVCache, dst_ids: list[int], src: KVCache, src_ids: list[int]) -> None:
    for name in src.regions:
        assert torch.equal(as_bytes(dst.regions[name][:, dst_ids]), as_bytes(src.regions[name][:, src_ids])), name


def fetch(handle: KVHandle, allowed: list[str] | None = None, timeout_s: float = 2.0) -> PeerMetadata:
    """What a decode worker does before admitting a request: GET the prefill peer's metadata."""

    async def go() -> PeerMetadata:
        fetcher = PeerMetadataFetcher(allowed if allowed is not None else [handle.metadata_url], timeout_s)
        try:
            return await fetcher.fetch(handle)
        finally:
            await fetcher.aclose()

    return asyncio.run(go())


def run_load(
    conn, handle: KVHandle, local_ids: list[int], limit_s: float = 10.0, peer: PeerMetadata | None = None
) -> TransferError | None:
    """start_load then poll until the load is done (None) or failed (its error)."""
    try:
        conn.start_load(handle, local_ids, peer)
    except TransferError as e:
        return e
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, failed = conn.poll_loads()
        if handle.request_id in done:
            return None
        for e in failed:
            if e.request_id == handle.request_id:
                return e
        time.sleep(0.002)
    raise AssertionError(f"load of {handle.request_id} neither finished nor failed in {limit_s} s")


# ---------------------------------------------------------------- layout, hash, leases


def test_compat_hash_covers_what_makes_blocks_readable():
    def h(model="m", dtype=torch.bfloat16, dim=40, block_size=4, num_blocks=8, version="0.1.0"):
        kv = KVCache([KVRegionSpec("latent", dim)], 2, num_blocks, block_size, dtype, "cpu")
        return compat_hash(model, dtype, KVLayout.from_kv_cache(kv), block_size, version)

    base = h()
    assert len(base) == 64 and base == h()
    assert h(num_blocks=100) == base  # pool sizes may differ between prefill and decode
    for changed in (h(model="other"), h(dtype=torch.float32), h(dim=41), h(block_size=8), h(version="0.2.0")):
        assert changed != base


def test_block_runs_merge_only_where_both_sides_are_consecutive():
    assert block_runs([4, 5, 6], [9, 10, 11]) == [(4, 9, 3)]
    assert block_runs([4, 5, 6], [9, 11, 12]) == [(4, 9, 1), (5, 11, 2)]
    assert block_runs([7, 3, 4], [0, 1, 2]) == [(7, 0, 1), (3, 1, 2)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError, match="2 source blocks but 1 destination"):
        block_runs([1, 2], [3])


def test_descriptors_point_at_the_blocks_of_every_layer():
    kv = make_kv(torch.bfloat16, 0, 10)
    layout = KVLayout.from_kv_cache(kv)
    runs = block_runs([2, 3, 7], [5, 6, 0])  # -> (2, 5, 2), (7, 0, 1)
    src = build_descriptors(layout, region_addrs(kv), 0, runs, 0)
    dst = build_descriptors(layout, region_addrs(kv), 0, runs, 1)
    num_layers = sum(r.num_layers for r in layout.regions)
    assert len(src) == len(dst) == 2 * num_layers
    expected = []
    for t in kv.regions.values():
        block_bytes = t[0, 0].numel() * t.element_size()
        for layer in range(t.shape[0]):
            expected.append((t[layer, 2].data_ptr(), 2 * block_bytes, 0))
            expected.append((t[layer, 7].data_ptr(), block_bytes, 0))
    assert src == expected
    assert [d[1] for d in dst] == [d[1] for d in src]
    assert dst[0][0] == kv.regions["latent"][0, 5].data_ptr()


def test_lease_table_release_and_expiry():
    now = [100.0]
    table = LeaseTable(lease_s=10.0, clock=lambda: now[0])
    table.add("a", [1, 2])
    table.add("b", [3])
    with pytest.raises(ValueError, match="already holds"):
        table.add("a", [4])
    assert table.release("a") == [1, 2] and table.release("a") is None
    now[0] = 109.9
    assert table.expired() == []
    now[0] = 110.0
    assert table.expired() == ["b"] and len(table) == 0
    with pytest.raises(ValueError, match="lease_s must be > 0"):
        LeaseTable(lease_s=0)


# ---------------------------------------------------------------- fake backend


def fake_pair(lease_s: float = 60.0, timeout_s: float = 30.0, model_id: str = "tiny"):
    fabric = FakeFabric()
    pre = FakeConnector("pre-0", model_id="tiny", lease_s=lease_s, fabric=fabric, lease_margin_s=0.0)
    dec = FakeConnector("dec-0", model_id=model_id, transfer_timeout_s=timeout_s, fabric=fabric)
    pre.register_kv_cache(make_kv(torch.float32, 0, 16))
    dec.register_kv_cache(make_kv(torch.float32, 1, 20))
    return fabric, pre, dec


def test_fake_read_is_exact_and_releases_prefill_blocks():
    _, pre, dec = fake_pair()
    handle = pre.on_prefill_finished("r1", [3, 4, 9], num_tokens=11)
    before = {n: t.clone() for n, t in dec.kv.regions.items()}
    assert run_load(dec, handle, [0, 1, 2]) is None
    assert_blocks_equal(dec.kv, [0, 1, 2], pre.kv, [3, 4, 9])
    for name, t in dec.kv.regions.items():
        assert torch.equal(t[:, 3:], before[name][:, 3:])  # nothing else written
    assert pre.poll_releases() == ["r1"] and len(pre.leases) == 0
    assert dec.stats.transfers_done == 1 and dec.stats.bytes_transferred == 3 * 3 * 4 * (40 + 16) * 4
    assert dec.stats.descriptors_sum == 2 * 6  # runs (3,4)->(0,1) and 9->2, over 2 regions x 3 layers


def test_fake_lease_expiry_and_explicit_release():
    _, pre, dec = fake_pair(lease_s=0.05)
    pre.on_prefill_finished("r1", [1], 4)
    pre.on_prefill_finished("r2", [2], 4)
    pre.release("r2")
    time.sleep(0.06)
    assert pre.poll_releases() == ["r1"]
    assert pre.stats.lease_expirations == 1 and pre.stats.leases_released == 1


def test_fake_refuses_hash_mismatch_and_unknown_peer():
    _, pre, dec = fake_pair(model_id="other-model")
    handle = pre.on_prefill_finished("r1", [1], 4)
    with pytest.raises(TransferError) as err:
        dec.start_load(handle, [0])
    assert err.value.stage is TransferStage.HANDSHAKE
    assert pre.compat_hash in str(err.value) and dec.compat_hash in str(err.value)
    fabric, pre2, dec2 = fake_pair()
    handle = pre2.on_prefill_finished("r2", [1], 4)
    fabric.disconnect("pre-0")
    err2 = run_load(dec2, handle, [0])
    assert err2 is not None and err2.stage is TransferStage.HANDSHAKE and "not reachable" in err2.reason


def test_fake_timeout_disconnect_and_injected_failures():
    fabric, pre, dec = fake_pair(timeout_s=0.1)
    dec.hold_loads = True
    handle = pre.on_prefill_finished("slow", [1], 4)
    started = time.monotonic()
    err = run_load(dec, handle, [0])
    assert err.stage is TransferStage.READING and "within 0.1 s" in err.reason
    assert time.monotonic() - started < 2.0
    assert pre.poll_releases() == ["slow"]  # the failed load told prefill to free its blocks
    dec.hold_loads = False

    dec.fail_next(TransferStage.HANDSHAKE, "injected")
    err = run_load(dec, pre.on_prefill_finished("h", [1], 4), [0])
    assert err.stage is TransferStage.HANDSHAKE and err.reason == "injected"
    dec.fail_next(TransferStage.READING, "wire cut")
    err = run_load(dec, pre.on_prefill_finished("w", [2], 4), [0])
    assert err.stage is TransferStage.READING and err.reason == "wire cut"

    handle = pre.on_prefill_finished("gone", [3], 4)
    dec.start_load(handle, [0])
    fabric.disconnect("pre-0")
    done, failed = dec.poll_loads()
    assert done == [] and failed[0].stage is TransferStage.READING and "disconnected" in failed[0].reason
    assert dec.stats.transfers_failed == 4 and dec.stats.failures_by_stage == {"READING": 3, "HANDSHAKE": 1}


def test_fake_cancel_releases_prefill_and_bad_block_ids_are_refused():
    _, pre, dec = fake_pair()
    dec.hold_loads = True
    dec.start_load(pre.on_prefill_finished("c", [1, 2], 8), [0, 1])
    dec.cancel_load("c")
    assert dec.poll_loads() == ([], []) and pre.poll_releases() == ["c"]
    err = run_load(dec, pre.on_prefill_finished("bad", [99], 4), [0])
    assert err.stage is TransferStage.PENDING and "out of range" in err.reason
    err = run_load(dec, pre.on_prefill_finished("short", [1, 2], 8), [0])
    assert err.stage is TransferStage.PENDING and "2 source blocks but 1" in err.reason


def test_make_connector_rejects_unknown_backends_and_options():
    with pytest.raises(ValueError, match="unknown transfer backend 'rdma'"):
        make_connector("rdma", "e", ConnectorSettings(model_id="m"))
    with pytest.raises(
        ValueError, match="unknown transfer backend 'fake'"
    ):  # the test fake is built directly, never by name
        make_connector("fake", "e", ConnectorSettings(model_id="m"))
    with pytest.raises(ValueError, match="progress_threads"):
        make_connector("nixl", "e", ConnectorSettings(model_id="m", options={"progress_threads": False}))


def test_ucx_module_dir_is_the_installed_wheels_plugin_folder():
    from nixl_meta_utils import detect_cuda_major

    from pdserve.disagg.nixl.ucx_env import ucx_module_dir

    folder = ucx_module_dir()
    major = detect_cuda_major()
    want = f"nixl_cu{major}.libs" if major else "nixl_cu13.libs"  # nixl's own choice; cu13 first without CUDA
    assert folder is not None and os.path.basename(os.path.dirname(folder)) == want, folder
    assert any(f.startswith("libuct_cuda.so") for f in os.listdir(folder)), os.listdir(folder)
    if importlib.util.find_spec("nixl_cu12") is not None:
        assert ucx_module_dir(cuda_major=12).endswith(os.path.join("nixl_cu12.libs", "ucx"))


def test_ucx_gpu_defaults_leave_the_users_settings_alone():
    from pdserve.disagg.nixl.ucx_env import apply_ucx_gpu_defaults, ucx_module_dir

    env = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}
    applied = apply_ucx_gpu_defaults(env)
    assert env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "n"  # the user's value wins
    assert applied == {"UCX_MODULE_DIR": ucx_module_dir()} == {"UCX_MODULE_DIR": env["UCX_MODULE_DIR"]}
    env = {"UCX_MODULE_DIR": "/mine"}
    assert apply_ucx_gpu_defaults(env) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    assert env["UCX_MODULE_DIR"] == "/mine"


# ---------------------------------------------------------------- real NIXL, two processes


class Peer:
    """tests/helpers/transfer_peer.py as a prefill worker process."""

    def __init__(
        self,
        dtype: str,
        seed: int = 0,
        lease_s: float = 60.0,
        staging_mib: int = 0,
        poll_ms: float = 20.0,
        device: str = "cpu",
    ) -> None:
        self.engine_id = f"prefill-{uuid.uuid4().hex[:8]}"
        self.seed, self.dtype = seed, dtype
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        args = ["--engine-id", self.engine_id, "--dtype", dtype, "--seed", str(seed), "--lease-s", str(lease_s)]
        args += ["--staging-mib", str(staging_mib), "--poll-ms", str(poll_ms), "--device", device]
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "helpers", "transfer_peer.py"), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.metadata_url = self._read(60.0)["metadata_url"]

    def _read(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise AssertionError(f"transfer peer gave no reply in {timeout_s} s (exit code {self.proc.poll()})")
        return json.loads(line)

    def cmd(self, **doc) -> dict:
        self.proc.stdin.write(json.dumps(doc) + "\n")
        self.proc.stdin.flush()
        return self._read(10.0)

    def prefill(self, request_id: str, block_ids: list[int], kv_to: dict | None = None) -> KVHandle:
        reply = self.cmd(
            op="prefill", request_id=request_id, block_ids=block_ids, num_tokens=4 * len(block_ids), kv_to=kv_to
        )
        return KVHandle(**reply["handle"])

    def wait_released(self, request_id: str, limit_s: float = 5.0) -> dict:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            state = self.cmd(op="poll")
            if request_id in state["released"]:
                return state
            time.sleep(0.02)
        raise AssertionError(f"prefill never released {request_id}")

    def kv(self) -> KVCache:
        return make_kv(getattr(torch, self.dtype), self.seed, 32)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd(op="exit")
                self.proc.wait(timeout=10)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def peer(request):
    p = Peer(request.param, lease_s=PEER_LEASE_S)
    try:
        yield p
    finally:
        p.stop()


def nixl_decode(dtype: str, model_id: str = "tiny", landing_mib: int = 0):
    return nixl_decode_on(dtype, "cpu", model_id, landing_mib)


def nixl_decode_on(dtype: str, device: str, model_id: str = "tiny", landing_mib: int = 0):
    staging = StagingOptions(mode="on" if landing_mib else "off", prefill_arena_mib=0, decode_arena_mib=landing_mib)
    settings = ConnectorSettings(
        model_id=model_id, lease_margin_s=0.5, transfer_timeout_s=5.0, role="decode", staging=staging
    )
    conn = make_connector("nixl", f"decode-{uuid.uuid4().hex[:8]}", settings)
    conn.register_kv_cache(make_kv(getattr(torch, dtype), 1, 40, device))
    if device != "cpu":  # the pool's writes done: a same-host copy into it runs on the connector's stream
        torch.cuda.synchronize(device)
    return conn


@pytest.fixture
def decode(peer):
    conn = nixl_decode(peer.dtype)
    try:
        yield conn
    finally:
        conn.shutdown()


def assert_untouched(kv, before: dict, written: list[int]) -> None:
    """Every block of every region but `written` holds the bytes it held `before`."""
    untouched = [b for b in range(kv.num_blocks) if b not in written]
    for name, t in kv.regions.items():
        assert torch.equal(as_bytes(t[:, untouched]), as_bytes(before[name][:, untouched]))


@pytest.mark.slow
def test_nixl_read_is_byte_exact_and_notification_releases_the_lease(peer, decode):
    assert decode.ucx_env_applied == {}  # a pool in host memory gets no GPU defaults
    src_ids, dst_ids = [3, 4, 5, 9, 20, 21], [7, 8, 9, 0, 30, 31]
    handle = peer.prefill("r1", src_ids)
    before = {n: t.clone() for n, t in decode.kv.regions.items()}
    assert run_load(decode, handle, dst_ids, peer=fetch(handle)) is None
    assert_blocks_equal(decode.kv, dst_ids, peer.kv(), src_ids)
    assert_untouched(decode.kv, before, dst_ids)
    # runs (3..5 -> 7..9), (9 -> 0), (20..21 -> 30..31): 3 descriptors per layer, 2 regions x 3 layers
    assert decode.stats.descriptors_sum == 18
    assert decode.stats.bytes_transferred == 6 * 3 * 4 * (40 + 16) * decode.kv.regions["latent"].element_size()
    state = peer.wait_released("r1")
    assert state["leases"] == 0 and state["lease_expirations"] == 0
    # the second request reuses the known peer instance (no metadata needed)
    assert run_load(decode, peer.prefill("r2", [0]), [1]) is None
    assert_blocks_equal(decode.kv, [1], peer.kv(), [0])
    peer.wait_released("r2")


@pytest.mark.slow
def test_nixl_flipped_byte_in_the_prefill_pool_fails_every_read_at_verify(peer, decode):
    handle = peer.prefill("flip", [2, 3])
    assert handle.checksums is not None and set(handle.checksums) == {"latent", "index_k"}
    peer.cmd(op="flip", region="index_k", block=3)  # after the lease: what decode reads is not what was leased
    err = run_load(decode, handle, [5, 6], peer=fetch(handle))
    assert err is not None and err.stage is TransferStage.VERIFY and "index_k" in err.reason
    assert decode.stats.verify_failures == 2 and decode.stats.verified_loads == 0  # the read and the re-read
    assert decode.stats.failures_by_stage == {"VERIFY": 1}
    peer.wait_released("flip")  # the failed load let prefill free its blocks
    peer.cmd(op="flip", region="index_k", block=3)  # flipped back: the module's peer serves other tests
    assert run_load(decode, peer.prefill("clean", [4]), [7]) is None and decode.stats.verified_loads == 1


@pytest.mark.slow
def test_nixl_hand_off_is_a_notification_from_prefill_to_decode(peer, decode):
    # prefill adds the decode agent from its metadata and notifies it; decode sees who sent what
    payloads = ["a" * 40, "b" * 100_000]  # up to a long handle's JSON
    for p in payloads:
        assert peer.cmd(
            op="handoff", engine_id=decode.engine_id, metadata=decode.peer_metadata().decode(), payload=p
        ) == {"sent": True}
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 5.0
    while len(got) < len(payloads) and time.monotonic() < deadline:
        got += decode.poll_handoffs()
        time.sleep(0.005)
    assert got == [(peer.engine_id, p.encode()) for p in payloads]
    # a decode side of another model: refused by its compatibility hash, nothing sent
    other = nixl_decode(peer.dtype, model_id="other")
    try:
        reply = peer.cmd(op="handoff", engine_id=other.engine_id, metadata=other.peer_metadata().decode(), payload="x")
        assert "compatibility hash mismatch" in reply["error"]
        assert other.poll_handoffs() == []
    finally:
        other.shutdown()


@pytest.mark.slow
def test_nixl_staged_read_is_one_descriptor_and_falls_back_when_the_landing_arena_is_full():
    peer = Peer("bfloat16", seed=5, staging_mib=1)
    decode = nixl_decode("bfloat16", landing_mib=1)
    try:
        src_ids, dst_ids = [3, 4, 5, 9, 20, 21], [7, 8, 9, 0, 30, 31]
        handle = peer.prefill("s1", src_ids)
        assert handle.staged is not None and handle.staged.nbytes >= 6 * 3 * 4 * (40 + 16) * 2
        before = {n: t.clone() for n, t in decode.kv.regions.items()}
        assert run_load(decode, handle, dst_ids, peer=fetch(handle)) is None
        assert_blocks_equal(decode.kv, dst_ids, peer.kv(), src_ids)
        assert_untouched(decode.kv, before, dst_ids)
        assert decode.stats.descriptors_sum == 1 and decode.stats.staged == {("decode", "staged"): 1}
        assert decode.stats.bytes_transferred == 6 * 3 * 4 * (40 + 16) * 2 and decode.landing_arena.used_bytes == 0
        assert peer.wait_released("s1")["staging_used"] == 0
        # no landing room: the pinned blocks are read one run at a time, as without staging
        blocker = decode.landing_arena.alloc(decode.landing_arena.capacity - 256)
        handle = peer.prefill("s2", [10, 1])
        assert run_load(decode, handle, [2, 3]) is None
        assert_blocks_equal(decode.kv, [2, 3], peer.kv(), [10, 1])
        assert decode.stats.staged[("decode", "arena_full")] == 1 and decode.stats.descriptors_sum == 1 + 2 * 6
        decode.landing_arena.free(blocker)
        assert peer.wait_released("s2")["staging_used"] == 0
    finally:
        decode.shutdown()
        peer.stop()


@pytest.mark.slow
def test_nixl_reads_complete_while_the_prefill_engine_is_busy():
    # the peer's engine loop polls every 3 s (a long prefill step); its connector's progress thread
    # advances its side of the reads: without it a read waits for the next poll (0-3 s)
    peer = Peer("float32", poll_ms=3000)
    decode = nixl_decode("float32")
    try:
        first = peer.prefill("p0", [1])
        assert run_load(decode, first, [1], peer=fetch(first)) is None  # connection set up
        for i in range(3):
            started = time.monotonic()
            assert run_load(decode, peer.prefill(f"p{i + 1}", [2, 3]), [4, 5], limit_s=10.0) is None
            assert time.monotonic() - started < 0.5
    finally:
        decode.shutdown()
        peer.stop()


@pytest.mark.slow
def test_nixl_lease_expiry_releases_without_notification(peer):
    peer.prefill("never-read", [1, 2])
    time.sleep(PEER_LEASE_S + 0.1)
    state = peer.wait_released("never-read")
    assert state["leases"] == 0 and state["lease_expirations"] >= 1


@pytest.mark.slow
def test_nixl_hash_mismatch_is_refused_with_both_hashes(peer):
    other = nixl_decode(peer.dtype, model_id="another-model")
    try:
        handle = peer.prefill("mismatch", [1])
        with pytest.raises(TransferError) as err:
            other.start_load(handle, [0])
        assert err.value.stage is TransferStage.HANDSHAKE and "refused" in err.value.reason
        assert handle.compat_hash in err.value.reason and other.compat_hash in err.value.reason
        # a handle that matches but whose peer serves other metadata is refused at the handshake too
        forged = handle.model_copy(update={"compat_hash": other.compat_hash})
        err2 = run_load(other, forged, [0], peer=fetch(forged))
        assert err2.stage is TransferStage.HANDSHAKE and handle.compat_hash in err2.reason
    finally:
        other.shutdown()
    peer.cmd(op="poll")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_nixl_unreachable_peer_fails_fast_at_the_handshake(peer, decode):
    handle = peer.prefill("unreachable", [1])
    dead_url = f"http://127.0.0.1:{free_port()}/metadata"
    started = time.monotonic()
    dead = handle.model_copy(update={"metadata_url": dead_url})
    err = run_load(decode, dead, [0], peer=fetch(dead, timeout_s=2.0))
    assert err.stage is TransferStage.HANDSHAKE and dead_url in err.reason
    assert time.monotonic() - started < 2.0 + 1.0
    err = run_load(decode, handle, [0], peer=fetch(handle, allowed=["http://127.0.0.1:1"]))
    assert err.stage is TransferStage.HANDSHAKE and "not from a configured peer" in err.reason
    err = run_load(decode, handle.model_copy(update={"request_id": "no-metadata"}), [0])
    assert err.stage is TransferStage.HANDSHAKE and "no metadata was fetched" in err.reason


@pytest.mark.slow
def test_nixl_killed_prefill_fails_within_the_timeout_and_is_forgotten():
    peer = Peer("float32")
    decode = nixl_decode("float32")
    stale = None
    try:
        ok = peer.prefill("ok", [1, 2])
        assert run_load(decode, ok, [3, 4], peer=fetch(ok)) is None
        handle = peer.prefill("after-kill", [5])
        stale = serve_metadata(httpx.get(peer.metadata_url, timeout=2.0).content)
        peer.proc.send_signal(signal.SIGKILL)
        peer.proc.wait(timeout=10)
        started = time.monotonic()
        err = run_load(decode, handle, [6])
        assert err is not None and err.stage is TransferStage.READING, err
        assert time.monotonic() - started < decode.transfer_timeout_s + 1.0
        # the dead peer was dropped: the next handle needs metadata again, and fetching it fails cleanly
        again = handle.model_copy(update={"request_id": "again"})
        err = run_load(decode, again, [6], peer=fetch(again))
        assert err.stage is TransferStage.HANDSHAKE and "fetching metadata" in err.reason
        # metadata that still reaches us but names a dead NIXL agent: unreachable agent, refused
        stale_url = f"http://127.0.0.1:{stale.server_address[1]}/metadata"
        stale_handle = handle.model_copy(update={"request_id": "stale", "metadata_url": stale_url})
        err = run_load(decode, stale_handle, [6], peer=fetch(stale_handle))
        assert err.stage is TransferStage.HANDSHAKE and "adding NIXL agent" in err.reason, err
        assert decode.stats.transfers_done == 1 and decode.stats.transfers_failed == 3
    finally:
        if stale is not None:
            stale.shutdown()
        decode.shutdown()
        peer.stop()
