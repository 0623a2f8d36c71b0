"""conveyor_cli.testing: the embedded server applications test with."""

from __future__ import annotations

from typing import Any

import pytest
from conveyor import AsyncClient, Client, TaskContext, TaskState, Worker
from conveyor_broker.postgres import PostgresBroker, migrate
from conveyor_cli.testing import BlockingEmbeddedServer, EmbeddedServer, Unfinished

worker = Worker("127.0.0.1:1", queues=["work"], concurrency=4, grace_period=1)


@worker.task("double")
async def double(payload: dict[str, Any], ctx: TaskContext) -> int:
    return int(payload["n"]) * 2


async def test_the_application_worker_runs_against_the_embedded_server() -> None:
    async with EmbeddedServer() as server, server.running(worker) as running:
        assert running is not worker
        assert running.target == server.target
        async with AsyncClient(server.target) as client:
            tasks = [await client.enqueue("double", {"n": n}, queue="work") for n in range(20)]
        await server.drain()
        results = [(await server.wait_for(task.id)).result for task in tasks]
    assert results == [n * 2 for n in range(20)]


async def test_waits_that_run_out_say_what_is_left() -> None:
    async with EmbeddedServer() as server:
        async with AsyncClient(server.target) as client:
            task = await client.enqueue("double", {"n": 1}, queue="idle")
        with pytest.raises(Unfinished, match=f"task {task.id} is still pending after 0.2 s"):
            await server.wait_for(task.id, timeout=0.2)
        with pytest.raises(
            Unfinished, match=r"not drained after 0.2 s: \{'idle': \{'pending': 1\}\}"
        ):
            await server.drain(timeout=0.2)
        # A queue nobody asked about does not hold the drain up.
        await server.drain(queues=["work"], timeout=1)
        pending = await server.wait_for(task.id, states=[TaskState.PENDING])
        assert pending.state is TaskState.PENDING


async def test_a_stopped_server_says_so() -> None:
    server = EmbeddedServer()
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.target
    await server.start()
    with pytest.raises(RuntimeError, match="already running"):
        await server.start()
    await server.stop()
    await server.stop()  # idempotent
    with pytest.raises(RuntimeError, match="not running"):
        await server.drain()


@pytest.mark.postgres
async def test_the_embedded_server_can_keep_its_tasks_in_postgres(pg_dsn: str) -> None:
    await migrate(pg_dsn)
    async with EmbeddedServer(dsn=pg_dsn) as server, server.running(worker):
        async with AsyncClient(server.target) as client:
            task = await client.enqueue("double", {"n": 21}, queue="work")
        assert (await server.wait_for(task.id)).result == 42
    store = await PostgresBroker.connect(pg_dsn)
    try:
        assert (await store.get_task(task.id)).result == b"42"
    finally:
        await store.close()


def test_the_blocking_server_serves_blocking_clients() -> None:
    with BlockingEmbeddedServer() as server:
        with server.running(worker, concurrency=1), Client(server.target) as client:
            task = client.enqueue("double", {"n": 5}, queue="work")
            assert server.wait_for(task.id).result == 10
        server.drain()
    with pytest.raises(RuntimeError, match="not running"):
        server.drain()


def test_a_refused_worker_fails_the_block_with_the_reason() -> None:
    with BlockingEmbeddedServer() as server:
        bad = Worker("127.0.0.1:1", queues=["work"], min_server_version="999.0.0")
        with pytest.raises(Exception, match=r"999\.0\.0"), server.running(bad):
            pass
