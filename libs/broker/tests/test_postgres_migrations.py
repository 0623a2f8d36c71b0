"""Postgres migrations: they produce the declared schema, apply once (also when run
concurrently), honour a target, and what migrations 003 (purge_at), 004 and 005
(dependency resolution) and 011 (webhook batch types) changed.

Each test works in a database or schema of its own, so none depends on another's rows.
"""

from __future__ import annotations

import asyncio
import re
from datetime import timedelta
from importlib import resources

import asyncpg
import pytest
from conveyor_broker import (
    AckItem,
    FakeClock,
    NewTask,
    TaskNotFound,
    TaskState,
    TerminalPurgeParams,
    WebhookWorkerSpec,
)
from conveyor_broker.postgres import PostgresBroker, latest_version, migrate, migration_status
from conveyor_broker.postgres.migrations import declared_schema, load_migrations
from conveyor_broker.postgres.queries.enqueue import ENQUEUE
from conveyor_broker.postgres.rows import enqueue_params, new_task
from conveyor_broker.testing.schemas import (
    CATALOG_PARTS,
    brokers,
    catalog,
    scratch_database,
    scratch_schema,
)

pytestmark = pytest.mark.postgres

TTL = timedelta(seconds=30)


async def test_migrations_produce_the_declared_schema(pg_dsn: str) -> None:
    async with scratch_database(pg_dsn) as migrated, scratch_database(pg_dsn) as declared:
        assert await migrate(migrated) == [m.version for m in load_migrations()]
        conn = await asyncpg.connect(declared)
        try:
            await conn.execute(declared_schema())
        finally:
            await conn.close()
        from_migrations, from_schema = await catalog(migrated), await catalog(declared)
    assert from_migrations["tables"], "nothing was created"
    for part in CATALOG_PARTS:
        assert from_migrations[part] == from_schema[part], f"{part} differ"


async def test_migrate_is_idempotent_and_records_versions(pg_dsn: str) -> None:
    async with scratch_database(pg_dsn) as dsn:
        before = await migration_status(dsn)
        assert [s.version for s in before] == [m.version for m in load_migrations()]
        assert not any(s.applied for s in before)

        applied = await migrate(dsn)
        assert applied == [m.version for m in load_migrations()]
        assert applied[-1] == latest_version()
        assert await migrate(dsn) == []

        after = await migration_status(dsn)
        assert all(s.applied for s in after)
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch("SELECT version, name FROM conveyor_migrations ORDER BY 1")
            # A connection is accepted as well as a DSN, and is left open.
            assert await migrate(conn) == []
            assert not conn.is_closed()
        finally:
            await conn.close()
        assert [(r["version"], r["name"]) for r in rows] == [
            (m.version, m.name) for m in load_migrations()
        ]
        broker = await PostgresBroker.connect(dsn, FakeClock())
        try:
            assert (await broker.info()).schema_version == latest_version()
        finally:
            await broker.close()


async def test_concurrent_migrators_apply_each_migration_once(pg_dsn: str) -> None:
    async with scratch_database(pg_dsn) as dsn:
        results = await asyncio.gather(*(migrate(dsn) for _ in range(4)))
        applied = sorted(v for result in results for v in result)
        assert applied == [m.version for m in load_migrations()]


async def test_migrate_honours_target_and_rejects_unknown_versions(pg_dsn: str) -> None:
    async with scratch_database(pg_dsn) as dsn:
        with pytest.raises(ValueError, match="unknown migration"):
            await migrate(dsn, target=999)
        assert not any(s.applied for s in await migration_status(dsn))
        first = load_migrations()[0].version
        assert await migrate(dsn, target=first) == [first]
        assert await migrate(dsn, target=first) == []


def test_migrations_are_numbered_files_shipped_with_the_package() -> None:
    folder = resources.files("conveyor_broker.postgres.migrations")
    names = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".sql"))
    assert names, "no migrations shipped"
    assert all(re.fullmatch(r"\d{3}_[a-z0-9_]+\.sql", name) for name in names)
    versions = [int(name[:3]) for name in names]
    # Unique and ascending from 001. Numbers are reserved per feature while features are
    # built side by side, so a number may be missing until its feature lands: the runner
    # applies what is there in order and records each version.
    assert versions[0] == 1
    assert len(set(versions)) == len(versions)


async def test_migration_003_backfills_purge_at_of_completed_tasks(pg_dsn: str) -> None:
    """Rows completed before 003 get their purge_at, so they still go after their own
    retention, and the others after the sweep's retentions."""
    clock = FakeClock()
    start = clock.now()
    specs = {
        "01J0000000000000000000OWN1": (timedelta(hours=1), "completed"),
        "01J0000000000000000000DEF1": (None, "completed"),
        "01J0000000000000000000ARC1": (timedelta(0), "archived"),
        "01J0000000000000000000PEN1": (timedelta(0), "pending"),
    }
    async with scratch_database(pg_dsn) as dsn:
        assert await migrate(dsn, target=2) == [1, 2]
        conn = await asyncpg.connect(dsn)
        try:
            tasks = [
                new_task(
                    NewTask("q", "t", retention=retention),
                    task_id=task_id,
                    state=TaskState.PENDING,
                    now=start,
                    max_retry=3,
                )
                for task_id, (retention, _) in specs.items()
            ]
            await conn.fetch(ENQUEUE, *enqueue_params(tasks, start))
            for task_id, (_, state) in specs.items():
                if state != "pending":
                    await conn.execute(
                        "UPDATE conveyor_tasks SET state = $2, completed_at = $3 WHERE id = $1",
                        task_id,
                        state,
                        start,
                    )
            assert await migrate(dsn, target=3) == [3]
            rows = await conn.fetch("SELECT id, purge_at FROM conveyor_tasks")
        finally:
            await conn.close()
        assert {row["id"]: row["purge_at"] for row in rows} == {
            "01J0000000000000000000OWN1": start + timedelta(hours=1),
            "01J0000000000000000000DEF1": None,
            "01J0000000000000000000ARC1": None,
            "01J0000000000000000000PEN1": None,
        }
        await migrate(dsn)  # the rest, which today's broker needs
        broker = await PostgresBroker.connect(dsn, clock)
        try:

            async def purge() -> int:
                two_hours = timedelta(hours=2)
                return await broker.purge_terminal(
                    TerminalPurgeParams(archive_retention=two_hours, default_retention=two_hours)
                )

            clock.advance(timedelta(minutes=59))
            assert await purge() == 0
            clock.advance(timedelta(minutes=1))
            assert await purge() == 1
            clock.advance(timedelta(hours=1))
            assert await purge() == 2
            left = await broker.list_tasks()
            assert [t.id for t in left.tasks] == ["01J0000000000000000000PEN1"]
        finally:
            await broker.close()


async def test_completing_a_task_sets_purge_at(pg_dsn: str) -> None:
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 1) as [broker]:
        retentions = [timedelta(hours=1), timedelta(minutes=30), None]
        await broker.enqueue_batch([NewTask("q", "t", retention=r) for r in retentions])
        leased = await broker.lease("q", 3, TTL)
        [by_ack] = [t for t in leased if t.retention == timedelta(hours=1)]
        by_batch = [t for t in leased if t is not by_ack]
        clock.advance(timedelta(seconds=5))
        await broker.ack(by_ack.id, by_ack.lease_id or "")
        await broker.ack_batch([AckItem(t.id, t.lease_id or "") for t in by_batch])
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch("SELECT id, purge_at FROM conveyor_tasks")
            now = clock.now()
            assert {row["id"]: row["purge_at"] for row in rows} == {
                t.id: None if t.retention is None else now + t.retention for t in leased
            }
            assert sum(row["purge_at"] is not None for row in rows) == 2
        finally:
            await conn.close()


async def test_a_row_completed_by_a_release_before_003_goes_by_its_own_retention(
    pg_dsn: str,
) -> None:
    """During a rolling upgrade the previous release completes tasks without purge_at: such
    a row is purged by its own retention (at the default at the earliest), not kept."""
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 1) as [broker]:
        await broker.enqueue_batch(
            [NewTask("q", "t", retention=timedelta(hours=3)), NewTask("q", "t")]
        )
        leased = await broker.lease("q", 2, TTL)
        await broker.ack_batch([AckItem(t.id, t.lease_id or "") for t in leased])
        [old_release] = [t for t in leased if t.retention is not None]
        conn = await asyncpg.connect(dsn)
        try:  # what an older release's ack leaves behind
            await conn.execute(
                "UPDATE conveyor_tasks SET purge_at = NULL WHERE id = $1", old_release.id
            )
        finally:
            await conn.close()
        default, archive = timedelta(hours=1), timedelta(days=7)
        clock.advance(timedelta(hours=2))  # past the default, not past its own 3 h
        assert (
            await broker.purge_terminal(
                TerminalPurgeParams(archive_retention=archive, default_retention=default)
            )
            == 1
        )  # the one on the default
        assert (await broker.get_task(old_release.id)).id == old_release.id
        clock.advance(timedelta(hours=1, seconds=1))
        assert (
            await broker.purge_terminal(
                TerminalPurgeParams(archive_retention=archive, default_retention=default)
            )
            == 1
        )
        with pytest.raises(TaskNotFound):
            await broker.get_task(old_release.id)


async def test_migration_005_makes_edges_stored_before_it_resolvable(pg_dsn: str) -> None:
    """Edges stored before 005 were never resolved: they come out open (counted on their
    waiting task, flagged on their dependency), an edge to a task no longer stored comes
    out failed, and the sweep then resolves what has ended."""
    clock = FakeClock()
    start = clock.now()
    done, running, gone = (
        "01J00000000000000000000DN1",
        "01J00000000000000000000RN1",
        "01J00000000000000000000GN1",
    )
    waits, orphan = "01J00000000000000000000WT1", "01J00000000000000000000XR1"
    async with scratch_database(pg_dsn) as dsn:
        assert await migrate(dsn, target=3) == [1, 2, 3]
        conn = await asyncpg.connect(dsn)
        try:
            rows = [
                new_task(
                    NewTask("q", "t"), task_id=done, state=TaskState.PENDING, now=start, max_retry=3
                ),
                new_task(
                    NewTask("q", "t"),
                    task_id=running,
                    state=TaskState.PENDING,
                    now=start,
                    max_retry=3,
                ),
                new_task(
                    NewTask("w", "t", depends_on=(done, running)),
                    task_id=waits,
                    state=TaskState.BLOCKED,
                    now=start,
                    max_retry=3,
                ),
                new_task(
                    NewTask("w", "t", depends_on=(gone,)),
                    task_id=orphan,
                    state=TaskState.BLOCKED,
                    now=start,
                    max_retry=3,
                ),
            ]
            await conn.fetch(ENQUEUE, *enqueue_params(rows, start))
            await conn.execute(
                "UPDATE conveyor_tasks SET state = 'completed', completed_at = $2 WHERE id = $1",
                done,
                start,
            )
            await conn.execute(
                "INSERT INTO conveyor_task_dependencies (task_id, depends_on) "
                "SELECT * FROM unnest($1::text[], $2::text[])",
                [waits, waits, orphan],
                [done, running, gone],
            )
            assert await migrate(dsn) == list(range(4, latest_version() + 1))
            tasks = {
                row["id"]: tuple(row[1:])
                for row in await conn.fetch(
                    "SELECT id, deps_open, deps_failed, dependents_pending FROM conveyor_tasks"
                )
            }
            edges = {
                (row["task_id"], row["depends_on"]): row["outcome"]
                for row in await conn.fetch("SELECT * FROM conveyor_task_dependencies")
            }
        finally:
            await conn.close()
        assert tasks == {
            done: (0, 0, True),
            running: (0, 0, True),
            waits: (2, 0, False),
            orphan: (0, 1, False),
        }
        assert edges == {(waits, done): None, (waits, running): None, (orphan, gone): "failed"}
        broker = await PostgresBroker.connect(dsn, clock)
        try:
            assert (await broker.promote_ready_dependents()).edges == 1
            assert (await broker.get_task(waits)).state == TaskState.BLOCKED
            [leased] = await broker.lease("q", 1, TTL)
            assert leased.id == running
            await broker.ack(leased.id, leased.lease_id or "")
            assert (await broker.resolve_dependents([running])).promoted == {"w": 1}
            assert (await broker.get_task(waits)).state == TaskState.PENDING
            assert (await broker.get_task(orphan)).state == TaskState.BLOCKED
        finally:
            await broker.close()


async def test_migration_011_gives_stored_webhook_workers_no_batch_types(pg_dsn: str) -> None:
    """A registration stored before 011 reads back unchanged, with no batch types, and an
    upsert after it stores some."""
    clock = FakeClock()
    async with scratch_database(pg_dsn) as dsn:
        assert await migrate(dsn, target=10) == list(range(1, 11))
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                "INSERT INTO conveyor_webhook_workers (name, url, queues, concurrency, timeout,"
                " secrets, created_at, updated_at) VALUES ('old', 'https://a.example.com/',"
                """ '{"q": 2}', 4, interval '5 seconds', '{s1}', $1, $1)""",
                clock.now(),
            )
            assert await migrate(dsn) == list(range(11, latest_version() + 1))
        finally:
            await conn.close()
        broker = await PostgresBroker.connect(dsn, clock)
        try:
            old = await broker.get_webhook_worker("old")
            assert old.batch_types == ()
            assert (old.concurrency, old.secrets, dict(old.queues)) == (4, ("s1",), {"q": 2})
            spec = WebhookWorkerSpec(
                "old", old.url, old.queues, batch_types=("digest.send", "report.build")
            )
            stored = await broker.upsert_webhook_worker(spec)
            assert stored.batch_types == ("digest.send", "report.build")
            assert (await broker.get_webhook_worker("old")).batch_types == stored.batch_types
        finally:
            await broker.close()
