"""Fixtures for the api tests: a real gRPC server on a free port, in this process, over a
MemoryBroker (with call counting) and the session's private nats-server."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from conveyor_api import ApiServer
from conveyor_api.session import HELLO_TIMEOUT
from conveyor_broker import FakeClock
from conveyor_protos.v1 import service_pb2_grpc
from conveyor_runtime.nats_connect import NatsClient, connect_nats
from conveyor_runtime.settings import ApiSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.webhook_urls import Resolve
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.stream import MakeApi
from conveyor_testkit.webhooks import WEBHOOK_KEY, FakeDns

TOKEN = "s3cret-token-of-the-tests"


@pytest.fixture
def clock() -> FakeClock:
    """The clock of the broker and the server."""
    return FakeClock()


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[CountingBroker]:
    """A fresh in-memory broker."""
    b = CountingBroker(clock)
    yield b
    await b.close()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    """A NATS connection shared by the server under test and the test itself."""
    client = await connect_nats(nats_url, name="api-test")
    yield client
    await client.close()


@pytest.fixture
def subjects() -> Subjects:
    """A subject prefix no other test uses."""
    return Subjects(prefix=f"t{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def make_api(
    nats_url: str, subjects: Subjects, broker: CountingBroker, nc: NatsClient, clock: FakeClock
) -> AsyncIterator[MakeApi]:
    """Start an ApiServer with settings overrides; every one started is stopped after."""
    started: list[ApiServer] = []

    async def make(
        *,
        hello_timeout: float = HELLO_TIMEOUT,
        resolve: Resolve | None = None,
        **overrides: Any,
    ) -> ApiServer:
        # ``resolve`` looks up webhook URL hosts (default: no name resolves, so no test
        # depends on DNS; every name is let through then).
        options: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "nats_url": nats_url,
            "subject_prefix": subjects.prefix,
            "broker": "memory",
            "allow_unauthenticated": True,
            "register_tick": 60.0,
            "enqueue_batch_window": 0.005,
            "webhook_secret_key": WEBHOOK_KEY,
        }
        options.update(overrides)
        server = ApiServer(
            ApiSettings(**options),
            broker,
            nc,
            clock,
            hello_timeout=hello_timeout,
            resolve=resolve or FakeDns({}).lookup,
        )
        await server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop(grace=1.0)


@pytest.fixture
async def api(make_api: MakeApi) -> ApiServer:
    """A server with the default test settings (auth off)."""
    return await make_api()


@pytest.fixture
async def channel(api: ApiServer) -> AsyncIterator[grpc.aio.Channel]:
    """A client channel to ``api``."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        yield ch


@pytest.fixture
def tasks(channel: grpc.aio.Channel) -> Any:
    """A raw TaskService stub."""
    stub: Any = service_pb2_grpc.TaskServiceStub
    return stub(channel)


@pytest.fixture
def admin(channel: grpc.aio.Channel) -> Any:
    """A raw AdminService stub."""
    stub: Any = service_pb2_grpc.AdminServiceStub
    return stub(channel)
