"""Requests while workers drain, restart or die, as the chaos run (scripts/chaos.py, two workers
a role) found them failing the client.

A request that no worker takes for now (each one draining, or restarting and not yet probed again)
is not a failure the client must keep: `pdserve restart --all` had moved on to prefill-1 while the
router had not yet taken the restarted prefill-0 back, and two requests got a final 502.
- before anything streamed: the client gets a 503 with Retry-After (it may send it again), not a
  502 "refused the request";
- once the first token is out (PD: decode is opened beside prefill, so its refusal is seen after
  the first token went to the client): the router asks again, as for a migrated request, and the
  stream goes on with no token missing or repeated.

A decode worker SIGKILLed after it took a request but before its hand-off (posted by the router
when prefill could not notify it) gave the client "the decode worker did not take the KV
hand-off": it is a worker failure like a broken stream, and the request is migrated.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from pdserve.config import RouterConfig
from pdserve.disagg.base import KVHandle
from pdserve.engine.request import Request
from pdserve.router import dispatch
from pdserve.router.dispatch import Dispatcher
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import RoundRobin
from pdserve.router.pool import WorkerPool
from pdserve.router.upstream import Upstream, WorkerFailed
from pdserve.sampling_params import SamplingParams
from pdserve.wire.errors import ErrorResponse, OpenAIError
from pdserve.wire.protocol import GenerateChunk

pytestmark = pytest.mark.timeout(60)
DRAINING = ErrorResponse(error=OpenAIError(503, "worker prefill-1 is draining", code="engine_unavailable").info())


@pytest.fixture
async def draining_worker():
    """A worker that answers every /internal/generate as a draining one does (503, no Retry-After)."""

    async def generate(_: web.Request) -> web.Response:
        return web.Response(status=503, text=DRAINING.model_dump_json(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/internal/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_every_worker_refusing_for_now_is_a_503_with_retry_after(draining_worker):
    pool = WorkerPool([draining_worker, "http://127.0.0.1:9"], ["http://127.0.0.1:9"], [], RouterMetrics())
    pool.workers[0].healthy = True  # the draining one, not yet seen draining; the other not yet back
    policies = {"prefill": RoundRobin(), "decode": RoundRobin(), "colocated": RoundRobin()}
    async with aiohttp.ClientSession() as client:
        up = Upstream(pool, client, policies, {}, RouterMetrics(), RouterConfig())
        with pytest.raises(OpenAIError) as err:
            await up.open("prefill", Request(request_id="r", prompt_token_ids=[1, 2, 3]))
    assert err.value.status == 503, (err.value.status, err.value.message)
    assert err.value.headers == {"Retry-After": "2"}
    assert "is draining" in err.value.message
    assert not pool.workers[0].healthy  # marked down: the next request does not try it


def _chunk(rid: str, offset: int, token: int, finish: str | None = None) -> GenerateChunk:
    return GenerateChunk(request_id=rid, token_offset=offset, token_ids=[token], text_offset=offset,
                         text=chr(97 + token), finish_reason=finish)  # fmt: skip


async def test_a_refusal_after_the_first_token_waits_for_a_worker(monkeypatch):
    """First attempt: prefill's first token, then no decode worker takes the request (503); the
    router asks again and the second attempt (resume = the first token) finishes the request."""
    monkeypatch.setattr(dispatch, "MIGRATION_RETRY_S", 0.01)
    asked: list[Request] = []

    def source(self, req: Request, prompt: list[int]):
        asked.append(req)

        async def chunks():
            if len(asked) == 1:
                yield _chunk(req.request_id, 0, 1)
                raise OpenAIError(503, "the decode worker refused the request: worker decode-1 is draining",
                                  code="engine_unavailable", headers={"Retry-After": "2"})  # fmt: skip
            yield _chunk(req.request_id, 1, 2)
            yield _chunk(req.request_id, 2, 3, finish="length")

        return chunks()

    monkeypatch.setattr(Dispatcher, "_source", source)
    pool = WorkerPool([], [], [], RouterMetrics())
    async with aiohttp.ClientSession() as client:
        d = Dispatcher(pool, client, RoundRobin(), RoundRobin(), {}, RouterMetrics())
        got = [c async for c in d.generate("r", [5, 6], SamplingParams(max_tokens=3))]
    assert [t for c in got for t in c.token_ids] == [1, 2, 3]
    assert [r.request_id for r in asked] == ["r", "r.1"]
    assert asked[1].resume is not None and asked[1].resume.token_ids == [1]


async def test_a_refusal_before_any_token_reaches_the_client(monkeypatch):
    """Nothing streamed: the 503 is the client's to retry (the router does not hold the request)."""

    def source(self, req: Request, prompt: list[int]):
        async def chunks():
            raise OpenAIError(503, "no prefill worker", code="no_healthy_workers", headers={"Retry-After": "2"})
            yield  # an async generator

        return chunks()

    monkeypatch.setattr(Dispatcher, "_source", source)
    async with aiohttp.ClientSession() as client:
        d = Dispatcher(WorkerPool([], [], [], RouterMetrics()), client, RoundRobin(), RoundRobin(), {}, RouterMetrics())
        with pytest.raises(OpenAIError) as err:
            await anext(d.generate("r", [5, 6], SamplingParams(max_tokens=3)))
    assert err.value.status == 503 and err.value.message == "no prefill worker"


class _OpenStream:
    closed = False

    def close(self) -> None:
        self.closed = True


async def test_a_decode_worker_gone_before_its_handoff_is_a_worker_failure():
    pool = WorkerPool(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], [], RouterMetrics())  # nothing listens on 9
    dw = pool.workers[1]
    dw.healthy = True
    handle = KVHandle(request_id="r", engine_id="p", instance_id="i", metadata_url="http://127.0.0.1:9/m",
                      block_ids=[0], num_tokens=3, compat_hash="h", lease_expires_at=0.0)  # fmt: skip
    first = GenerateChunk(request_id="r", token_offset=0, token_ids=[7], text_offset=0, text="x", kv_handle=handle)
    policies = {"prefill": RoundRobin(), "decode": RoundRobin(), "colocated": RoundRobin()}
    stream = _OpenStream()
    async with aiohttp.ClientSession() as client:
        up = Upstream(pool, client, policies, {}, RouterMetrics(), RouterConfig())
        pool.acquire(dw)  # decode's open stream, as Upstream.open left it
        with pytest.raises(WorkerFailed) as err:
            await up.post_handoff(dw, stream, first)
    assert err.value.role == "decode" and err.value.cause == "dropped"
    assert "did not take the KV hand-off" in err.value.message
    assert stream.closed and dw.in_flight == 0
