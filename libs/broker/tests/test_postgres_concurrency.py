"""The Postgres broker under real concurrency: several brokers (each with its own pool)
leasing, acking, heartbeating and claiming unique keys at once, and the unique index that
makes claims safe.

Each test works in a schema of its own, so none depends on another's rows.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
import pytest
from conveyor_broker import (
    AckItem,
    DuplicateTask,
    FakeClock,
    LeaseRef,
    NewTask,
    TaskState,
    WebhookWorkerSpec,
)
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.postgres.queries.enqueue import ENQUEUE
from conveyor_broker.postgres.rows import enqueue_params, new_task
from conveyor_broker.testing.schemas import brokers, scratch_schema
from conveyor_testkit.polling import wait_until

pytestmark = pytest.mark.postgres

TTL = timedelta(seconds=30)


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

        await wait_until(blocked)
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
            await conn.fetch(ENQUEUE, *enqueue_params([holder], clock.now()))
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
