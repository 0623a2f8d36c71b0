"""The build-event web UI's test rig (pytest fixtures: import ``web_rig`` and
``web_without_nats`` into a test module): a real Postgres, a real ingest in process (``BepServer``) whose
commits publish live digests on a real nats-server, and the web app served by a real
uvicorn on a loopback port, read with httpx.

``web_rig`` holds two projects (``acme`` and ``beta``) with a key each; ``web_rig.feed``
opens a build stream that a test feeds request by request, waiting for each ack (so a
test controls how the build unfolds without sleeping).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import grpc
import httpx
import pytest
from conveyor_bep.bazel.google.devtools.build.v1 import publish_build_event_pb2_grpc
from conveyor_bep.ingest import IngestLimits
from conveyor_bep.keys import KeyCache, create_key, create_project
from conveyor_bep.live import LivePublisher
from conveyor_bep.server import BepServer
from conveyor_bep.store import BEP_MIGRATIONS
from conveyor_bep_web.app import create_app
from conveyor_bep_web.serve import WebServer, start_web
from conveyor_runtime.embedded_nats import EmbeddedNats
from conveyor_runtime.nats_connect import close_nats, connect_nats
from conveyor_runtime.settings import BepWebSettings
from nats.aio.client import Client as NatsClient

from conveyor_testkit.bep import Request, publish
from conveyor_testkit.polling import wait_until

#: The shortest time between two live events in these tests (seconds).
INTERVAL = 0.2


class Feed:
    """One build stream fed by the test: :meth:`send` a request and wait for its ack."""

    def __init__(self, channel: grpc.aio.Channel, key: str) -> None:
        stub = publish_build_event_pb2_grpc.PublishBuildEventStub(channel)  # type: ignore[no-untyped-call]
        self._queue: asyncio.Queue[Request | None] = asyncio.Queue()
        self.acks: list[int] = []
        self._call = stub.PublishBuildToolEventStream(
            self._source(), metadata=(("x-api-key", key),), timeout=60
        )
        self._reader = asyncio.ensure_future(self._read())

    async def _source(self) -> AsyncIterator[Request]:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            yield item

    async def _read(self) -> None:
        async for response in self._call:
            self.acks.append(response.sequence_number)

    async def send(self, request: Request) -> None:
        """Send ``request`` and return once the ingest has acked it (it is committed)."""
        seq = request.ordered_build_event.sequence_number
        self._queue.put_nowait(request)
        await wait_until(lambda: seq in self.acks or self._reader.done(), within=15)
        if self._reader.done() and seq not in self.acks:
            self._reader.result()
            raise AssertionError(f"stream ended before ack {seq}")

    async def close(self) -> None:
        """End the request stream and wait for the call to finish."""
        self._queue.put_nowait(None)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await asyncio.wait_for(self._reader, 15)


@dataclass
class SseEvent:
    """One Server-Sent Event as read: its name, data (JSON) and when it arrived."""

    event: str
    data: Any
    at: float


class SseReader:
    """Reads a Server-Sent Events stream in a task, collecting its events."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.events: list[SseEvent] = []
        self.status: int | None = None
        self.done = asyncio.Event()
        self._task = asyncio.ensure_future(self._run(client, url))

    async def _run(self, client: httpx.AsyncClient, url: str) -> None:
        try:
            async with client.stream("GET", url, timeout=60) as response:
                self.status = response.status_code
                if response.status_code != 200:
                    return
                name, data = "message", ""
                async for line in response.aiter_lines():
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        data = line[6:]
                    elif line == "" and data:
                        self.events.append(SseEvent(name, json.loads(data), time.monotonic()))
                        name, data = "message", ""
        finally:
            self.done.set()

    def named(self, event: str) -> list[SseEvent]:
        """The events called ``event`` so far."""
        return [e for e in self.events if e.event == event]

    async def close(self) -> None:
        """Stop reading."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@dataclass
class WebRig:
    """The rig's parts (see the module)."""

    pool: asyncpg.Pool[Any]
    ingest: BepServer
    live: LivePublisher
    channel: grpc.aio.Channel
    keys: dict[str, str]
    project_ids: dict[str, int]
    settings: BepWebSettings
    web: WebServer
    client: httpx.AsyncClient
    nats_url: str
    feeds: list[Feed] = field(default_factory=list)
    readers: list[SseReader] = field(default_factory=list)

    async def publish(self, stream: list[Request], project: str = "acme") -> None:
        """Stream a whole build and check it was all acked."""
        outcome = await publish(self.channel, stream, key=self.keys[project])
        assert outcome.code == grpc.StatusCode.OK, outcome.details
        assert outcome.acks == list(range(1, len(stream) + 1))

    def feed(self, project: str = "acme") -> Feed:
        """A stream of ``project`` that the test feeds one request at a time."""
        feed = Feed(self.channel, self.keys[project])
        self.feeds.append(feed)
        return feed

    def sse(self, path: str, *, client: httpx.AsyncClient | None = None) -> SseReader:
        """A reader of the event stream at ``path`` of the rig's web server (or of
        ``client``'s); closed with the rig."""
        reader = SseReader(client or self.client, path)
        self.readers.append(reader)
        return reader


@pytest.fixture(name="web_rig")
async def web_rig_fixture(fresh_pg_dsn: str, nats_server: EmbeddedNats) -> AsyncIterator[WebRig]:
    """The rig (see the module), torn down after the test."""
    await BEP_MIGRATIONS.migrate(fresh_pg_dsn)
    pool = await asyncpg.create_pool(fresh_pg_dsn, min_size=1, max_size=12)
    assert pool is not None
    keys: dict[str, str] = {}
    project_ids: dict[str, int] = {}
    async with pool.acquire() as conn:
        for slug in ("acme", "beta"):
            project_ids[slug] = await create_project(conn, slug, name=slug.title())
            keys[slug] = (await create_key(conn, slug)).key
    prefix = f"t{uuid.uuid4().hex[:12]}"
    ingest_nc: NatsClient = await connect_nats(nats_server.url, name="test-ingest")
    web_nc: NatsClient = await connect_nats(nats_server.url, name="test-web")
    live = LivePublisher(ingest_nc, prefix)
    live.start()
    ingest = BepServer(
        pool,
        KeyCache(pool),
        shards=2,
        commit_interval=0.005,
        limits=IngestLimits(batch_window=0.005),
        on_committed=live.committed,
    )
    port = await ingest.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    settings = BepWebSettings(
        dsn=fresh_pg_dsn,
        port=0,
        subject_prefix=prefix,
        nats_url=nats_server.url,
        bep_web_digest_interval=INTERVAL,
    )
    web = await start_web(settings, pool, web_nc)
    client = httpx.AsyncClient(base_url=web.url, timeout=30)
    rig = WebRig(
        pool, ingest, live, channel, keys, project_ids, settings, web, client, nats_server.url
    )
    try:
        yield rig
    finally:
        for reader in rig.readers:
            await reader.close()
        for feed in rig.feeds:
            await feed.close()
        await client.aclose()
        web.server.force_exit = True
        await web.stop()
        await channel.close()
        await ingest.stop(0)
        await live.stop()
        await close_nats(ingest_nc, drain=False)
        await close_nats(web_nc, drain=False)
        await pool.close()


StartPolling = Callable[[], Awaitable[tuple[WebServer, httpx.AsyncClient]]]


@pytest.fixture(name="web_without_nats")
async def web_without_nats_fixture(web_rig: WebRig) -> AsyncIterator[StartPolling]:
    """Starts a second web server over the rig's pool with no NATS connection (its live
    streams poll Postgres)."""
    started: list[tuple[WebServer, httpx.AsyncClient]] = []

    async def start() -> tuple[WebServer, httpx.AsyncClient]:
        app = create_app(web_rig.settings, web_rig.pool, None)
        server = await start_web(web_rig.settings, web_rig.pool, None, app=app)
        pair = (server, httpx.AsyncClient(base_url=server.url, timeout=30))
        started.append(pair)
        return pair

    try:
        yield start
    finally:
        for server, client in started:
            await client.aclose()
            server.server.force_exit = True
            await server.stop()
