"""A worker's engine that fails (issue 29, item 1), in process on the tiny model: a step that
raises (the test-only hook PDSERVE_TEST_FAULT) ends every open request with the exception's type,
refuses new ones, and the watchdog asks the process to exit with EXIT_CODE once; a stop signal
first (ranks dying with their group) is no failure. The whole path under `pdserve launch`, and
a killed TP rank, are tests/e2e/test_engine_failure.py."""

import asyncio
import threading

import pytest

from pdserve.config import resolve_model
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.worker.async_engine import AsyncEngine
from pdserve.worker.failure import EXIT_CODE, watch_engine

pytestmark = pytest.mark.timeout(120)
TRIGGER = 777


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=8, ignore_eos=True))


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setenv("PDSERVE_TEST_FAULT", f"colocated:{TRIGGER}")
    config = EngineConfig(model=resolve_model("tiny:deepseek_v3"), num_kv_blocks=32, kv_block_size=16)
    ae = AsyncEngine(LLMEngine(config))
    ae.start()
    yield ae
    ae.stop()
    ae.shutdown()


async def test_a_failed_step_fails_every_open_request_and_asks_to_exit(engine):
    done = [o async for o in engine.add(_request("before", [1, 2, 3]))]  # deltas
    assert done[-1].outputs[0].finish_reason == "length" and sum(len(o.outputs[0].token_ids) for o in done) == 8
    exits: list[int] = []
    watch = asyncio.create_task(watch_engine(engine, "colocated", exits.append, threading.Event()))
    await asyncio.sleep(0.3)
    assert exits == [] and not watch.done()  # a healthy engine: the watchdog waits

    bystander = engine.add(_request("bystander", [4, 5, 6]))  # open when the step fails
    failing = engine.add(_request("failing", [1, TRIGGER]))
    for stream in (bystander, failing):
        last = [o async for o in stream][-1]
        assert last.finished and last.outputs[0].finish_reason == "error"
        assert last.error == "engine step raised OutOfMemoryError"
    assert not engine.alive and engine.num_open == 0
    with pytest.raises(RuntimeError, match="engine is not running: engine step raised OutOfMemoryError"):
        engine.add(_request("after", [1, 2]))
    await asyncio.wait_for(watch, 5)
    assert exits == [EXIT_CODE]


async def test_a_stop_signal_first_is_no_failure(engine):
    exits: list[int] = []
    stopping = threading.Event()
    watch = asyncio.create_task(watch_engine(engine, "colocated", exits.append, stopping))
    stopping.set()
    await asyncio.wait_for(watch, 2)
    assert exits == [] and engine.alive
