"""A worker's view of its PD peers: their transfer metadata, fetched over HTTP on the event loop
before a request enters the engine, so the engine loop never waits on the network.

    POST /internal/generate -> fetch(ref) -> PeerMetadata -> engine.add(request, peer)
      decode: ref = the KV handle, or Request.kv_from (the prefill engine to expect it from)
      prefill: ref = Request.kv_to (the decode engine to notify when the KV is ready)

One GET per peer engine instance (a restarted peer has a new instance id, so its metadata is
fetched anew; a ref without one takes whichever instance is cached); concurrent requests from a
new peer share one GET. Only configured peers are asked
(the handle's metadata URL must be one of their origins), with the cluster secret when there is
one, within a timeout, and at most MAX_METADATA_BYTES. A failure is not raised here: it travels to
the engine as PeerMetadata.error and fails (or recomputes, by policy) that request at HANDSHAKE.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import httpx

from pdserve.disagg.base import KVHandle, KVPeerRef, PeerMetadata

log = logging.getLogger("pdserve.worker.peers")

MAX_METADATA_BYTES = 16 << 20


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


class PeerMetadataFetcher:
    def __init__(self, allowed_peers: list[str], timeout_s: float, headers: dict[str, str] | None = None) -> None:
        """allowed_peers: worker URLs (origins) metadata may come from."""
        self.allowed = {origin(p) for p in allowed_peers}
        self.timeout_s = timeout_s
        self.headers = headers or {}
        self._cache: dict[str, PeerMetadata] = {}  # engine id -> its latest instance's metadata
        self._inflight: dict[tuple[str, str], asyncio.Task[PeerMetadata]] = {}
        # made now, not in the first request's time budget (it builds an SSL context); no proxies
        # from the environment: this is cluster-internal traffic
        self._client = httpx.AsyncClient(timeout=timeout_s, trust_env=False)

    async def fetch(self, handle: KVHandle | KVPeerRef) -> PeerMetadata:
        known = self._cache.get(handle.engine_id)
        if known is not None and handle.instance_id in (None, known.instance_id):
            return known
        key = (handle.engine_id, handle.instance_id)
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._get(handle))
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(task)  # one caller leaving does not cancel the others' fetch

    async def _get(self, handle: KVHandle | KVPeerRef) -> PeerMetadata:
        url = handle.metadata_url
        if origin(url) not in self.allowed:
            return self._failed(
                handle,
                f"metadata URL {url} is not from a configured peer ({', '.join(sorted(self.allowed)) or 'none'})",
            )
        try:
            async with asyncio.timeout(self.timeout_s):
                data = await self._download(url)
        except TimeoutError:
            return self._failed(handle, f"fetching metadata from {url}: Timeout after {self.timeout_s} s")
        except (httpx.HTTPError, ValueError) as e:
            return self._failed(handle, f"fetching metadata from {url}: {e!r}")
        meta = PeerMetadata(engine_id=handle.engine_id, instance_id=handle.instance_id, data=data)
        self._cache[handle.engine_id] = meta
        return meta

    async def _download(self, url: str) -> bytes:
        body = bytearray()
        async with self._client.stream("GET", url, headers=self.headers) as resp:
            resp.raise_for_status()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > MAX_METADATA_BYTES:
                    raise ValueError(f"metadata from {url} is larger than {MAX_METADATA_BYTES} bytes")
        return bytes(body)

    def _failed(self, handle: KVHandle | KVPeerRef, why: str) -> PeerMetadata:
        log.warning("peer %s: %s", handle.engine_id, why)
        return PeerMetadata(engine_id=handle.engine_id, instance_id=handle.instance_id, error=why)

    async def aclose(self) -> None:
        await self._client.aclose()
