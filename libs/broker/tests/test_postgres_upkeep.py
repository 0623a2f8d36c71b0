"""Storage upkeep on Postgres: ANALYZE and VACUUM of the task table after a burst.

Each test works in a schema of its own with autovacuum off for its task table, so what
the test sees is the broker's doing. The broker's sessions publish their table counters
(live, dead, changed rows) on demand here (:func:`publish_counters`), and the tests still
poll ``upkeep_storage`` until it acts, with a timeout. Upkeep's pacing (its least interval
and its backoff) runs on the broker's clock, a FakeClock the tests move.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from conveyor_broker import AckItem, FakeClock, NewTask, StorageUpkeep
from conveyor_broker.postgres import PostgresBroker, upkeep
from conveyor_broker.postgres.migrations import MIGRATION_LOCK_KEY
from conveyor_broker.testing.schemas import migrated_schema
from conveyor_testkit.polling import wait_until

pytestmark = pytest.mark.postgres

TTL = timedelta(seconds=30)
#: Comfortably past upkeep.MIN_ROWS: each task written, leased and acked leaves two
#: dead row versions and three changes.
BURST = 1500
#: Seconds to wait for upkeep to act.
WITHIN = 20.0


@dataclass
class Table:
    """A migrated schema of its own: a DSN scoped to it, an admin connection on it, and
    the clock of the brokers the test opens on it."""

    dsn: str
    conn: asyncpg.Connection
    clock: FakeClock

    async def row(self) -> Any:
        """What Postgres records about the task table."""
        return await self.conn.fetchrow(
            "SELECT c.reltuples, s.n_dead_tup, s.last_vacuum, s.last_analyze, s.seq_scan "
            "FROM pg_class c JOIN pg_stat_all_tables s ON s.relid = c.oid "
            "WHERE c.oid = 'conveyor_tasks'::regclass"
        )

    @asynccontextmanager
    async def broker(
        self, init: Any = None, settings: dict[str, str] | None = None
    ) -> AsyncIterator[PostgresBroker]:
        """A broker on a pool of exactly one connection (``init`` runs on it once; its
        session starts with ``settings``), so every statement it prepares lives in one
        session (and one plan cache)."""
        pool = await asyncpg.create_pool(
            self.dsn, min_size=1, max_size=1, init=init, server_settings=settings
        )
        broker = PostgresBroker(pool, self.clock)
        try:
            yield broker
        finally:
            await broker.close()
            await pool.close()


@asynccontextmanager
async def task_table(pg_dsn: str) -> AsyncIterator[Table]:
    schema = f"conveyor_u_{uuid.uuid4().hex[:12]}"
    dsn = await migrated_schema(pg_dsn, schema)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("ALTER TABLE conveyor_tasks SET (autovacuum_enabled = false)")
        yield Table(dsn, conn, FakeClock())
    finally:
        await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await conn.close()


async def burst(broker: PostgresBroker, n: int = BURST) -> None:
    """Enqueue, lease and ack ``n`` tasks, then publish the session's counters."""
    for start in range(0, n, 1000):
        await broker.enqueue_batch([NewTask("hot", "t") for _ in range(min(1000, n - start))])
    while leased := await broker.lease("hot", 100, TTL):
        done = await broker.ack_batch([AckItem(t.id, t.lease_id or "") for t in leased])
        assert all(done)
    await publish_counters(broker)


async def publish_counters(broker: PostgresBroker) -> None:
    """Have the broker's session publish its table counters now: an idle session
    otherwise publishes them up to ten seconds later."""
    await broker._pool.execute("SELECT pg_stat_force_next_flush()")
    await broker._pool.execute("SELECT 1")


async def upkeep_until(
    broker: PostgresBroker, acted: Callable[[StorageUpkeep], bool]
) -> StorageUpkeep:
    """Call ``upkeep_storage`` until its report satisfies ``acted`` (within WITHIN s);
    return that report."""
    last: list[StorageUpkeep] = []

    async def upkeep_acted() -> bool:
        last[:] = [await broker.upkeep_storage()]
        return acted(last[0])

    await wait_until(
        upkeep_acted, within=WITHIN, interval=0.1, message="an upkeep report that acted"
    )
    return last[0]


def vacuumed(report: StorageUpkeep) -> bool:
    return report.vacuumed


def did_nothing(report: StorageUpkeep) -> bool:
    return not (report.analyzed or report.vacuumed)


async def test_upkeep_does_nothing_on_a_quiet_table(pg_dsn: str) -> None:
    async with task_table(pg_dsn) as table, table.broker() as broker:
        await broker.enqueue_batch([NewTask("hot", "t") for _ in range(10)])
        await publish_counters(broker)
        assert did_nothing(await broker.upkeep_storage())
        row = await table.row()
        assert row["last_vacuum"] is None
        assert row["last_analyze"] is None


async def test_upkeep_analyzes_and_vacuums_after_a_burst_then_rests(pg_dsn: str) -> None:
    async with task_table(pg_dsn) as table, table.broker() as broker:
        await burst(broker)
        report = await upkeep_until(broker, vacuumed)
        assert report.analyzed
        assert report.dead_rows is not None
        assert report.dead_rows >= 2 * BURST - 100
        row = await table.row()
        assert row["last_vacuum"] is not None
        assert row["last_analyze"] is not None
        assert row["reltuples"] >= BURST - 100  # the planner now knows the table's size
        assert row["n_dead_tup"] < 100
        # Nothing has changed since: once the least interval is over, the check reads
        # the counters and does nothing.
        table.clock.advance(upkeep.MIN_INTERVAL)
        again = await broker.upkeep_storage()
        assert again.dead_rows is not None
        assert did_nothing(again)


async def test_upkeep_rests_for_its_least_interval_after_acting(pg_dsn: str) -> None:
    async with task_table(pg_dsn) as table, table.broker() as broker:
        await burst(broker)
        await upkeep_until(broker, vacuumed)
        await burst(broker)
        assert await broker.upkeep_storage() == StorageUpkeep()  # not even a look
        table.clock.advance(upkeep.MIN_INTERVAL)
        assert (await upkeep_until(broker, vacuumed)).analyzed


async def test_upkeep_makes_plans_cached_on_a_tiny_table_replan(pg_dsn: str) -> None:
    """The failure upkeep exists for: a session that acked while the table was nearly
    empty caches a generic ack plan that scans the whole table. After a burst that plan
    stays in use (a sequential scan per AckBatch) until something makes the session
    re-plan; the ANALYZE of upkeep does."""
    async with task_table(pg_dsn) as table, table.broker() as broker:
        for _ in range(8):  # past the five custom plans after which Postgres goes generic
            await burst(broker, 1)

        async def seq_scans() -> int:
            await publish_counters(broker)
            return int((await table.row())["seq_scan"])

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
    async with task_table(pg_dsn) as table, table.broker() as broker:
        holder = await asyncpg.connect(table.dsn)
        try:
            # An open snapshot keeps every row version made after it.
            await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            await holder.fetchval("SELECT count(*) FROM conveyor_tasks")
            await burst(broker)
            await upkeep_until(broker, vacuumed)
            kept = (await table.row())["n_dead_tup"]
            assert kept >= 2 * BURST - 100  # the vacuum could remove none of them
            table.clock.advance(upkeep.MIN_INTERVAL)
            report = await broker.upkeep_storage()
            assert report.dead_rows == kept
            assert not report.vacuumed
            await holder.execute("ROLLBACK")
            # New dead rows beyond the kept ones count again.
            await burst(broker)
            await upkeep_until(broker, vacuumed)
            assert (await table.row())["n_dead_tup"] < 100
        finally:
            await holder.close()


async def test_a_vacuum_that_could_not_take_the_table_is_not_counted(pg_dsn: str) -> None:
    """SKIP_LOCKED skips a table someone else is vacuuming (autovacuum, say): that run
    did nothing, so the next check tries again."""
    async with task_table(pg_dsn) as table, table.broker() as broker:
        holder = await asyncpg.connect(table.dsn)
        try:
            await holder.execute("BEGIN")
            await holder.execute("LOCK TABLE conveyor_tasks IN SHARE UPDATE EXCLUSIVE MODE")
            await burst(broker)
            report = await upkeep_until(broker, lambda r: (r.dead_rows or 0) >= BURST)
            assert did_nothing(report)
            assert (await table.row())["last_vacuum"] is None
            await holder.execute("COMMIT")
            done = await upkeep_until(broker, vacuumed)
            assert done.analyzed
        finally:
            await holder.close()


async def test_upkeep_waits_for_a_running_migration(pg_dsn: str) -> None:
    """A manual VACUUM would hold up a migration's DDL, and every write queued behind
    it: upkeep skips its turn while the migration lock is held."""
    async with task_table(pg_dsn) as table, table.broker() as broker:
        await burst(broker)
        await table.conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        try:
            for _ in range(3):
                assert did_nothing(await broker.upkeep_storage())
            assert (await table.row())["last_vacuum"] is None
        finally:
            await table.conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
        await upkeep_until(broker, vacuumed)
        # ... and gives the lock back: a migrator can take it at once.
        assert await table.conn.fetchval("SELECT pg_try_advisory_lock($1)", MIGRATION_LOCK_KEY)
        await table.conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)


async def test_upkeep_runs_clear_of_the_sessions_statement_timeout(pg_dsn: str) -> None:
    """A statement timeout (common on managed Postgres) would cancel the VACUUM every
    time; upkeep lifts it for its own statement and puts it back."""
    async with task_table(pg_dsn) as table, table.broker() as writer:
        await burst(writer, 20 * BURST)

        async with table.broker(settings={"statement_timeout": "5ms"}) as broker:
            # The VACUUM ANALYZE of this table takes longer than that.
            with pytest.raises(asyncpg.QueryCanceledError):
                await broker._pool.execute(upkeep.VACUUM_ANALYZE)
            report = await upkeep_until(broker, vacuumed)
            assert report.analyzed
            assert await broker._pool.fetchval("SHOW statement_timeout") == "5ms"


async def test_a_failing_upkeep_backs_off(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async with task_table(pg_dsn) as table, table.broker() as broker:
        broken = "VACUUM (ANALYZE, SKIP_LOCKED) conveyor_no_such_table"
        monkeypatch.setattr(upkeep, "VACUUM_ANALYZE", broken)
        await burst(broker)
        first = await upkeep_until(broker, lambda r: r.dead_rows is not None)
        assert did_nothing(first)
        # Failed once: nothing for MIN_INTERVAL, then one more try, which fails too ...
        assert await broker.upkeep_storage() == StorageUpkeep()
        table.clock.advance(upkeep.MIN_INTERVAL)
        assert (await broker.upkeep_storage()).dead_rows is not None
        # ... so the next wait is twice as long.
        table.clock.advance(upkeep.MIN_INTERVAL)
        assert await broker.upkeep_storage() == StorageUpkeep()
        monkeypatch.undo()
        table.clock.advance(upkeep.MIN_INTERVAL)
        assert (await upkeep_until(broker, vacuumed)).analyzed
    assert upkeep.backoff(1) == upkeep.MIN_INTERVAL
    assert upkeep.backoff(3) == 4 * upkeep.MIN_INTERVAL
    assert upkeep.backoff(100) == upkeep.MAX_BACKOFF


async def test_upkeep_leaves_alone_a_table_its_role_may_not_maintain(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    role = f"conveyor_u_{uuid.uuid4().hex[:12]}"
    async with task_table(pg_dsn) as table, table.broker() as owner:
        await table.conn.execute(f'CREATE ROLE "{role}"')
        schema = await table.conn.fetchval("SELECT current_schema()")
        await table.conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
        try:

            async def as_role(c: asyncpg.Connection) -> None:
                await c.execute(f'SET ROLE "{role}"')

            await burst(owner)
            async with table.broker(init=as_role) as stranger:
                # Counters that call for work, and nothing done: the role's doing.
                for _ in range(2):
                    report = await upkeep_until(
                        stranger, lambda r: (r.dead_rows or 0) >= 2 * BURST - 100
                    )
                    assert did_nothing(report)
            row = await table.row()
            assert row["last_vacuum"] is None
            assert row["last_analyze"] is None
            refusals = [r for r in caplog.records if "not_permitted" in r.getMessage()]
            assert len(refusals) == 1  # said once, not every check
            done = await upkeep_until(owner, vacuumed)
            assert done.analyzed
        finally:
            await table.conn.execute(f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')
