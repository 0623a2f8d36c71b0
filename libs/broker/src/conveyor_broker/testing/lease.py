"""Conformance: lease, extend_lease(s), set_progress, and concurrent leasing."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import InvalidTask, LeaseLost
from conveyor_broker.ids import is_ulid
from conveyor_broker.interface import MAX_BATCH, Broker
from conveyor_broker.testing.builders import (
    OTHER_QUEUE,
    QUEUE,
    TTL,
    enqueue,
    enqueue_and_lease,
    lease_one,
    new_task,
    sorted_ids,
    unused_id,
)
from conveyor_broker.types import LeaseRef, TaskState


class LeaseTests:
    """lease, extend_lease, extend_leases, set_progress."""

    async def test_lease_makes_the_task_active(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue(broker)
        clock.advance(timedelta(seconds=3))
        [leased] = await broker.lease(QUEUE, 10, TTL)
        now = clock.now()
        assert leased.id == task.id
        assert leased.state == TaskState.ACTIVE
        assert leased.lease_id is not None
        assert is_ulid(leased.lease_id)
        assert leased.lease_expires_at == now + TTL
        assert leased.started_at == now
        assert leased.updated_at == now
        assert leased.retried == 0
        assert await broker.get_task(task.id) == leased

    async def test_lease_order_is_available_at_then_id(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        now = clock.now()
        a, b, c, d = sorted_ids(clock, 4)
        await broker.enqueue_batch(
            [
                new_task(id=d, process_at=now - timedelta(seconds=1)),
                new_task(id=c),
                new_task(id=b, process_at=now - timedelta(seconds=3)),
                new_task(id=a),
            ]
        )
        first = await broker.lease(QUEUE, 3, TTL)
        assert [t.id for t in first] == [b, d, a]
        assert [t.id for t in await broker.lease(QUEUE, 3, TTL)] == [c]

    async def test_lease_respects_limit(self, broker: Broker) -> None:
        await broker.enqueue_batch([new_task() for _ in range(5)])
        assert len(await broker.lease(QUEUE, 2, TTL)) == 2
        assert len(await broker.lease(QUEUE, 10, TTL)) == 3
        assert await broker.lease(QUEUE, 10, TTL) == []

    async def test_lease_only_takes_the_named_queue(self, broker: Broker) -> None:
        other = await enqueue(broker, OTHER_QUEUE)
        assert await broker.lease(QUEUE, 10, TTL) == []
        assert [t.id for t in await broker.lease(OTHER_QUEUE, 10, TTL)] == [other.id]

    async def test_lease_skips_tasks_not_yet_due(self, broker: Broker, clock: FakeClock) -> None:
        later = clock.now() + timedelta(minutes=1)
        await enqueue(broker, process_at=later)
        await enqueue(broker, group="g")
        dep = await enqueue(broker, OTHER_QUEUE)
        await enqueue(broker, depends_on=(dep.id,))
        assert await broker.lease(QUEUE, 10, TTL) == []

    async def test_lease_skips_expired_tasks(self, broker: Broker, clock: FakeClock) -> None:
        expiring = await enqueue(broker, expires_at=clock.now() + timedelta(seconds=10))
        clock.advance(timedelta(seconds=10))
        keeper = await enqueue(broker, expires_at=clock.now() + timedelta(seconds=1))
        assert [t.id for t in await broker.lease(QUEUE, 10, TTL)] == [keeper.id]
        assert (await broker.get_task(expiring.id)).state == TaskState.PENDING

    async def test_leased_task_is_not_leased_again(self, broker: Broker, clock: FakeClock) -> None:
        await enqueue_and_lease(broker)
        clock.advance(TTL * 2)  # even past its lease expiry, until reaped
        assert await broker.lease(QUEUE, 10, TTL) == []

    async def test_lease_ignores_the_pause_flag(self, broker: Broker) -> None:
        task = await enqueue(broker)
        await broker.set_queue_paused(QUEUE, True)
        assert [t.id for t in await broker.lease(QUEUE, 1, TTL)] == [task.id]

    async def test_each_lease_gets_a_new_lease_id(self, broker: Broker) -> None:
        first = await enqueue_and_lease(broker)
        await broker.release(first.id, first.lease_id or "")
        second = await lease_one(broker)
        assert second.id == first.id
        assert second.lease_id != first.lease_id

    async def test_lease_clears_progress_of_the_previous_attempt(self, broker: Broker) -> None:
        task = await enqueue_and_lease(broker)
        await broker.set_progress(task.id, task.lease_id or "", b"50%")
        await broker.release(task.id, task.lease_id or "")
        assert (await broker.get_task(task.id)).progress == b"50%"
        again = await lease_one(broker)
        assert again.progress is None

    @pytest.mark.parametrize(
        ("queue", "limit", "ttl"),
        [
            ("bad queue", 1, TTL),
            (QUEUE, 0, TTL),
            (QUEUE, MAX_BATCH + 1, TTL),
            (QUEUE, 1, timedelta(0)),
            (QUEUE, 1, timedelta(seconds=-1)),
        ],
        ids=["bad-queue", "zero-limit", "limit-over-max", "zero-ttl", "negative-ttl"],
    )
    async def test_lease_rejects_bad_input(
        self, broker: Broker, queue: str, limit: int, ttl: timedelta
    ) -> None:
        await enqueue(broker)
        with pytest.raises(InvalidTask):
            await broker.lease(queue, limit, ttl)
        assert (await broker.list_tasks()).tasks[0].state == TaskState.PENDING

    async def test_concurrent_leases_never_share_or_lose_a_task(self, broker: Broker) -> None:
        stored = await broker.enqueue_batch([new_task() for _ in range(60)])
        batches = await asyncio.gather(*(broker.lease(QUEUE, 4, TTL) for _ in range(20)))
        leased = [task.id for batch in batches for task in batch]
        assert len(leased) == len(set(leased)) == 60
        assert set(leased) == {r.task.id for r in stored}
        lease_ids = [task.lease_id for batch in batches for task in batch]
        assert len(set(lease_ids)) == 60

    async def test_lease_many_leases_each_queue_as_lease_would(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        now = clock.now()
        a1, a2, a3, b1 = sorted_ids(clock, 4)
        await broker.enqueue_batch(
            [
                new_task(id=a3, process_at=now - timedelta(seconds=5)),
                new_task(id=a1),
                new_task(id=a2),
                new_task(OTHER_QUEUE, id=b1),
            ]
        )
        clock.advance(timedelta(seconds=1))
        got = await broker.lease_many([(QUEUE, 2), ("empty", 3), (OTHER_QUEUE, 5)], TTL)
        assert [[t.id for t in tasks] for tasks in got] == [[a3, a1], [], [b1]]
        later = clock.now()
        for task in got[0] + got[2]:
            assert task.state == TaskState.ACTIVE
            assert task.lease_id is not None
            assert is_ulid(task.lease_id)
            assert task.lease_expires_at == later + TTL
            assert task.started_at == later
            assert await broker.get_task(task.id) == task
        assert len({t.lease_id for t in got[0] + got[2]}) == 3
        assert [t.id for t in await broker.lease(QUEUE, 5, TTL)] == [a2]
        assert await broker.lease_many([], TTL) == []

    @pytest.mark.parametrize(
        "wants",
        [
            [(QUEUE, 1), (QUEUE, 1)],
            [(QUEUE, 1), ("a b", 1)],
            [(QUEUE, 0)],
            [(QUEUE, MAX_BATCH), (OTHER_QUEUE, 1)],
        ],
        ids=["twice", "bad-queue", "zero-limit", "over-max"],
    )
    async def test_lease_many_rejects_bad_input_and_leases_nothing(
        self, broker: Broker, wants: list[tuple[str, int]]
    ) -> None:
        await enqueue(broker)
        with pytest.raises(InvalidTask):
            await broker.lease_many(wants, TTL)
        with pytest.raises(InvalidTask):
            await broker.lease_many([(QUEUE, 1)], timedelta(0))
        assert (await broker.list_tasks()).tasks[0].state == TaskState.PENDING

    async def test_concurrent_lease_many_never_share_or_lose_a_task(self, broker: Broker) -> None:
        stored = await broker.enqueue_batch(
            [new_task(QUEUE if n % 2 else OTHER_QUEUE) for n in range(60)]
        )
        wants = [(QUEUE, 2), (OTHER_QUEUE, 2)]
        rounds = await asyncio.gather(*(broker.lease_many(wants, TTL) for _ in range(20)))
        leased = [task.id for got in rounds for tasks in got for task in tasks]
        assert len(leased) == len(set(leased)) == 60
        assert set(leased) == {r.task.id for r in stored}

    async def test_extend_lease(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue_and_lease(broker)
        clock.advance(timedelta(seconds=20))
        expires = await broker.extend_lease(task.id, task.lease_id or "", timedelta(minutes=2))
        assert expires == clock.now() + timedelta(minutes=2)
        stored = await broker.get_task(task.id)
        assert stored.lease_expires_at == expires
        assert stored.state == TaskState.ACTIVE
        assert stored.lease_id == task.lease_id
        # The extension keeps the reaper away past the original expiry.
        clock.advance(timedelta(seconds=30))
        assert await broker.reap_expired_leases() == []

    async def test_extend_lease_after_expiry_but_before_reap(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue_and_lease(broker)
        clock.advance(TTL * 3)
        expires = await broker.extend_lease(task.id, task.lease_id or "", TTL)
        assert expires == clock.now() + TTL

    async def test_extend_lease_rejects_bad_input(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue_and_lease(broker)
        with pytest.raises(InvalidTask):
            await broker.extend_lease(task.id, task.lease_id or "", timedelta(0))
        with pytest.raises(InvalidTask):
            await broker.extend_lease("not-an-id", task.lease_id or "", TTL)
        with pytest.raises(LeaseLost):
            await broker.extend_lease(unused_id(clock), task.lease_id or "", TTL)

    async def test_extend_leases_returns_the_lost_ones(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.enqueue_batch([new_task() for _ in range(3)])
        one, two, three = await broker.lease(QUEUE, 3, TTL)
        await broker.ack(two.id, two.lease_id or "")
        refs = [
            LeaseRef(one.id, one.lease_id or ""),
            LeaseRef(two.id, two.lease_id or ""),
            LeaseRef(three.id, unused_id(clock)),
            LeaseRef(unused_id(clock), unused_id(clock)),
        ]
        clock.advance(timedelta(seconds=5))
        lost = await broker.extend_leases(refs, timedelta(minutes=5))
        assert lost == refs[1:]
        assert (await broker.get_task(one.id)).lease_expires_at == clock.now() + timedelta(
            minutes=5
        )
        assert (await broker.get_task(three.id)).lease_expires_at == three.lease_expires_at

    async def test_extend_leases_rejects_bad_input(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue_and_lease(broker)
        ref = LeaseRef(task.id, task.lease_id or "")
        assert await broker.extend_leases([], TTL) == []
        with pytest.raises(InvalidTask):
            await broker.extend_leases([ref], timedelta(0))
        with pytest.raises(InvalidTask):
            await broker.extend_leases([ref] * (MAX_BATCH + 1), TTL)
        with pytest.raises(InvalidTask):
            await broker.extend_leases([ref, LeaseRef("bad", "bad")], timedelta(hours=1))
        # Nothing was extended by the rejected call.
        assert (await broker.get_task(task.id)).lease_expires_at == task.lease_expires_at

    async def test_set_progress(self, broker: Broker) -> None:
        task = await enqueue_and_lease(broker)
        await broker.set_progress(task.id, task.lease_id or "", b"1/3")
        await broker.set_progress(task.id, task.lease_id or "", b"2/3")
        stored = await broker.get_task(task.id)
        assert stored.progress == b"2/3"
        assert stored.state == TaskState.ACTIVE
