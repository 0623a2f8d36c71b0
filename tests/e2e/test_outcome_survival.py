"""Outcomes survive the api losing its database connections: through real processes (api,
dispatcher, maintenance, an SDK worker), a real Postgres and a private nats-server.

While a worker drains ``max_retry=0`` tasks, the test terminates every Postgres
connection of the api for a few seconds. The acks that fail meanwhile must be retried
(their leases extended) until they commit: no task whose handler succeeded may be
archived as "lease expired" by the reaper, and each keeps its result.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import asyncpg
import pytest
from conveyor import AsyncClient, spec
from conveyor_broker import TaskState
from conveyor_broker.postgres import PostgresBroker
from conveyor_testkit.polling import wait_until

from tests.e2e.conftest import read_record
from tests.e2e.harness import POLL_INTERVAL, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

#: How the api's connections are told apart from everyone else's in pg_stat_activity.
API_APPLICATION = "conveyor-e2e-api"
TASKS = 3000


def _with_application(dsn: str, name: str) -> str:
    return f"{dsn}{'&' if '?' in dsn else '?'}application_name={name}"


async def _cut_api_connections(dsn: str, seconds: float) -> int:
    """Terminate every connection of the api to the test's database, again and again for
    ``seconds`` (its pool reconnects at once); how many were terminated."""
    terminated = 0
    conn = await asyncpg.connect(dsn)
    try:
        database = await conn.fetchval("SELECT current_database()")
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            terminated += await conn.fetchval(
                "SELECT count(*) FROM ("
                " SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = $1 AND application_name = $2 AND pid <> pg_backend_pid()"
                ") AS cut",
                database,
                API_APPLICATION,
            )
            await asyncio.sleep(0.02)  # the pace of the cutting, not a wait for a condition
    finally:
        await conn.close()
    return terminated


async def test_acks_that_fail_while_the_database_is_cut_off_still_commit(
    cluster: Cluster, store: PostgresBroker, migrated_dsn: str, tmp_path: Path
) -> None:
    # A lease longer than the cut, so only a lost ack (not the cut itself) could let the
    # reaper archive a task; the reaper sweeps often, so it would do so within the test.
    cluster.settings_env["CONVEYOR_LEASE_TTL"] = "8"
    cluster.settings_env["CONVEYOR_REAP_TICK"] = "0.2"
    api = await cluster.start_api(
        env={"CONVEYOR_DSN": _with_application(migrated_dsn, API_APPLICATION)}
    )
    cluster.start_dispatcher()
    cluster.start_maintenance()
    target = f"127.0.0.1:{api.port}"
    record = tmp_path / "record.txt"

    async with AsyncClient(target) as client:
        ids: list[str] = []
        for start in range(0, TASKS, 500):
            specs = [
                spec("e2e.echo", {"i": i}, queue="jobs", max_retry=0)
                for i in range(start, min(TASKS, start + 500))
            ]
            for enqueued in await client.enqueue_batch(specs):
                assert enqueued.task is not None, enqueued.error
                ids.append(enqueued.task.id)

    cluster.start_worker(target, queues={"jobs": 1}, concurrency=16, record=record, mode="work")

    def done() -> int:
        return sum(1 for f in read_record(record) if f[0] == "done")

    await wait_until(
        lambda: done() >= 200, within=60, interval=POLL_INTERVAL, message="the drain under way"
    )
    before = done()
    terminated = await _cut_api_connections(migrated_dsn, 3.5)
    assert terminated > 0
    assert done() < TASKS, "the drain ended before the cut: nothing was tested"
    assert before < TASKS

    async def terminal() -> bool:
        stats = await store.queue_stats("jobs")
        return sum(s.count(TaskState.COMPLETED) + s.count(TaskState.ARCHIVED) for s in stats) == (
            TASKS
        )

    await wait_until(terminal, within=120, interval=POLL_INTERVAL, message="every task terminal")
    # A lost ack would have left its task ACTIVE until the reaper archived it.
    states = {(await store.get_task(task_id)).state for task_id in ids}
    assert states == {TaskState.COMPLETED}
    for i, task_id in enumerate(ids):
        stored = await store.get_task(task_id)
        assert stored.result is not None
        assert json.loads(stored.result) == {"i": i}
    handled = {f[1] for f in read_record(record) if f[0] == "done"}
    assert handled == set(ids)
    # The cut did reach the outcome path: some acks failed and were retried to a commit.
    log = api.log()
    assert "gateway.ack_failed" in log
    assert "gateway.ack_committed_after_retry" in log
