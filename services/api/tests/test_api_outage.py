"""Producer calls during a database outage: UNAVAILABLE with a clean message, never the
driver's internal text. Postgres is real, behind a TCP proxy that can wedge every
connection (stop forwarding without closing) or cut them all."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import grpc
import pytest
from conveyor_broker import FakeClock
from conveyor_broker.postgres import PostgresBroker, migrate
from conveyor_protos.v1 import service_pb2, service_pb2_grpc, task_pb2
from conveyor_testkit.proxy import WedgeProxy
from conveyor_testkit.stream import MakeApi

pytestmark = pytest.mark.postgres


@pytest.fixture
async def proxy(fresh_pg_dsn: str) -> AsyncIterator[WedgeProxy]:
    await migrate(fresh_pg_dsn)
    parts = urlsplit(fresh_pg_dsn)
    async with WedgeProxy(parts.hostname or "127.0.0.1", parts.port or 5432) as p:
        yield p


@pytest.fixture
async def broker(
    fresh_pg_dsn: str, proxy: WedgeProxy, clock: FakeClock
) -> AsyncIterator[PostgresBroker]:
    """Overrides conftest's memory broker: Postgres through the proxy, short timeouts."""
    parts = urlsplit(fresh_pg_dsn)
    auth = parts.netloc.rpartition("@")[0]
    netloc = f"{auth}@127.0.0.1:{proxy.port}" if auth else f"127.0.0.1:{proxy.port}"
    b = await PostgresBroker.connect(
        urlunsplit(parts._replace(netloc=netloc)),
        clock,
        max_size=2,
        statement_timeout=0.5,
        command_timeout=1.0,
        acquire_timeout=2.0,
        connect_timeout=2.0,
    )
    yield b
    await b.close()


def _task() -> task_pb2.NewTask:
    return task_pb2.NewTask(queue="q", type="t", payload=b"p")


@pytest.mark.parametrize("outage", ["wedged", "cut"])
async def test_producer_calls_in_an_outage_are_unavailable_with_a_clean_message(
    make_api: MakeApi, proxy: WedgeProxy, outage: str
) -> None:
    api = await make_api()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        make_stub: Any = service_pb2_grpc.TaskServiceStub
        stub = make_stub(channel)
        await stub.Enqueue(service_pb2.EnqueueRequest(task=_task()))  # the link works
        if outage == "wedged":
            proxy.wedge(new_connections=True)
        else:
            await proxy.close()  # every connection cut, and nothing listens any more
        calls = {
            "Enqueue": stub.Enqueue(service_pb2.EnqueueRequest(task=_task())),
            "EnqueueBatch": stub.EnqueueBatch(service_pb2.EnqueueBatchRequest(tasks=[_task()])),
            "GetTask": stub.GetTask(service_pb2.GetTaskRequest(id="0" * 26)),
        }
        for name, call in calls.items():
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call
            assert time.monotonic() - started < 10, name
            assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, name
            details = failed.value.details() or ""
            assert "database unavailable" in details, (name, details)
            # Nothing of asyncpg's own text ("cannot switch to state", exception names).
            assert "state" not in details, (name, details)
            assert "Error" not in details, (name, details)
