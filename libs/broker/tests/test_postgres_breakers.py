"""The Postgres broker's circuit breaker statements and lease type filters: the filtered
lease statements are the plain ones plus the filters (the plain ones, the hot path, run
untouched when no filter is given), they walk the due index, and of several brokers
taking one probe at once exactly one gets it.

Each database test works in a schema of its own, so none depends on another's rows.
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from conveyor_broker import Breaker, BreakerStatus, ConcurrencyLimit, FakeClock, NewTask
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.postgres.queries import concurrency, lease
from conveyor_broker.testing.schemas import brokers, scratch_schema
from conveyor_broker.types import LEASABLE_STATES, TaskState

TTL = timedelta(seconds=30)

_LEASE_FILTERS = (
    "      AND NOT (type = ANY($7::text[]))\n"
    "      AND ($8::text[] IS NULL OR type = ANY($8::text[]))\n"
)
_KEYED_FILTERS = (
    "  AND NOT (type = ANY($4::text[]))\n  AND ($5::text[] IS NULL OR type = ANY($5::text[]))\n"
)


def test_the_filtered_lease_is_the_plain_lease_with_the_filters() -> None:
    assert _LEASE_FILTERS in lease.LEASE_FILTERED
    assert lease.LEASE_FILTERED.replace(_LEASE_FILTERS, "") == lease.LEASE


def test_the_filtered_keyed_candidates_are_the_plain_ones_with_the_filters() -> None:
    assert _KEYED_FILTERS in concurrency.KEYED_CANDIDATES_FILTERED
    plain = concurrency.KEYED_CANDIDATES_FILTERED.replace(_KEYED_FILTERS, "")
    assert plain == concurrency.KEYED_CANDIDATES


@pytest.mark.parametrize("statement", [lease.LEASE_FILTERED, concurrency.KEYED_CANDIDATES_FILTERED])
def test_the_filtered_statements_pick_the_leasable_states(statement: str) -> None:
    lists = re.findall(r"state (?:NOT )?IN (\([^)]*\))", statement)
    expected = "(" + ", ".join(f"'{s.value}'" for s in TaskState if s in LEASABLE_STATES) + ")"
    assert lists
    assert set(lists) == {expected}


class RecordingBroker(PostgresBroker):
    """A PostgresBroker that keeps the text of every statement it fetches with."""

    statements: list[str]

    async def _fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        self.statements.append(query)
        return await super()._fetch(query, *args)


postgres = pytest.mark.postgres


@postgres
async def test_an_unfiltered_lease_runs_the_plain_statements(pg_dsn: str) -> None:
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
        try:
            broker = RecordingBroker(pool, clock)
            broker.statements = []
            await broker.enqueue_batch([NewTask("q", "a"), NewTask("q", "b")])
            broker.statements = []
            [leased] = await broker.lease("q", 1, TTL)
            assert broker.statements == [lease.LEASE]
            broker.statements = []
            [other] = await broker.lease("q", 1, TTL, exclude_types=[leased.type])
            assert broker.statements == [lease.LEASE_FILTERED]
            assert other.type != leased.type
            # Nothing due, filtered: the keyed lease is looked for, as unfiltered.
            broker.statements = []
            assert await broker.lease("q", 1, TTL, only_types=["a"]) == []
            assert broker.statements[0] == lease.LEASE_FILTERED
            assert lease.LEASE not in broker.statements
        finally:
            await pool.close()


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes += _plan_nodes(child)
    return nodes


@postgres
async def test_the_filtered_lease_walks_the_due_index(pg_dsn: str) -> None:
    """LEASE_FILTERED on a never-analyzed table, custom plan or generic: the due index,
    no scan or sort of the table."""
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 1) as [broker]:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("ALTER TABLE conveyor_tasks SET (autovacuum_enabled = false)")
            for queue in ("hot", "cold"):
                for n in range(10):
                    await broker.enqueue_batch([NewTask(queue, f"t{n % 3}") for _ in range(1000)])
            await conn.execute(
                "PREPARE lease_plan(text, timestamptz, integer, text[], timestamptz, text[],"
                " text[], text[]) AS " + lease.LEASE_FILTERED
            )
            now = clock.now()
            plans = {}
            for mode in ("force_custom_plan", "force_generic_plan"):
                await conn.execute(f"SET plan_cache_mode = {mode}")
                raw = await conn.fetchval(
                    "EXPLAIN (FORMAT JSON) EXECUTE lease_plan("
                    f"'hot', '{now.isoformat()}', 100, ARRAY['x'], '{(now + TTL).isoformat()}', "
                    "ARRAY['api-1'], ARRAY['t1'], ARRAY['t0', 't2'])"
                )
                plans[mode] = _plan_nodes(json.loads(raw)[0]["Plan"])
        finally:
            await conn.close()
    for mode, nodes in plans.items():
        nodes = [n for n in nodes if n.get("Relation Name") != "conveyor_concurrency_limits"]
        kinds = [node["Node Type"] for node in nodes]
        scans = [(node["Node Type"], node.get("Index Name")) for node in nodes]
        assert ("Index Scan", "conveyor_tasks_due_idx") in scans, (mode, kinds)
        for bad in ("Seq Scan", "Sort", "Bitmap Heap Scan"):
            assert bad not in kinds, (mode, kinds)


@postgres
async def test_of_brokers_taking_one_probe_at_once_exactly_one_gets_it(pg_dsn: str) -> None:
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 4) as fleet:
        for round_ in range(10):
            task_type = f"t{round_}"
            now = clock.now()
            await fleet[0].put_breaker(
                Breaker("q", task_type, BreakerStatus.OPEN, now, now, failures=3)
            )
            until = now + timedelta(seconds=5)
            taken = await asyncio.gather(
                *(b.take_probe("q", task_type, until) for b in fleet for _ in range(2))
            )
            assert sorted(taken) == [False] * 7 + [True], round_
            clock.advance(timedelta(seconds=1))


@postgres
async def test_concurrent_filtered_leases_keep_the_concurrency_limits(pg_dsn: str) -> None:
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 4) as fleet:
        await fleet[0].set_concurrency_limit(ConcurrencyLimit("q", 2))
        await fleet[0].enqueue_batch(
            [NewTask("q", f"t{i % 2}", concurrency_key=f"k{i % 3}") for i in range(60)]
        )
        batches = await asyncio.gather(
            *(
                b.lease("q", 5, TTL, exclude_types=["t1"] if n % 2 else [], only_types=None)
                for n, b in enumerate(fleet * 2)
            )
        )
        per_key: dict[str | None, int] = {}
        for task in (t for batch in batches for t in batch):
            per_key[task.concurrency_key] = per_key.get(task.concurrency_key, 0) + 1
        assert per_key == {"k0": 2, "k1": 2, "k2": 2}
