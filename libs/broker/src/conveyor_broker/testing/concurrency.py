"""Conformance: concurrency limits per key (HELD tasks and their promotion)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import (
    ConcurrencyLimitNotFound,
    DuplicateTask,
    InvalidState,
    InvalidTask,
)
from conveyor_broker.interface import Broker
from conveyor_broker.testing.builders import QUEUE, TTL, enqueue
from conveyor_broker.types import (
    ConcurrencyLimit,
    LeaseReapParams,
    NewTask,
    Task,
    TaskEvent,
    TaskState,
)


async def _keyed(broker: Broker, clock: FakeClock, keys: list[str | None]) -> list[Task]:
    """Enqueue one task per key, each a microsecond after the last (lease order)."""
    tasks = []
    for key in keys:
        tasks.append(await enqueue(broker, concurrency_key=key))
        clock.advance(timedelta(microseconds=1))
    return tasks


def _keys(tasks: list[Task]) -> list[str | None]:
    return [t.concurrency_key for t in tasks]


async def _state(broker: Broker, task: Task) -> TaskState:
    return (await broker.get_task(task.id)).state


class ConcurrencyLimitTests:
    """set/list/delete_concurrency_limit, and what lease does under them."""

    async def test_limits_set_replace_list_delete(self, broker: Broker) -> None:
        assert await broker.list_concurrency_limits() == []
        one = await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 1))
        assert one == ConcurrencyLimit(QUEUE, 1, "*")
        vip = await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 5, "vip-*"))
        other = await broker.set_concurrency_limit(ConcurrencyLimit("another", 2))
        assert await broker.list_concurrency_limits() == [other, one, vip]
        assert await broker.list_concurrency_limits(QUEUE) == [one, vip]
        three = await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 3))
        assert await broker.list_concurrency_limits(QUEUE) == [three, vip]
        await broker.delete_concurrency_limit(QUEUE)
        with pytest.raises(ConcurrencyLimitNotFound):
            await broker.delete_concurrency_limit(QUEUE)
        await broker.delete_concurrency_limit(QUEUE, "vip-*")
        assert await broker.list_concurrency_limits() == [other]

    @pytest.mark.parametrize(
        "limit",
        [
            ConcurrencyLimit("bad queue", 1),
            ConcurrencyLimit(QUEUE, 0),
            ConcurrencyLimit(QUEUE, -1),
            ConcurrencyLimit(QUEUE, 2_000_000),
            ConcurrencyLimit(QUEUE, 1.5),  # type: ignore[arg-type]
            ConcurrencyLimit(QUEUE, True),
            ConcurrencyLimit(QUEUE, 1, ""),
            ConcurrencyLimit(QUEUE, 1, "x" * 300),
            ConcurrencyLimit(QUEUE, 1, "a\x00"),
        ],
    )
    async def test_a_bad_limit_is_refused_and_the_stored_one_kept(
        self, broker: Broker, limit: ConcurrencyLimit
    ) -> None:
        stored = await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 2))
        with pytest.raises(InvalidTask):
            await broker.set_concurrency_limit(limit)
        assert await broker.list_concurrency_limits() == [stored]

    async def test_a_queue_without_limits_leases_keyed_tasks_freely(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit("another", 1))
        await _keyed(broker, clock, ["a", "a", "a"])
        assert len(await broker.lease(QUEUE, 10, TTL)) == 3

    async def test_lease_holds_what_is_over_the_limit_and_serves_other_keys(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 2))
        keys: list[str | None] = [*(["hot"] * 6), "a", None, "b", "a", "a"]
        tasks = await _keyed(broker, clock, keys)
        leased = await broker.lease(QUEUE, 100, TTL)
        # Lease order, the hot key's third and later tasks (and the third "a") parked.
        assert _keys(leased) == ["hot", "hot", "a", None, "b", "a"]
        held = [t for t in tasks if t.id not in {x.id for x in leased}]
        assert _keys(held) == ["hot"] * 4 + ["a"]
        for task in held:
            assert await _state(broker, task) == TaskState.HELD
        stats = (await broker.queue_stats(QUEUE))[0]
        assert stats.count(TaskState.HELD) == 5
        assert stats.count(TaskState.ACTIVE) == 6
        # Held tasks are not due: nothing more is leased while the keys are full.
        assert await broker.lease(QUEUE, 100, TTL) == []

    async def test_the_limit_counts_tasks_leased_in_one_call_and_across_calls(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 1))
        await _keyed(broker, clock, ["k", "k"])
        assert len(await broker.lease(QUEUE, 1, TTL)) == 1
        await _keyed(broker, clock, ["k"])
        assert await broker.lease(QUEUE, 10, TTL) == []
        assert (await broker.queue_stats(QUEUE))[0].count(TaskState.HELD) == 2

    async def test_a_lease_wanting_few_parks_a_hot_key_and_reaches_the_rest(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 1))
        await broker.enqueue_batch(
            [NewTask(queue=QUEUE, type="t", concurrency_key="hot") for _ in range(500)]
        )
        clock.advance(timedelta(seconds=1))
        await _keyed(broker, clock, ["cold-1", "cold-2"])
        first = await broker.lease(QUEUE, 2, TTL)
        assert _keys(first) == ["hot", "cold-1"]
        second = await broker.lease(QUEUE, 2, TTL)
        assert _keys(second) == ["cold-2"]

    @pytest.mark.parametrize("outcome", ["ack", "fail", "release", "archive", "cancel"])
    async def test_a_key_with_room_again_gets_its_oldest_held_task_back(
        self, broker: Broker, clock: FakeClock, outcome: str
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 1))
        first, second, third = await _keyed(broker, clock, ["k", "k", "k"])
        (running,) = await broker.lease(QUEUE, 10, TTL)
        assert running.id == first.id
        assert running.lease_id is not None
        if outcome == "ack":
            await broker.ack(running.id, running.lease_id)
        elif outcome == "fail":
            await broker.fail(running.id, running.lease_id, "boom", timedelta(minutes=5))
        elif outcome == "release":
            await broker.release(running.id, running.lease_id)
        elif outcome == "archive":
            await broker.archive(running.id, running.lease_id, "no")
        else:
            await broker.cancel_task(running.id)
        # The key's next lease gives its HELD tasks their turn (not the outcome itself).
        assert await _state(broker, second) == TaskState.HELD
        leased = await broker.lease(QUEUE, 10, TTL)
        # A released task is due again from now: behind the held ones, it waits too.
        assert [t.id for t in leased] == [second.id]
        assert await _state(broker, third) == TaskState.HELD
        if outcome == "release":
            assert await _state(broker, first) == TaskState.HELD

    async def test_a_reaped_lease_frees_its_keys_slot(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 1))
        first, second = await _keyed(broker, clock, ["k", "k"])
        assert [t.id for t in await broker.lease(QUEUE, 10, TTL)] == [first.id]
        clock.advance(TTL + timedelta(seconds=1))
        reaped = await broker.reap_expired_leases(LeaseReapParams(retry_delay=timedelta(minutes=1)))
        assert [r.task_id for r in reaped] == [first.id]
        assert [t.id for t in await broker.lease(QUEUE, 10, TTL)] == [second.id]

    async def test_patterns_pick_the_longest_match_and_unmatched_keys_are_free(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 1, "cust-*"))
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 2, "cust-vip-*"))
        await _keyed(
            broker,
            clock,
            ["cust-1", "cust-1", "cust-vip-1", "cust-vip-1", "cust-vip-1", "x", "x"],
        )
        leased = await broker.lease(QUEUE, 100, TTL)
        assert _keys(leased) == ["cust-1", "cust-vip-1", "cust-vip-1", "x", "x"]

    async def test_raising_or_deleting_a_limit_releases_held_tasks(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 1))
        tasks = await _keyed(broker, clock, ["k"] * 5)
        assert len(await broker.lease(QUEUE, 10, TTL)) == 1
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 3))
        assert [await _state(broker, t) for t in tasks[1:]] == [
            TaskState.PENDING,
            TaskState.PENDING,
            TaskState.HELD,
            TaskState.HELD,
        ]
        assert [t.id for t in await broker.lease(QUEUE, 10, TTL)] == [t.id for t in tasks[1:3]]
        await broker.delete_concurrency_limit(QUEUE)
        assert [t.id for t in await broker.lease(QUEUE, 10, TTL)] == [t.id for t in tasks[3:]]

    async def test_held_tasks_can_be_canceled_run_now_and_expire(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 1))
        await _keyed(broker, clock, ["k"])
        expiring = await enqueue(
            broker, concurrency_key="k", expires_at=clock.now() + timedelta(seconds=5)
        )
        canceled, forced = await _keyed(broker, clock, ["k", "k"])
        assert len(await broker.lease(QUEUE, 10, TTL)) == 1
        assert (await broker.cancel_task(canceled.id)).state == TaskState.CANCELED
        assert (await broker.run_task_now(forced.id)).state == TaskState.PENDING
        with pytest.raises(InvalidState):
            await broker.reschedule_task(expiring.id, clock.now() + timedelta(hours=1))
        clock.advance(timedelta(seconds=10))
        expired = await broker.archive_expired()
        assert [t.id for t in expired] == [expiring.id]
        # Run now makes it due; the key is still full, so the lease holds it again.
        assert await broker.lease(QUEUE, 10, TTL) == []
        assert await _state(broker, forced) == TaskState.HELD

    async def test_a_held_task_keeps_its_unique_claim(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 1))
        await _keyed(broker, clock, ["k"])
        claimed = await enqueue(broker, concurrency_key="k", unique_key="u1")
        assert len(await broker.lease(QUEUE, 10, TTL)) == 1
        assert await _state(broker, claimed) == TaskState.HELD
        with pytest.raises(DuplicateTask):
            await broker.enqueue(NewTask(queue=QUEUE, type="t", unique_key="u1"))

    async def test_parking_and_promotion_are_events(self, broker: Broker, clock: FakeClock) -> None:
        events: list[TaskEvent] = []
        broker.set_event_sink(events.append)
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 1))
        _first, second = await _keyed(broker, clock, ["k", "k"])
        (running,) = await broker.lease(QUEUE, 10, TTL)
        assert running.lease_id is not None
        await broker.ack(running.id, running.lease_id)
        assert [t.id for t in await broker.lease(QUEUE, 10, TTL)] == [second.id]
        moves = [(e.task_id, e.previous_state, e.state) for e in events if e.task_id == second.id]
        assert (second.id, TaskState.PENDING, TaskState.HELD) in moves
        assert (second.id, TaskState.HELD, TaskState.PENDING) in moves
        assert moves[-1] == (second.id, TaskState.PENDING, TaskState.ACTIVE)

    async def test_concurrent_leases_never_exceed_the_limit(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 2))
        await broker.enqueue_batch(
            [NewTask(queue=QUEUE, type="t", concurrency_key=f"k{i % 3}") for i in range(60)]
        )
        batches = await asyncio.gather(*(broker.lease(QUEUE, 5, TTL) for _ in range(8)))
        leased = [t for batch in batches for t in batch]
        per_key: dict[str | None, int] = {}
        for task in leased:
            per_key[task.concurrency_key] = per_key.get(task.concurrency_key, 0) + 1
        assert per_key == {"k0": 2, "k1": 2, "k2": 2}
