"""The router's only real work: pick workers, forward, stream (DESIGN.md's request flow).

    generate(request)
      PD:        prefill.generate(hold_kv) --> first token + KVHandle --> yielded at once
                 decode.generate(handle, first token) --> deltas --> yielded as they come
      colocated: both.generate --> deltas

A worker that cannot be reached, answers 503, or is full (429) before anything streamed is retried
on another worker of the role (at most `max_attempts` workers, with exponential backoff between
tries); one that cannot be reached is marked down at once. Once output has started, a failure is
final: an OpenAIError (502/504) raised into the stream, never tokens from a second attempt.
Each request's outcome feeds its worker's circuit breaker (breaker.py).

Aborts (the client left, a timeout, an error): a worker whose request was sent but not finished is
told at once (/internal/abort; a prefill worker that already holds the KV frees it), and if the
decode side never streamed (so never read the KV) the prefill lease is released at once rather
than at expiry. The prefill phase (choose a worker, run the prompt, get the first token and the
KV handle) is bounded by `prefill_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from pdserve.sampling_params import SamplingParams
from pdserve.server.errors import ErrorResponse, OpenAIError
from pdserve.server.health import PoolRole, Worker, WorkerPool
from pdserve.server.metrics import RouterMetrics
from pdserve.server.policies import Policy, RoundRobin
from pdserve.server.protocol import GenerateChunk, GenerateRequest, RequestRef

log = logging.getLogger("pdserve.router")

CONTROL_TIMEOUT_S = 5.0  # abort / release calls


@dataclass
class DispatchSettings:
    max_attempts: int = 3  # workers tried per role before giving up
    retry_backoff_s: float = 0.05  # sleep before the 2nd try; doubles each try (with jitter)
    max_backoff_s: float = 1.0
    prefill_timeout_s: float = 300.0  # choose a prefill worker .. its first token and KV handle

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.retry_backoff_s < 0 or self.max_backoff_s < 0 or self.prefill_timeout_s <= 0:
            raise ValueError(f"invalid dispatch settings: {self}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before try number attempt + 1 (attempt >= 1)."""
        return min(self.max_backoff_s, self.retry_backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        client: httpx.AsyncClient,
        prefill_policy: Policy,
        decode_policy: Policy,
        headers: dict[str, str],
        metrics: RouterMetrics,
        settings: DispatchSettings | None = None,
    ) -> None:
        self.pool = pool
        self.client = client
        self.policies = {"prefill": prefill_policy, "decode": decode_policy, "both": RoundRobin()}
        self.headers = {**headers, "content-type": "application/json"}
        self.metrics = metrics
        self.s = settings or DispatchSettings()
        self._background: set[asyncio.Task] = set()

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[GenerateChunk]:
        """The request's output as chunks of new content only (offsets continue from 0 without
        overlap), the last one with finish_reason. Raises OpenAIError."""
        if self.pool.can_pd():
            source = self._pd(request_id, prompt, params)
        elif self.pool.available("both"):
            source = self._colocated(request_id, prompt, params)
        else:
            raise OpenAIError(503, "no healthy workers: need a prefill and a decode worker, or a colocated one", code="no_healthy_workers")
        joined = _Joiner()
        try:
            async for chunk in source:
                new = joined.take(chunk)
                if new is not None:
                    yield new
        finally:
            await source.aclose()

    # -- the two paths --
    async def _pd(self, rid: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[GenerateChunk]:
        pw, first = await self._prefill(rid, prompt, params)
        if first is None or (first.finish_reason is None and first.kv_handle is None) or not first.token_ids:
            raise OpenAIError(502, f"prefill worker {pw.url} ended without a first token", code="upstream_error")
        if first.finish_reason == "error":
            raise OpenAIError(502, f"prefill failed: {first.error}", code="upstream_error")
        if first.finish_reason is not None:  # the first token already ended it: no KV is held
            yield first
            return
        dreq = GenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            params=params,
            kv_handle=first.kv_handle,
            first_token=first.token_ids[0],
            first_token_logprobs=first.logprobs[0] if first.logprobs else None,
        )
        dw: Worker | None = None
        decode_read = finished = False
        try:
            yield first
            dw, dresp = await self._open("decode", dreq)
            async for chunk in self._read(dw, dresp):
                decode_read = chunk.finish_reason != "error"  # decode streams tokens only once the KV has arrived
                _raise_if_failed(chunk, "decode")
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if not decode_read:
                self._later(pw, "/internal/release", rid)
            if dw is not None and not finished:
                self._later(dw, "/internal/abort", rid)

    async def _prefill(self, rid: str, prompt: list[int], params: SamplingParams) -> tuple[Worker, GenerateChunk | None]:
        """The prefill worker and its last chunk (first token + KV handle), within prefill_timeout_s.
        Left early (client gone, timeout, error), the worker is told to abort, freeing any KV it holds."""
        req = GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params, hold_kv=True)
        pw: Worker | None = None
        tried: list[Worker] = []
        first: GenerateChunk | None = None
        done = False
        try:
            async with asyncio.timeout(self.s.prefill_timeout_s):
                pw, presp = await self._open("prefill", req, tried)
                async for chunk in self._read(pw, presp):
                    first = chunk
            done = True
        except TimeoutError:
            self._count("prefill", "prefill_timeout")
            last = pw or (tried[-1] if tried else None)
            if last is not None:
                self.pool.report(last, ok=False)
            where = f"prefill worker {last.url}" if last is not None else "no prefill worker"
            raise OpenAIError(504, f"{where}: no first token within the prefill timeout ({self.s.prefill_timeout_s} s)", code="prefill_timeout") from None
        finally:
            if pw is not None and not done:
                self._later(pw, "/internal/abort", rid)
        return pw, first

    async def _colocated(self, rid: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[GenerateChunk]:
        w, resp = await self._open("both", GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params))
        finished = False
        try:
            async for chunk in self._read(w, resp):
                _raise_if_failed(chunk, "worker")
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if not finished:
                self._later(w, "/internal/abort", rid)

    # -- talking to workers --
    async def _open(self, role: PoolRole, req: GenerateRequest, attempts: list[Worker] | None = None) -> tuple[Worker, httpx.Response]:
        """Start /internal/generate on a worker of `role`; the response is open and 200.
        attempts: if given, each worker tried is appended (the caller's timeout names the last)."""
        tried: set[str] = set()
        last: OpenAIError | None = None
        body = req.model_dump_json(exclude_none=True)
        for attempt in range(self.s.max_attempts):
            candidates = [w for w in self.pool.candidates(role) if w.url not in tried]
            if not candidates:
                break
            if attempt:
                self.metrics.retries.labels(role).inc()
                await asyncio.sleep(self.s.backoff(attempt))
            w = self.policies[role].choose(candidates)
            tried.add(w.url)
            if attempts is not None:
                attempts.append(w)
            self.pool.acquire(w)
            try:
                resp = await self.client.send(self.client.build_request("POST", f"{w.url}/internal/generate", content=body, headers=self.headers), stream=True)
            except httpx.TimeoutException as e:
                self.pool.report(w, ok=False)
                self.pool.release(w)
                self._count(role, "timeout")
                last = OpenAIError(504, f"{role} worker {w.url} did not answer: {type(e).__name__}", code="upstream_timeout")
                continue
            except httpx.ConnectError as e:  # nothing listens: down until a health probe says otherwise
                self.pool.report(w, ok=False)
                self.pool.release(w)
                self._count(role, "unreachable")
                self.pool.mark_down(w, f"unreachable: {type(e).__name__}")
                last = OpenAIError(503, f"{role} worker {w.url} is unreachable", code="upstream_unavailable")
                continue
            except httpx.TransportError as e:
                # The connection broke after it was made (e.g. a keep-alive race): one failure for the
                # breaker, not a verdict on the worker. It may have admitted the request: abort it there.
                self.pool.report(w, ok=False)
                self.pool.release(w)
                self._count(role, "transport_error")
                self._later(w, "/internal/abort", req.request_id)
                last = OpenAIError(502, f"{role} worker {w.url} dropped the connection ({type(e).__name__})", code="upstream_error")
                continue
            except asyncio.CancelledError:  # the client left or a timeout fired: the worker may have admitted it
                self.pool.release(w)
                self._later(w, "/internal/abort", req.request_id)
                raise
            if resp.status_code == 200:
                return w, resp
            err = await self._refusal(w, resp, role)
            if resp.status_code not in (429, 503):
                raise err  # the request itself was refused: another worker would refuse it too
            last = err
        raise last or OpenAIError(503, f"no healthy {role} worker", code="no_healthy_workers")

    async def _refusal(self, w: Worker, resp: httpx.Response, role: str) -> OpenAIError:
        try:
            body = await resp.aread()
        except httpx.HTTPError:
            body = b""
        finally:
            await resp.aclose()
            self.pool.release(w)
        self._count(role, str(resp.status_code))
        if resp.status_code >= 500:
            self.pool.report(w, ok=False)
        try:
            info = ErrorResponse.model_validate_json(body).error
            msg, code = info.message, info.code
        except ValueError:
            msg, code = body[:200].decode(errors="replace"), None
        if resp.status_code == 503:
            self.pool.mark_down(w, f"answered 503: {msg}")
        status = resp.status_code if resp.status_code in (400, 413, 422, 429) else 502
        headers = {"Retry-After": resp.headers["retry-after"]} if "retry-after" in resp.headers else None
        return OpenAIError(status, f"{role} worker: {msg}", code="upstream_refused" if status == 502 else code, headers=headers)

    async def _read(self, w: Worker, resp: httpx.Response) -> AsyncIterator[GenerateChunk]:
        role = w.role
        finished = False
        try:
            async for line in resp.aiter_lines():
                if line.strip():
                    chunk = GenerateChunk.model_validate_json(line)
                    if not finished and (chunk.finish_reason is not None or chunk.kv_handle is not None):
                        finished = True
                        self.pool.report(w, ok=chunk.finish_reason != "error")
                    yield chunk
        except httpx.TimeoutException:
            self._count(role, "timeout")
            self.pool.report(w, ok=False)
            raise OpenAIError(504, f"{role} worker {w.url} stopped sending", code="upstream_timeout") from None
        except (httpx.TransportError, ValueError) as e:
            self._count(role, "broken_stream")
            self.pool.report(w, ok=False)
            self.pool.mark_down(w, f"stream broke: {type(e).__name__}")
            raise OpenAIError(502, f"{role} worker {w.url} failed mid-request ({type(e).__name__})", code="upstream_error") from None
        finally:
            await resp.aclose()
            self.pool.release(w)
        if not finished:
            self._count(role, "truncated")
            self.pool.report(w, ok=False)
            raise OpenAIError(502, f"{role} worker {w.url} closed the stream before the request finished", code="upstream_error")

    def _later(self, w: Worker, path: str, rid: str) -> None:
        """Fire-and-forget control call (abort / release); failures only cost a lease's time."""
        task = asyncio.get_running_loop().create_task(self._control(w, path, rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _control(self, w: Worker, path: str, rid: str) -> None:
        try:
            await self.client.post(f"{w.url}{path}", content=RequestRef(request_id=rid).model_dump_json(), headers=self.headers, timeout=CONTROL_TIMEOUT_S)
        except httpx.HTTPError as e:
            log.info("%s %s for %s failed: %s", w.url, path, rid, e)

    def _count(self, role: str, kind: str) -> None:
        self.metrics.upstream_errors.labels(role, kind).inc()


def _raise_if_failed(chunk: GenerateChunk, who: str) -> None:
    if chunk.finish_reason == "error":
        raise OpenAIError(502, f"{who} failed: {chunk.error}", code="upstream_error")


class _Joiner:
    """Keeps what was already yielded, so overlapping streams (decode repeats the first token)
    join without repeating anything."""

    def __init__(self) -> None:
        self.tokens = 0
        self.text = 0

    def take(self, c: GenerateChunk) -> GenerateChunk | None:
        if c.token_offset > self.tokens or c.text_offset > self.text:
            raise OpenAIError(502, "a worker's stream skipped output (protocol error)", code="upstream_error")
        k, j = self.tokens - c.token_offset, self.text - c.text_offset
        ids, text = c.token_ids[k:], c.text[j:]
        logprobs = c.logprobs[k:] if c.logprobs is not None else None
        if not ids and not text and c.finish_reason is None:
            return None
        out = c.model_copy(update={"token_offset": self.tokens, "token_ids": ids, "text_offset": self.text, "text": text, "logprobs": logprobs})
        self.tokens += len(ids)
        self.text += len(text)
        return out
