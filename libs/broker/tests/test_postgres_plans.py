"""The Postgres broker's query plans: on a table whose statistics were never gathered,
custom plan or generic, the hot statements and the sweeps walk their indexes and never
scan or sort the table.

Each test works in a schema of its own, so none depends on another's rows.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from conveyor_broker import AckItem, FakeClock, NewTask
from conveyor_broker.postgres.queries.dependencies import (
    LOCK_DEPENDENCIES,
    READY_TO_RESOLVE,
    RESOLVE_DEPENDENTS,
)
from conveyor_broker.postgres.queries.lease import EXTEND_LEASES, LEASE, LEASE_MANY
from conveyor_broker.postgres.queries.outcomes import ACK_BATCH
from conveyor_broker.postgres.queries.sweeps import (
    DUE_AMONG,
    DUE_QUEUES,
    OLDEST_DUE,
    PURGE_TERMINAL,
)
from conveyor_broker.testing.schemas import brokers, scratch_schema

pytestmark = pytest.mark.postgres

TTL = timedelta(seconds=30)


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes += _plan_nodes(child)
    return nodes


def assert_walks_the_due_index(plans: dict[str, list[dict[str, Any]]]) -> None:
    """Every plan (by plan cache mode) scans the due index, and nothing else of the task
    table (the one-time test of the queue's concurrency limits reads their tiny table as
    it likes, once per queue)."""
    for mode, nodes in plans.items():
        limits = [n for n in nodes if n.get("Relation Name") == "conveyor_concurrency_limits"]
        assert limits, (mode, "no test of the concurrency limits")
        assert all(n.get("Parent Relationship") == "InitPlan" for n in limits), mode
        nodes = [n for n in nodes if n.get("Relation Name") != "conveyor_concurrency_limits"]
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
                "PREPARE lease_plan(text, timestamptz, integer, text[], timestamptz, text[]) AS "
                + LEASE
            )
            now = clock.now()
            plans = {}
            for mode in ("force_custom_plan", "force_generic_plan"):
                await conn.execute(f"SET plan_cache_mode = {mode}")
                raw = await conn.fetchval(
                    "EXPLAIN (FORMAT JSON) EXECUTE lease_plan("
                    f"'hot', '{now.isoformat()}', 100, ARRAY['x'], '{(now + TTL).isoformat()}', "
                    "ARRAY['api-1'])"
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
                "PREPARE lease_many_plan(text[], integer[], timestamptz, text[], timestamptz,"
                " integer[], text[]) AS " + LEASE_MANY
            )
            now = clock.now()
            plans = {}
            for mode in ("force_custom_plan", "force_generic_plan"):
                await conn.execute(f"SET plan_cache_mode = {mode}")
                raw = await conn.fetchval(
                    "EXPLAIN (FORMAT JSON) EXECUTE lease_many_plan("
                    f"ARRAY['hot', 'cold'], ARRAY[50, 50], '{now.isoformat()}', ARRAY['x'], "
                    f"'{(now + TTL).isoformat()}', ARRAY[0, 50], ARRAY['api-1'])"
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
                "ack_batch": (ACK_BATCH, (ids, leases, [None] * len(ids), now)),
                "extend_leases": (EXTEND_LEASES, (ids, leases, now + TTL, now)),
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
    thousands due, a purge of 10 reads 10 rows from each of its three indexes, and
    due_queues and due_among one row per probe: none sorts or scans the table, custom
    plan or generic, on a table whose statistics were never gathered."""
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
            asked = [*work_queues[:2], "later", "done", "nothing"]
            assert await broker.due_among(asked) == work_queues[:2]

            await conn.execute(
                "PREPARE purge_plan(timestamptz, interval, interval, integer) AS " + PURGE_TERMINAL
            )
            await conn.execute("PREPARE due_plan(timestamptz, text, integer) AS " + DUE_QUEUES)
            purge = await _explain_analyze(
                conn, f"EXECUTE purge_plan('{now.isoformat()}', '1 hour', '1 hour', 10)"
            )
            due = await _explain_analyze(conn, f"EXECUTE due_plan('{now.isoformat()}', '', 100)")
            await conn.execute("PREPARE among_plan(timestamptz, text[]) AS " + DUE_AMONG)
            names = ", ".join(f"'{queue}'" for queue in sorted(asked))
            among = await _explain_analyze(
                conn, f"EXECUTE among_plan('{now.isoformat()}', ARRAY[{names}])"
            )
            assert set(await broker.oldest_due(asked)) == set(work_queues[:2])
            await conn.execute("PREPARE oldest_plan(timestamptz, text[]) AS " + OLDEST_DUE)
            oldest = await _explain_analyze(
                conn, f"EXECUTE oldest_plan('{now.isoformat()}', ARRAY[{names}])"
            )
        finally:
            await conn.close()
    streams = {f"conveyor_tasks_{name}_idx" for name in ("purge_at", "completed", "ended")}
    for mode, nodes in purge.items():
        # Each stream has hundreds of rows past retention and stops at the limit.
        read = {n["Index Name"]: n["Actual Rows"] for n in nodes if n.get("Index Name") in streams}
        assert read == dict.fromkeys(streams, 10), mode
        _assert_reads_little(mode, nodes, most=10)
    for mode, nodes in [*due.items(), *among.items(), *oldest.items()]:
        assert {n.get("Index Name") for n in nodes if "Index Name" in n} == {
            "conveyor_tasks_due_idx"
        }, mode
        _assert_reads_little(mode, nodes, most=1)


async def test_dependency_statements_walk_their_indexes_on_a_never_analyzed_table(
    pg_dsn: str,
) -> None:
    """A fan-in of 5,000 parents to one child and a fan-out of one parent to 5,000
    children, every parent completed, on a table whose statistics were never gathered:
    resolving 100 of them reads their open edges from the open-edge index (at most
    limit + 1 per parent), the sweep reads its limit from its own index, and the enqueue
    locks its dependencies by primary key; none scans a table, custom plan or generic."""
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 1) as [broker]:
        conn = await asyncpg.connect(dsn)
        try:
            for table in ("conveyor_tasks", "conveyor_task_dependencies"):
                await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
            parents: list[str] = []
            for _ in range(5):
                batch = await broker.enqueue_batch([NewTask("fan-in", "t") for _ in range(1000)])
                parents += [r.task.id for r in batch]
            await broker.enqueue(NewTask("child", "t", depends_on=tuple(parents)))
            [root] = await broker.enqueue_batch([NewTask("fan-out", "t")])
            for _ in range(5):
                await broker.enqueue_batch(
                    [NewTask("children", "t", depends_on=(root.task.id,)) for _ in range(1000)]
                )
            for queue, count in (("fan-in", 5000), ("fan-out", 1)):
                while count:
                    leased = await broker.lease(queue, min(count, 1000), TTL)
                    acked = await broker.ack_batch(
                        [AckItem(t.id, t.lease_id or "") for t in leased]
                    )
                    assert all(acked)
                    count -= len(leased)
            analyzed = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_user_tables WHERE schemaname = current_schema() "
                "AND coalesce(last_analyze, last_autoanalyze) IS NOT NULL"
            )
            assert analyzed == 0
            now = clock.now()
            await conn.execute(
                "PREPARE resolve_plan(text[], timestamptz, integer) AS " + RESOLVE_DEPENDENTS
            )
            await conn.execute("PREPARE ready_plan(timestamptz, integer) AS " + READY_TO_RESOLVE)
            await conn.execute("PREPARE lock_plan(text[]) AS " + LOCK_DEPENDENCIES)
            some = "ARRAY[" + ", ".join(f"'{p}'" for p in sorted(parents)[:100]) + "]"
            fan_in = await _explain_analyze(
                conn, f"EXECUTE resolve_plan({some}, '{now.isoformat()}', 100)"
            )
            fan_out = await _explain_analyze(
                conn, f"EXECUTE resolve_plan(ARRAY['{root.task.id}'], '{now.isoformat()}', 100)"
            )
            ready = await _explain_analyze(conn, f"EXECUTE ready_plan('{now.isoformat()}', 50)")
            lock = await _explain_analyze(conn, f"EXECUTE lock_plan({some})")
        finally:
            await conn.close()
    for name, plans, most in (("fan-in", fan_in, 100), ("fan-out", fan_out, 101)):
        for mode, nodes in plans.items():
            scans = [
                (n["Node Type"], n.get("Index Name"), n["Actual Rows"])
                for n in nodes
                if n["Node Type"].endswith("Scan") and "Relation Name" in n
            ]
            assert "conveyor_task_dependencies_open_idx" in [s[1] for s in scans], (name, scans)
            # By index only (a bitmap of the primary key for the ids asked for will do),
            # each read bounded by the limit.
            for kind, _, rows in scans:
                assert kind in ("Index Scan", "Index Only Scan", "Bitmap Heap Scan"), (
                    name,
                    mode,
                    scans,
                )
                assert rows <= most, (name, mode, scans)
            bitmaps = {n.get("Index Name") for n in nodes if n["Node Type"] == "Bitmap Index Scan"}
            assert bitmaps <= {"conveyor_tasks_pkey"}, (name, mode, bitmaps)
    for mode, nodes in ready.items():
        assert {n.get("Index Name") for n in nodes if "Index Name" in n} == {
            "conveyor_tasks_resolve_idx"
        }, mode
        _assert_reads_little(mode, nodes, most=50)
    for mode, nodes in lock.items():
        locks = [
            (n["Node Type"], n.get("Index Name"))
            for n in nodes
            if "Relation Name" in n and n["Node Type"].endswith("Scan")
        ]
        assert locks, mode
        for kind, index in locks:
            assert kind in ("Index Scan", "Bitmap Heap Scan"), (mode, locks)
            assert kind != "Index Scan" or index == "conveyor_tasks_pkey", (mode, locks)
        bitmaps = {n.get("Index Name") for n in nodes if n["Node Type"] == "Bitmap Index Scan"}
        assert bitmaps <= {"conveyor_tasks_pkey"}, (mode, bitmaps)
