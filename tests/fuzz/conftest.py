"""Fixtures of the fuzz suite: one :class:`~tests.fuzz.stack.Stack` of real service
processes for the whole package, and the checks every fuzz test ends with."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import grpc
import pytest
from conveyor import AsyncAdminClient, AsyncClient, TaskState
from conveyor_broker.postgres import migrate
from conveyor_runtime.embedded_nats import EmbeddedNats, free_port

from tests.e2e.harness import POLL_INTERVAL, Cluster, port_open
from tests.fuzz.profile import EXAMPLES
from tests.fuzz.stack import RawEndpoint, Stack, new_name, poll

ADMIN_DSN = os.environ.get("CONVEYOR_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
#: The webhook registration's secret (at least 32 bytes).
SECRET = "fuzz-secret-0123456789abcdefghijklmnop"
#: Settings of every service: registrations picked up at once, and a circuit breaker that
#: never opens (the endpoint fails on purpose, often, and must keep getting deliveries).
SETTINGS = {
    "CONVEYOR_RECONCILE_TICK": "0.2",
    "CONVEYOR_BREAKER_THRESHOLD": "1000000",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A longer run (CONVEYOR_FUZZ_EXAMPLES) gets a longer timeout per test."""
    scale = max(1.0, EXAMPLES / 25)
    for item in items:
        if item.get_closest_marker("fuzz") is not None:
            item.add_marker(pytest.mark.timeout(300 * scale))


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(scope="package")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """The services, the canary, the snapshot and the webhook registration (see
    :mod:`tests.fuzz.stack`)."""
    database = f"conveyor_fuzz_{uuid.uuid4().hex[:12]}"
    await _admin(f'CREATE DATABASE "{database}"')
    dsn = f"{ADMIN_DSN.rpartition('/')[0]}/{database}"
    nats = EmbeddedNats()
    nats.start()
    workdir = tmp_path_factory.mktemp("fuzz")
    cluster = Cluster(dsn=dsn, nats_url=nats.url, workdir=workdir, settings_env=dict(SETTINGS))
    endpoint = await RawEndpoint().start()
    try:
        await migrate(dsn)
        port = free_port()
        target = f"127.0.0.1:{port}"
        api = cluster.spawn(
            "api",
            ["-m", "conveyor_api"],
            {"CONVEYOR_HOST": "127.0.0.1", "CONVEYOR_PORT": str(port)},
        )
        api.port = port
        cluster.start_dispatcher()
        cluster.start_maintenance()
        cluster.start_webhook({"CONVEYOR_CALLBACK_ADDRESS": target})
        canary = new_name("canary")
        cluster.start_worker(
            target, queues={canary: 1}, concurrency=4, record=workdir / "canary.txt"
        )
        await poll(lambda: _up(api.port, api.alive()), "the api to listen", within=60)
        assert api.alive(), api.log()
        db = await asyncpg.connect(dsn)
        channel = grpc.aio.insecure_channel(target)
        async with AsyncClient(target) as client, AsyncAdminClient(target) as admin:
            stack = Stack(
                cluster=cluster,
                target=target,
                dsn=dsn,
                canary_queue=canary,
                snapshot_queue=new_name("snapshot"),
                webhook_name=new_name("hook"),
                webhook_queue=new_name("hooked"),
                endpoint=endpoint,
                channel=channel,
                client=client,
                admin=admin,
                db=db,
            )
            await _store_snapshot(stack)
            await stack.round_trip(within=60)
            await _webhook_round_trip(stack, within=60)
            stack.baseline = await stack.snapshot()
            try:
                yield stack
            finally:
                await channel.close()
                await db.close()
    finally:
        await endpoint.stop()
        stop_all(cluster)
        nats.stop()
        await _admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def stop_all(cluster: Cluster) -> None:
    """SIGTERM every process at once, then wait for each (SIGKILL past 10 s)."""
    for proc in cluster.procs:
        if proc.alive() and proc.popen is not None:
            proc.popen.terminate()
    for proc in cluster.procs:
        proc.terminate(timeout=10)


async def _up(port: int | None, alive: bool) -> bool:
    return not alive or (port is not None and port_open(port))


async def _store_snapshot(stack: Stack) -> None:
    """Tasks in several states on a paused queue, and the webhook registration."""
    queue, client, admin = stack.snapshot_queue, stack.client, stack.admin
    await admin.pause_queue(queue)
    later = datetime(2100, 1, 1, tzinfo=UTC)
    for n in range(3):
        await client.enqueue("snap.pending", {"n": n}, queue=queue, headers={"h": str(n)})
    for n in range(2):
        await client.enqueue("snap.scheduled", {"n": n}, queue=queue, process_at=later)
    canceled = await client.enqueue("snap.canceled", None, queue=queue, process_at=later)
    await admin.cancel_task(canceled.id)
    await admin.upsert_webhook_worker(
        stack.webhook_name,
        stack.endpoint.url,
        {stack.webhook_queue: 1},
        concurrency=4,
        timeout=5.0,
        secrets=[SECRET],
    )


async def _webhook_round_trip(stack: Stack, within: float = 30.0) -> None:
    """A task on the webhook registration's queue is delivered and completed."""
    task = await stack.client.enqueue("fuzz.hook", {}, queue=stack.webhook_queue)

    async def completed() -> bool:
        return (await stack.client.get_task(task.id)).state is TaskState.COMPLETED

    await poll(completed, "the webhook round trip", within=within)


@pytest.fixture(autouse=True)
async def invariants(stack: Stack) -> AsyncIterator[None]:
    """After each test: every process alive, and no unhandled error in any log."""
    since = stack.log_sizes()
    yield
    problems = stack.dead() + stack.new_log_problems(since)
    assert not problems, "\n\n".join(problems)


@pytest.fixture(scope="module", autouse=True)
async def stored_and_served(stack: Stack) -> AsyncIterator[None]:
    """After each module: the snapshot byte for byte as it was, and well-behaved clients
    (an SDK worker, a webhook endpoint) still served."""
    yield
    assert await stack.snapshot() == stack.baseline, "stored rows no fuzzed call names changed"
    await stack.round_trip()
    await _webhook_round_trip(stack)


__all__ = ["POLL_INTERVAL", "SECRET"]
