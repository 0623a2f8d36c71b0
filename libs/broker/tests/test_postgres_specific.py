"""What only the Postgres broker has: migrations, real concurrency, the unique index, plans.

Each test works in a database or schema of its own, so none depends on another's rows.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any

import asyncpg
import pytest
from conveyor_broker import (
    AckItem,
    DuplicateTask,
    FakeClock,
    LeaseRef,
    NewTask,
    TaskNotFound,
    TaskState,
    WebhookWorkerSpec,
)
from conveyor_broker.postgres import (
    PostgresBroker,
    latest_version,
    migrate,
    migration_status,
    queries,
)
from conveyor_broker.postgres.migrations import declared_schema, load_migrations
from conveyor_broker.postgres.rows import enqueue_params, new_task
from conveyor_testkit.polling import wait_until

pytestmark = pytest.mark.postgres

TTL = timedelta(seconds=30)


def _database_dsn(dsn: str, database: str) -> str:
    base, _, _ = dsn.rpartition("/")
    return f"{base}/{database}"


@asynccontextmanager
async def scratch_database(pg_dsn: str) -> AsyncIterator[str]:
    """A fresh, empty database for one test, dropped afterwards."""
    name = f"conveyor_s_{uuid.uuid4().hex[:12]}"
    # Any database of the server can create and drop others: use the session's.
    admin = await asyncpg.connect(pg_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield _database_dsn(pg_dsn, name)
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@asynccontextmanager
async def scratch_schema(pg_dsn: str) -> AsyncIterator[str]:
    """A fresh, migrated schema in the session database; yields a DSN whose search_path
    points at it."""
    name = f"conveyor_s_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_dsn)
    try:
        await admin.execute(f"CREATE SCHEMA {name}")
        dsn = f"{pg_dsn}?search_path={name}"
        await migrate(dsn)
        try:
            yield dsn
        finally:
            await admin.execute(f"DROP SCHEMA {name} CASCADE")
    finally:
        await admin.close()


# ------------------------------------------------------------------------- migrations

# The catalog of the public schema, every part as sorted rows, so that two databases
# can be compared with ==.
_CATALOG_QUERIES = {
    "tables": """
        SELECT c.relname, c.relkind::text FROM pg_class c
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
        ORDER BY 1""",
    "columns": """
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), co.collname, a.attnum
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        LEFT JOIN pg_collation co ON co.oid = a.attcollation
        WHERE n.nspname = 'public' AND c.relkind = 'r' AND a.attnum > 0
          AND NOT a.attisdropped
        ORDER BY 1, 7""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'public' ORDER BY 1, 2""",
    "constraints": """
        SELECT c.relname, k.conname, k.contype::text, pg_get_constraintdef(k.oid)
        FROM pg_constraint k
        JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' ORDER BY 1, 2""",
    "types": """
        SELECT t.typname, t.typtype::text FROM pg_type t
        JOIN pg_namespace n ON n.oid = t.typnamespace
        WHERE n.nspname = 'public' AND t.typtype IN ('e', 'd', 'c')
          AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.reltype = t.oid)
        ORDER BY 1""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid) FROM pg_proc p
        JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'public' ORDER BY 1, 2""",
}


async def catalog(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    conn = await asyncpg.connect(dsn)
    try:
        return {
            part: [tuple(row) for row in await conn.fetch(query)]
            for part, query in _CATALOG_QUERIES.items()
        }
    finally:
        await conn.close()


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
    for part in _CATALOG_QUERIES:
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
    folder = resources.files("conveyor_broker.postgres").joinpath("migrations")
    names = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".sql"))
    assert names, "no migrations shipped"
    assert all(re.fullmatch(r"\d{3}_[a-z0-9_]+\.sql", name) for name in names)
    assert [int(name[:3]) for name in names] == list(range(1, len(names) + 1))


def test_no_sql_reads_the_database_clock() -> None:
    texts = [m.sql for m in load_migrations()] + [declared_schema()]
    texts += [
        value for name, value in vars(queries).items() if name.isupper() and isinstance(value, str)
    ]
    clock_reads = re.compile(
        r"\b(now\s*\(|current_timestamp|current_date|localtimestamp|clock_timestamp|"
        r"statement_timestamp|transaction_timestamp)",
        re.IGNORECASE,
    )
    offenders = [text for text in texts if clock_reads.search(text)]
    assert not offenders


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
            await conn.fetch(queries.ENQUEUE, *enqueue_params(tasks, start))
            for task_id, (_, state) in specs.items():
                if state != "pending":
                    await conn.execute(
                        "UPDATE conveyor_tasks SET state = $2, completed_at = $3 WHERE id = $1",
                        task_id,
                        state,
                        start,
                    )
            assert await migrate(dsn) == [3]
            rows = await conn.fetch("SELECT id, purge_at FROM conveyor_tasks")
        finally:
            await conn.close()
        assert {row["id"]: row["purge_at"] for row in rows} == {
            "01J0000000000000000000OWN1": start + timedelta(hours=1),
            "01J0000000000000000000DEF1": None,
            "01J0000000000000000000ARC1": None,
            "01J0000000000000000000PEN1": None,
        }
        broker = await PostgresBroker.connect(dsn, clock)
        try:

            async def purge() -> int:
                two_hours = timedelta(hours=2)
                return await broker.purge_terminal(
                    archive_retention=two_hours, default_retention=two_hours
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
            await broker.purge_terminal(archive_retention=archive, default_retention=default) == 1
        )  # the one on the default
        assert (await broker.get_task(old_release.id)).id == old_release.id
        clock.advance(timedelta(hours=1, seconds=1))
        assert (
            await broker.purge_terminal(archive_retention=archive, default_retention=default) == 1
        )
        with pytest.raises(TaskNotFound):
            await broker.get_task(old_release.id)


# ------------------------------------------------------------------------ concurrency


@asynccontextmanager
async def brokers(dsn: str, clock: FakeClock, count: int) -> AsyncIterator[list[PostgresBroker]]:
    """``count`` brokers, each with its own pool (so its own connections)."""
    opened = [
        await PostgresBroker.connect(dsn, clock, min_size=1, max_size=2) for _ in range(count)
    ]
    try:
        yield opened
    finally:
        for broker in opened:
            await broker.close()


async def test_concurrent_leasers_never_share_or_lose_a_task(pg_dsn: str) -> None:
    clock = FakeClock()
    total = 2000
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 4) as fleet:
        ids: list[str] = []
        for start in range(0, total, 1000):
            batch = [NewTask("race", "t") for _ in range(min(1000, total - start))]
            ids += [r.task.id for r in await fleet[0].enqueue_batch(batch)]

        async def drain(broker: PostgresBroker) -> list[tuple[str, str]]:
            got: list[tuple[str, str]] = []
            while leased := await broker.lease("race", 17, TTL):
                got += [(task.id, task.lease_id or "") for task in leased]
            return got

        # Two leasers per broker, so each broker's two connections are busy at once too.
        results = await asyncio.gather(*(drain(b) for b in fleet for _ in range(2)))
        leased = [pair for result in results for pair in result]
        assert len(leased) == total
        assert sorted(task_id for task_id, _ in leased) == sorted(ids)
        assert sum(1 for result in results if result) > 1, "one leaser took everything"

        stats = (await fleet[0].queue_stats("race"))[0]
        assert stats.count(TaskState.ACTIVE) == total
        assert stats.count(TaskState.PENDING) == 0
        conn = await asyncpg.connect(dsn)
        try:
            stored = {
                row["id"]: row["lease_id"]
                for row in await conn.fetch("SELECT id, lease_id FROM conveyor_tasks")
            }
        finally:
            await conn.close()
        assert stored == dict(leased)


async def test_concurrent_upserts_of_one_webhook_worker_all_succeed(pg_dsn: str) -> None:
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 4) as fleet:
        specs = [
            WebhookWorkerSpec("race", f"https://hooks.example.com/{n}", {"q": 1}, concurrency=n)
            for n in range(1, 9)
        ]
        clock.advance(timedelta(seconds=1))
        stored = await asyncio.gather(
            *(fleet[n % len(fleet)].upsert_webhook_worker(spec) for n, spec in enumerate(specs))
        )
        assert {w.created_at for w in stored} == {clock.now()}
        [final] = await fleet[0].list_webhook_workers()
        # The last writer wins as a whole: the row is one of the specs, not a mix.
        assert (final.url, final.concurrency) in {(s.url, s.concurrency) for s in specs}
        assert final.url.endswith(f"/{final.concurrency}")


async def test_overlapping_batches_in_opposite_orders_do_not_deadlock(pg_dsn: str) -> None:
    """A gateway's ack batch and its heartbeat batch may name the same tasks in different
    orders at the same moment; both must go through (no deadlock abort)."""
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 2) as [acker, beater]:
        for _ in range(10):
            await acker.enqueue_batch([NewTask("dl", "t") for _ in range(200)])
            leased = await acker.lease("dl", 200, TTL)
            refs = [LeaseRef(task.id, task.lease_id or "") for task in leased]
            items = [AckItem(ref.task_id, ref.lease_id) for ref in refs]
            acked, lost = await asyncio.gather(
                acker.ack_batch(items), beater.extend_leases(list(reversed(refs)), TTL)
            )
            # Each task was either extended first and then acked, or acked first (and its
            # lease lost for the heartbeat): never both lost.
            assert all(acked)
            assert {ref.task_id for ref in lost} <= {task.id for task in leased}


async def _wait_until_blocked_on_a_lock(dsn: str, query_fragment: str) -> None:
    """Wait until some backend runs a statement containing ``query_fragment`` and waits
    for a lock."""
    conn = await asyncpg.connect(dsn)
    try:

        async def blocked() -> bool:
            count: int = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND position($1 in query) > 0",
                query_fragment,
            )
            return count > 0

        await wait_until(blocked, message=f"a statement with {query_fragment!r} waiting on a lock")
    finally:
        await conn.close()


@pytest.mark.parametrize("holder_commits", [True, False])
async def test_unique_claim_race_waits_for_the_holder(pg_dsn: str, holder_commits: bool) -> None:
    """An enqueue that meets an uncommitted claim on its key waits for it: DuplicateTask
    naming the holder if it commits, success if it rolls back."""
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 1) as [broker]:
        holder = new_task(
            NewTask("uq", "t", unique_key="k"),
            task_id="01J0000000000000000000HOLD",
            state=TaskState.PENDING,
            now=clock.now(),
            max_retry=3,
        )
        conn = await asyncpg.connect(dsn)
        try:
            tx = conn.transaction()
            await tx.start()
            await conn.fetch(queries.ENQUEUE, *enqueue_params([holder], clock.now()))
            contender = asyncio.create_task(broker.enqueue(NewTask("uq", "t", unique_key="k")))
            await _wait_until_blocked_on_a_lock(dsn, "INSERT INTO conveyor_tasks")
            assert not contender.done()
            if holder_commits:
                await tx.commit()
                with pytest.raises(DuplicateTask) as raised:
                    await contender
                assert raised.value.existing_id == holder.id
            else:
                await tx.rollback()
                result = await contender
                assert result.created
                assert result.task.unique_key == "k"
        finally:
            await conn.close()


async def test_concurrent_enqueues_of_one_unique_key_have_one_winner(pg_dsn: str) -> None:
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 4) as fleet:
        for round_no in range(25):
            key = f"key-{round_no}"

            async def attempt(broker: PostgresBroker, key: str = key) -> str | DuplicateTask:
                try:
                    return (await broker.enqueue(NewTask("uq", "t", unique_key=key))).task.id
                except DuplicateTask as exc:
                    return exc

            outcomes = await asyncio.gather(*(attempt(b) for b in fleet))
            winners = [o for o in outcomes if isinstance(o, str)]
            losers = [o for o in outcomes if isinstance(o, DuplicateTask)]
            assert len(winners) == 1, outcomes
            assert len(losers) == len(fleet) - 1
            assert all(loser.existing_id == winners[0] for loser in losers)
        stats = (await fleet[0].queue_stats("uq"))[0]
        assert stats.count(TaskState.PENDING) == 25


async def test_batches_claiming_the_same_keys_in_opposite_orders_do_not_deadlock(
    pg_dsn: str,
) -> None:
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 2) as [one, two]:
        for round_no in range(10):
            keys = [f"r{round_no}-{n}" for n in range(500)]

            async def attempt(broker: PostgresBroker, keys: list[str]) -> bool:
                try:
                    await broker.enqueue_batch([NewTask("uq", "t", unique_key=k) for k in keys])
                except DuplicateTask:
                    return False
                return True

            won = await asyncio.gather(attempt(one, keys), attempt(two, keys[::-1]))
            assert sorted(won) == [False, True]
        stats = (await one.queue_stats("uq"))[0]
        assert stats.count(TaskState.PENDING) == 10 * 500


async def test_unique_index_is_partial_over_incomplete_states(pg_dsn: str) -> None:
    async with scratch_schema(pg_dsn) as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            definition: str = await conn.fetchval(
                "SELECT indexdef FROM pg_indexes WHERE indexname = 'conveyor_tasks_unique_idx'"
            )
        finally:
            await conn.close()
    assert definition.startswith("CREATE UNIQUE INDEX")
    assert "(queue, unique_claim)" in definition
    for state in ("pending", "scheduled", "aggregating", "blocked", "active", "retry"):
        assert f"'{state}'" in definition
    for state in ("completed", "archived", "canceled"):
        assert f"'{state}'" not in definition


# ------------------------------------------------------------------------------ plans


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes += _plan_nodes(child)
    return nodes


def assert_walks_the_due_index(plans: dict[str, list[dict[str, Any]]]) -> None:
    """Every plan (by plan cache mode) scans the due index, and nothing else at all."""
    for mode, nodes in plans.items():
        kinds = [node["Node Type"] for node in nodes]
        scans = [(node["Node Type"], node.get("Index Name")) for node in nodes]
        assert ("Index Scan", "conveyor_tasks_due_idx") in scans, (mode, kinds)
        for bad in ("Seq Scan", "Sort", "Bitmap Heap Scan"):
            assert bad not in kinds, (mode, kinds)


async def test_lease_uses_the_due_index_on_a_never_analyzed_table(pg_dsn: str) -> None:
    """Enqueue 50k tasks into an empty, never-analyzed table, then plan the lease both as a
    custom plan (values known) and as a generic one (as a reused prepared statement)."""
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 1) as [broker]:
        conn = await asyncpg.connect(dsn)
        try:
            # Keep autovacuum from analyzing behind the test's back: the point is a table
            # whose statistics are stale (never gathered) when the first lease runs.
            await conn.execute("ALTER TABLE conveyor_tasks SET (autovacuum_enabled = false)")
            for queue in ("hot", "cold"):
                for _ in range(25):
                    await broker.enqueue_batch([NewTask(queue, "t") for _ in range(1000)])
            analyzed = await conn.fetchval(
                "SELECT coalesce(last_analyze, last_autoanalyze) FROM pg_stat_user_tables "
                "WHERE relname = 'conveyor_tasks' AND schemaname = current_schema()"
            )
            assert analyzed is None
            await conn.execute(
                "PREPARE lease_plan(text, timestamptz, integer, text[], timestamptz) AS "
                + queries.LEASE
            )
            now = clock.now()
            plans = {}
            for mode in ("force_custom_plan", "force_generic_plan"):
                await conn.execute(f"SET plan_cache_mode = {mode}")
                raw = await conn.fetchval(
                    "EXPLAIN (FORMAT JSON) EXECUTE lease_plan("
                    f"'hot', '{now.isoformat()}', 100, ARRAY['x'], '{(now + TTL).isoformat()}')"
                )
                plans[mode] = _plan_nodes(json.loads(raw)[0]["Plan"])
        finally:
            await conn.close()
    assert_walks_the_due_index(plans)


async def test_lease_many_probes_the_due_index_per_queue_on_a_never_analyzed_table(
    pg_dsn: str,
) -> None:
    """LEASE_MANY, custom plan or generic: one due-index probe per queue asked for."""
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 1) as [broker]:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("ALTER TABLE conveyor_tasks SET (autovacuum_enabled = false)")
            for queue in ("hot", "warm", "cold"):
                for _ in range(10):
                    await broker.enqueue_batch([NewTask(queue, "t") for _ in range(1000)])
            await conn.execute(
                "PREPARE lease_many_plan(text[], integer[], timestamptz, text[], timestamptz)"
                " AS " + queries.LEASE_MANY
            )
            now = clock.now()
            plans = {}
            for mode in ("force_custom_plan", "force_generic_plan"):
                await conn.execute(f"SET plan_cache_mode = {mode}")
                raw = await conn.fetchval(
                    "EXPLAIN (FORMAT JSON) EXECUTE lease_many_plan("
                    f"ARRAY['hot', 'cold'], ARRAY[50, 50], '{now.isoformat()}', ARRAY['x'], "
                    f"'{(now + TTL).isoformat()}')"
                )
                plans[mode] = _plan_nodes(json.loads(raw)[0]["Plan"])
        finally:
            await conn.close()
    assert_walks_the_due_index(plans)


async def test_batch_lease_statements_use_the_primary_key_on_a_never_analyzed_table(
    pg_dsn: str,
) -> None:
    """After a burst has gone through a never-analyzed table (every lease left a dead entry
    in the lease-expiry index), AckBatch and ExtendLeases still find their rows through
    the primary key, custom plan or generic: never by scanning the ACTIVE rows' index."""
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 1) as [broker]:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("ALTER TABLE conveyor_tasks SET (autovacuum_enabled = false)")
            # Big enough (about 1200 pages) that, going by its size, probing the primary
            # key is cheaper than a sequential scan for a 100-row batch.
            payload = b"x" * 300
            for _ in range(20):
                await broker.enqueue_batch(
                    [NewTask("hot", "t", payload=payload) for _ in range(1000)]
                )
            for _ in range(20):
                leased = await broker.lease("hot", 100, TTL)
                acked = await broker.ack_batch([AckItem(t.id, t.lease_id or "") for t in leased])
                assert all(acked)
            held = await broker.lease("hot", 100, TTL)
            analyzed = await conn.fetchval(
                "SELECT coalesce(last_analyze, last_autoanalyze) FROM pg_stat_user_tables "
                "WHERE relname = 'conveyor_tasks' AND schemaname = current_schema()"
            )
            assert analyzed is None
            ids = [t.id for t in held]
            leases = [t.lease_id or "" for t in held]
            now = clock.now()
            statements = {
                "ack_batch": (queries.ACK_BATCH, (ids, leases, [None] * len(ids), now)),
                "extend_leases": (queries.EXTEND_LEASES, (ids, leases, now + TTL, now)),
            }
            plans = {}
            for name, (query, args) in statements.items():
                for mode in ("force_custom_plan", "force_generic_plan"):
                    await conn.execute(f"SET plan_cache_mode = {mode}")
                    raw = await conn.fetchval("EXPLAIN (FORMAT JSON) " + query, *args)
                    plans[name, mode] = _plan_nodes(json.loads(raw)[0]["Plan"])
        finally:
            await conn.close()
    for key, nodes in plans.items():
        scans = [(node["Node Type"], node.get("Index Name")) for node in nodes]
        assert ("Index Scan", "conveyor_tasks_pkey") in scans, (key, scans)
        for node in nodes:
            assert node.get("Index Name") != "conveyor_tasks_lease_expiry_idx", (key, scans)
            assert node["Node Type"] not in ("Seq Scan", "Bitmap Heap Scan"), (key, scans)


async def _explain_analyze(
    conn: asyncpg.Connection[asyncpg.Record], execute: str
) -> dict[str, list[dict[str, Any]]]:
    """The plan nodes of ``execute`` (an EXECUTE of a prepared statement) as run, custom
    and generic; whatever it changed is rolled back."""
    plans = {}
    for mode in ("force_custom_plan", "force_generic_plan"):
        await conn.execute(f"SET plan_cache_mode = {mode}")
        tx = conn.transaction()
        await tx.start()
        try:
            raw = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {execute}")
        finally:
            await tx.rollback()
        plans[mode] = _plan_nodes(json.loads(raw)[0]["Plan"])
    return plans


def _assert_reads_little(mode: str, nodes: list[dict[str, Any]], most: int) -> None:
    """Every read of conveyor_tasks is an index scan that returned at most ``most`` rows
    per loop, and nothing sorts rows read from the table (only the short lists built from
    such scans)."""
    scans = [
        n
        for n in nodes
        if n.get("Relation Name") == "conveyor_tasks" and n["Node Type"].endswith("Scan")
    ]
    assert scans, mode
    for node in scans:
        summary = (mode, node["Node Type"], node.get("Index Name"), node["Actual Rows"])
        assert node["Node Type"] in ("Index Scan", "Index Only Scan"), summary
        assert node["Actual Rows"] <= most, summary
    for node in nodes:
        if node["Node Type"] == "Sort":
            sorted_from = _row_sources(node)
            assert not any("Relation Name" in n for n in sorted_from), (mode, sorted_from)


def _row_sources(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes whose rows flow into ``plan``: its children and theirs, but not subplans
    (which only test each row)."""
    nodes = []
    for child in plan.get("Plans", []):
        if child.get("Parent Relationship") in ("Outer", "Inner", "Member", "Subquery"):
            nodes += [child, *_row_sources(child)]
    return nodes


async def test_purge_and_due_queues_walk_their_indexes_on_a_never_analyzed_table(
    pg_dsn: str,
) -> None:
    """With thousands of terminal rows retained (half of them past retention) and
    thousands due, a purge of 10 reads 10 rows from each of its three indexes and
    due_queues one row per probe: neither sorts or scans the table, custom plan or
    generic, on a table whose statistics were never gathered."""
    clock = FakeClock()
    start = clock.now()
    hour = timedelta(hours=1)
    work_queues = [f"work-{n}" for n in range(4)]
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 1) as [broker]:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("ALTER TABLE conveyor_tasks SET (autovacuum_enabled = false)")
            # A minute apart: 1000 completed with a retention of their own, 1000 taking
            # the default one, 1000 archived (and a few canceled).
            for _ in range(10):
                for retention in (hour, None):
                    await broker.enqueue_batch(
                        [NewTask("done", "t", retention=retention) for _ in range(100)]
                    )
                    leased = await broker.lease("done", 100, TTL)
                    acked = await broker.ack_batch(
                        [AckItem(t.id, t.lease_id or "") for t in leased]
                    )
                    assert all(acked)
                soon = clock.now() + timedelta(seconds=1)
                await broker.enqueue_batch(
                    [NewTask("gone", "t", expires_at=soon) for _ in range(100)]
                )
                clock.advance(timedelta(seconds=1))
                assert len(await broker.archive_expired(limit=100)) == 100
                for _ in range(2):
                    await broker.cancel_task((await broker.enqueue(NewTask("gone", "t"))).task.id)
                clock.advance(timedelta(seconds=59))
            for queue in work_queues:
                await broker.enqueue_batch([NewTask(queue, "t") for _ in range(500)])
            # A queue with leasable rows but nothing due: a retry a day away.
            await broker.enqueue(NewTask("later", "t"))
            [retry] = await broker.lease("later", 1, TTL)
            await broker.fail(retry.id, retry.lease_id or "", "boom", timedelta(days=1))
            analyzed = await conn.fetchval(
                "SELECT coalesce(last_analyze, last_autoanalyze) FROM pg_stat_user_tables "
                "WHERE relname = 'conveyor_tasks' AND schemaname = current_schema()"
            )
            assert analyzed is None
            # About half of each kind of terminal row is past its retention.
            clock.set(start + hour + timedelta(minutes=5))
            now = clock.now()
            assert await broker.due_queues() == work_queues

            await conn.execute(
                "PREPARE purge_plan(timestamptz, interval, interval, integer) AS "
                + queries.PURGE_TERMINAL
            )
            await conn.execute(
                "PREPARE due_plan(timestamptz, text, integer) AS " + queries.DUE_QUEUES
            )
            purge = await _explain_analyze(
                conn, f"EXECUTE purge_plan('{now.isoformat()}', '1 hour', '1 hour', 10)"
            )
            due = await _explain_analyze(conn, f"EXECUTE due_plan('{now.isoformat()}', '', 100)")
        finally:
            await conn.close()
    streams = {f"conveyor_tasks_{name}_idx" for name in ("purge_at", "completed", "ended")}
    for mode, nodes in purge.items():
        # Each stream has hundreds of rows past retention and stops at the limit.
        read = {n["Index Name"]: n["Actual Rows"] for n in nodes if n.get("Index Name") in streams}
        assert read == dict.fromkeys(streams, 10), mode
        _assert_reads_little(mode, nodes, most=10)
    for mode, nodes in due.items():
        assert {n.get("Index Name") for n in nodes if "Index Name" in n} == {
            "conveyor_tasks_due_idx"
        }, mode
        _assert_reads_little(mode, nodes, most=1)


# ----------------------------------------------------------------------- time handling


async def test_purge_adds_retention_as_exact_time_across_a_dst_change(pg_dsn: str) -> None:
    """A one-day retention is 24 hours even when the session's time zone skips an hour."""
    # 2030-03-10 is the day US clocks spring forward.
    clock = FakeClock(datetime(2030, 3, 9, 12, 0, tzinfo=UTC))
    async with scratch_schema(pg_dsn) as dsn:
        broker = await PostgresBroker.connect(f"{dsn}&timezone=America/New_York", clock)
        try:
            await broker.enqueue(NewTask("q", "t", retention=timedelta(days=1)))
            [leased] = await broker.lease("q", 1, TTL)
            await broker.ack(leased.id, leased.lease_id or "")
            clock.advance(timedelta(hours=23, minutes=30))
            month = timedelta(days=30)
            assert await broker.purge_terminal(archive_retention=month) == 0
            clock.advance(timedelta(minutes=30))
            assert await broker.purge_terminal(archive_retention=month) == 1
        finally:
            await broker.close()


async def test_webhook_worker_times_read_back_in_utc_whatever_the_session_zone(
    pg_dsn: str,
) -> None:
    clock = FakeClock(datetime(2030, 3, 10, 6, 59, 59, 999999, tzinfo=UTC))
    timeout = timedelta(minutes=59, seconds=59, microseconds=999999)
    async with scratch_schema(pg_dsn) as dsn:
        writer = await PostgresBroker.connect(f"{dsn}&timezone=Asia/Kolkata", clock)
        reader = await PostgresBroker.connect(f"{dsn}&timezone=America/New_York", clock)
        try:
            written = await writer.upsert_webhook_worker(
                WebhookWorkerSpec("tz", "https://hooks.example.com/", {"q": 1}, timeout=timeout)
            )
            read = await reader.get_webhook_worker("tz")
            assert read == written
            assert read.timeout == timeout
            assert read.created_at == clock.now()
            assert read.created_at.utcoffset() == timedelta(0)
        finally:
            await writer.close()
            await reader.close()
