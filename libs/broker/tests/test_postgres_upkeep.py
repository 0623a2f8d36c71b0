"""Storage upkeep on Postgres: ANALYZE and VACUUM of the task table after a burst.

Each test works in a schema of its own with autovacuum off for its task table, so what
the test sees is the broker's doing. Postgres publishes a table's counters (live, dead,
changed rows) up to about a second after the writes, so the tests poll ``upkeep_storage``
until it acts, with a timeout.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from conveyor_broker import AckItem, FakeClock, NewTask, StorageUpkeep
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.testing.schemas import migrated_schema

pytestmark = pytest.mark.postgres

TTL = timedelta(seconds=30)
#: Comfortably past upkeep.MIN_ROWS: each task written, leased and acked leaves two
#: dead row versions and three changes.
BURST = 1500
#: Seconds to wait for upkeep to act on counters Postgres has yet to publish.
WITHIN = 20.0


@asynccontextmanager
async def task_table(pg_dsn: str) -> AsyncIterator[tuple[str, asyncpg.Connection]]:
    """A migrated schema of its own (autovacuum off for its task table); yields a DSN
    scoped to it and an admin connection on it."""
    schema = f"conveyor_u_{uuid.uuid4().hex[:12]}"
    dsn = await migrated_schema(pg_dsn, schema)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("ALTER TABLE conveyor_tasks SET (autovacuum_enabled = false)")
        yield dsn, conn
    finally:
        await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await conn.close()


@asynccontextmanager
async def one_connection_broker(dsn: str, init: Any = None) -> AsyncIterator[PostgresBroker]:
    """A broker on a pool of exactly one connection (``init`` runs on it once), so every
    statement it prepares lives in one session (and one plan cache)."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1, init=init)
    broker = PostgresBroker(pool, FakeClock())
    try:
        yield broker
    finally:
        await broker.close()
        await pool.close()


async def burst(broker: PostgresBroker, n: int = BURST) -> None:
    """Enqueue, lease and ack ``n`` tasks."""
    for start in range(0, n, 1000):
        await broker.enqueue_batch([NewTask("hot", "t") for _ in range(min(1000, n - start))])
    while leased := await broker.lease("hot", 100, TTL):
        done = await broker.ack_batch([AckItem(t.id, t.lease_id or "") for t in leased])
        assert all(done)


async def publish_counters(broker: PostgresBroker) -> None:
    """Have the broker's session publish its table counters now: an idle session
    otherwise publishes them up to ten seconds later."""
    await broker._pool.execute("SELECT pg_stat_force_next_flush()")
    await broker._pool.execute("SELECT 1")


async def upkeep_until(
    broker: PostgresBroker, acted: Callable[[StorageUpkeep], bool]
) -> StorageUpkeep:
    """Call ``upkeep_storage`` until its report satisfies ``acted`` (within WITHIN s)."""
    async with asyncio.timeout(WITHIN):
        while True:
            report = await broker.upkeep_storage()
            if acted(report):
                return report
            await asyncio.sleep(0.1)


async def table_row(conn: asyncpg.Connection) -> Any:
    """What Postgres records about the task table: planner estimate and upkeep times."""
    return await conn.fetchrow(
        "SELECT c.reltuples, s.n_dead_tup, s.last_vacuum, s.last_analyze, s.seq_scan "
        "FROM pg_class c JOIN pg_stat_all_tables s ON s.relid = c.oid "
        "WHERE c.oid = 'conveyor_tasks'::regclass"
    )


async def test_upkeep_does_nothing_on_a_quiet_table(pg_dsn: str) -> None:
    async with task_table(pg_dsn) as (dsn, conn), one_connection_broker(dsn) as broker:
        await broker.enqueue_batch([NewTask("hot", "t") for _ in range(10)])
        report = await broker.upkeep_storage()
        assert not report.analyzed
        assert not report.vacuumed
        row = await table_row(conn)
        assert row["last_vacuum"] is None
        assert row["last_analyze"] is None


async def test_upkeep_analyzes_and_vacuums_after_a_burst_then_rests(pg_dsn: str) -> None:
    async with task_table(pg_dsn) as (dsn, conn), one_connection_broker(dsn) as broker:
        await burst(broker)
        report = await upkeep_until(broker, lambda r: r.vacuumed)
        assert report.analyzed
        assert report.dead_rows is not None
        assert report.dead_rows >= 2 * BURST - 100
        row = await table_row(conn)
        assert row["last_vacuum"] is not None
        assert row["last_analyze"] is not None
        assert row["reltuples"] >= BURST - 100  # the planner now knows the table's size
        assert row["n_dead_tup"] < 100
        # Nothing has changed since: the next check does nothing.
        again = await broker.upkeep_storage()
        assert not again.analyzed
        assert not again.vacuumed


async def test_upkeep_makes_plans_cached_on_a_tiny_table_replan(pg_dsn: str) -> None:
    """The failure upkeep exists for: a session that acked while the table was nearly
    empty caches a generic ack plan that scans the whole table. After a burst that plan
    stays in use (a sequential scan per AckBatch) until something makes the session
    re-plan; the ANALYZE of upkeep does."""
    async with task_table(pg_dsn) as (dsn, conn), one_connection_broker(dsn) as broker:
        for _ in range(8):  # past the five custom plans after which Postgres goes generic
            await burst(broker, 1)

        async def seq_scans() -> int:
            await publish_counters(broker)
            return int((await table_row(conn))["seq_scan"])

        async def seq_scans_of_one_ack() -> int:
            await broker.enqueue_batch([NewTask("hot", "t")])
            [task] = await broker.lease("hot", 1, TTL)
            before = await seq_scans()
            assert await broker.ack_batch([AckItem(task.id, task.lease_id or "")]) == [True]
            return await seq_scans() - before

        await burst(broker, 10 * BURST)
        assert await seq_scans_of_one_ack() == 1  # the stale plan, as upkeep finds it
        await upkeep_until(broker, lambda r: r.analyzed)
        assert await seq_scans_of_one_ack() == 0


async def test_upkeep_does_not_vacuum_again_what_an_open_snapshot_keeps(pg_dsn: str) -> None:
    async with task_table(pg_dsn) as (dsn, conn), one_connection_broker(dsn) as broker:
        holder = await asyncpg.connect(dsn)
        try:
            # An open snapshot keeps every row version made after it.
            await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            await holder.fetchval("SELECT count(*) FROM conveyor_tasks")
            await burst(broker)
            await upkeep_until(broker, lambda r: r.vacuumed)
            kept = (await table_row(conn))["n_dead_tup"]
            assert kept >= 2 * BURST - 100  # the vacuum could remove none of them
            report = await broker.upkeep_storage()
            assert report.dead_rows == kept
            assert not report.vacuumed
            await holder.execute("ROLLBACK")
            # New dead rows beyond the kept ones count again.
            await burst(broker)
            await upkeep_until(broker, lambda r: r.vacuumed)
            assert (await table_row(conn))["n_dead_tup"] < 100
        finally:
            await holder.close()


async def test_upkeep_leaves_alone_a_table_its_role_may_not_maintain(pg_dsn: str) -> None:
    role = f"conveyor_u_{uuid.uuid4().hex[:12]}"
    async with task_table(pg_dsn) as (dsn, conn), one_connection_broker(dsn) as owner:
        await conn.execute(f'CREATE ROLE "{role}"')
        schema = await conn.fetchval("SELECT current_schema()")
        await conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
        try:

            async def as_role(c: asyncpg.Connection) -> None:
                await c.execute(f'SET ROLE "{role}"')

            await burst(owner)
            await publish_counters(owner)
            async with one_connection_broker(dsn, init=as_role) as stranger:
                # Wait until the counters say there is work, so "nothing done" is the
                # role's doing, not counters not yet published.
                report = await upkeep_until(
                    stranger, lambda r: (r.dead_rows or 0) >= 2 * BURST - 100
                )
                assert not report.analyzed
                assert not report.vacuumed
            row = await table_row(conn)
            assert row["last_vacuum"] is None
            assert row["last_analyze"] is None
            done = await upkeep_until(owner, lambda r: r.vacuumed)
            assert done.analyzed
        finally:
            await conn.execute(f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')
