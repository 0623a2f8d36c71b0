"""Conformance: the maintenance sweeps and pending_count."""

from __future__ import annotations

from datetime import timedelta

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import InvalidTask, TaskNotFound
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
)
from conveyor_broker.types import EXPIRED_ERROR, LEASE_EXPIRED_ERROR, ReapedTask, TaskState

_DAY = timedelta(days=1)


class SweepTests:
    """reap_expired_leases, promote_scheduled, purge_terminal, archive_expired,
    pending_count."""

    async def test_reap_returns_expired_leases_to_retry(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue_and_lease(broker, max_retry=3)
        clock.advance(TTL - timedelta(seconds=1))
        assert await broker.reap_expired_leases() == []
        clock.advance(timedelta(seconds=1))
        reaped = await broker.reap_expired_leases(retry_delay=timedelta(seconds=5))
        assert reaped == [ReapedTask(task_id=task.id, queue=QUEUE, state=TaskState.RETRY)]
        stored = await broker.get_task(task.id)
        assert stored.state == TaskState.RETRY
        assert stored.retried == 1
        assert stored.last_error == LEASE_EXPIRED_ERROR
        assert stored.available_at == clock.now() + timedelta(seconds=5)
        assert stored.lease_id is None
        assert stored.lease_expires_at is None
        assert await broker.reap_expired_leases() == []

    async def test_reap_archives_when_exhausted(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue_and_lease(broker, max_retry=0)
        clock.advance(TTL)
        reaped = await broker.reap_expired_leases()
        assert reaped == [ReapedTask(task_id=task.id, queue=QUEUE, state=TaskState.ARCHIVED)]
        stored = await broker.get_task(task.id)
        assert stored.state == TaskState.ARCHIVED
        assert stored.completed_at == clock.now()
        assert stored.last_error == LEASE_EXPIRED_ERROR

    async def test_reap_takes_the_oldest_expiry_first(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.enqueue_batch([new_task() for _ in range(3)])
        early = await broker.lease(QUEUE, 1, TTL)
        late = await broker.lease(QUEUE, 2, TTL * 2)
        clock.advance(TTL * 2)
        first = await broker.reap_expired_leases(limit=1)
        assert [r.task_id for r in first] == [early[0].id]
        rest = await broker.reap_expired_leases(limit=5)
        assert sorted(r.task_id for r in rest) == sorted(t.id for t in late)

    async def test_reaped_task_is_leased_again(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue_and_lease(broker)
        clock.advance(TTL)
        await broker.reap_expired_leases()
        again = await lease_one(broker)
        assert again.id == task.id
        assert again.lease_id != task.lease_id

    async def test_reap_rejects_bad_input(self, broker: Broker) -> None:
        with pytest.raises(InvalidTask):
            await broker.reap_expired_leases(limit=0)
        with pytest.raises(InvalidTask):
            await broker.reap_expired_leases(limit=MAX_BATCH + 1)
        with pytest.raises(InvalidTask):
            await broker.reap_expired_leases(retry_delay=timedelta(seconds=-1))

    async def test_promote_scheduled(self, broker: Broker, clock: FakeClock) -> None:
        now = clock.now()
        soon = await enqueue(broker, process_at=now + timedelta(seconds=5))
        await enqueue(broker, OTHER_QUEUE, process_at=now + timedelta(seconds=5))
        await enqueue(broker, OTHER_QUEUE, process_at=now + timedelta(seconds=3))
        later = await enqueue(broker, process_at=now + timedelta(seconds=60))
        clock.advance(timedelta(seconds=4))
        assert await broker.promote_scheduled() == {OTHER_QUEUE: 1}
        clock.advance(timedelta(seconds=1))
        assert await broker.promote_scheduled() == {QUEUE: 1, OTHER_QUEUE: 1}
        assert await broker.promote_scheduled() == {}
        promoted = await broker.get_task(soon.id)
        assert promoted.state == TaskState.PENDING
        assert promoted.available_at == now + timedelta(seconds=5)
        assert (await broker.get_task(later.id)).state == TaskState.SCHEDULED

    async def test_promote_respects_limit_oldest_first(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        now = clock.now()
        first = await enqueue(broker, process_at=now + timedelta(seconds=1))
        await enqueue(broker, process_at=now + timedelta(seconds=2))
        clock.advance(timedelta(seconds=2))
        assert await broker.promote_scheduled(limit=1) == {QUEUE: 1}
        assert (await broker.get_task(first.id)).state == TaskState.PENDING
        assert await broker.promote_scheduled(limit=1) == {QUEUE: 1}
        with pytest.raises(InvalidTask):
            await broker.promote_scheduled(limit=0)

    async def test_purge_completed_after_default_retention(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue_and_lease(broker)
        await broker.ack(task.id, task.lease_id or "")
        clock.advance(timedelta(seconds=59))
        assert await broker.purge_terminal(archive_retention=_DAY, default_retention=_DAY) == 0
        assert await broker.purge_terminal(archive_retention=_DAY) == 1
        with pytest.raises(TaskNotFound):
            await broker.get_task(task.id)

    async def test_purge_honours_per_task_retention(self, broker: Broker, clock: FakeClock) -> None:
        kept = await enqueue(broker, retention=timedelta(hours=2))
        zero = await enqueue(broker, retention=timedelta(0))
        default = await enqueue(broker)
        for _ in range(3):
            task = await lease_one(broker)
            await broker.ack(task.id, task.lease_id or "")
        assert await broker.purge_terminal(archive_retention=_DAY, default_retention=_DAY) == 1
        with pytest.raises(TaskNotFound):
            await broker.get_task(zero.id)
        clock.advance(timedelta(hours=2))
        assert await broker.purge_terminal(archive_retention=_DAY, default_retention=_DAY) == 1
        with pytest.raises(TaskNotFound):
            await broker.get_task(kept.id)
        assert (await broker.get_task(default.id)).state == TaskState.COMPLETED

    async def test_purge_archived_and_canceled_by_archive_retention(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        archived = await enqueue(broker, retention=timedelta(0))
        await broker.archive_task(archived.id)
        canceled = await enqueue(broker, retention=timedelta(0))
        await broker.cancel_task(canceled.id)
        waiting = await enqueue(broker, process_at=clock.now() + timedelta(hours=1))
        active = await enqueue_and_lease(broker)
        clock.advance(timedelta(hours=2))
        assert await broker.purge_terminal(archive_retention=timedelta(hours=3)) == 0
        clock.advance(timedelta(hours=1))
        assert await broker.purge_terminal(archive_retention=timedelta(hours=3)) == 2
        remaining = {t.id for t in (await broker.list_tasks()).tasks}
        assert remaining == {waiting.id, active.id}

    async def test_purge_respects_limit_and_rejects_bad_input(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        for _ in range(3):
            task = await enqueue(broker)
            await broker.cancel_task(task.id)
        assert await broker.purge_terminal(archive_retention=timedelta(0), limit=2) == 2
        assert await broker.purge_terminal(archive_retention=timedelta(0), limit=2) == 1
        with pytest.raises(InvalidTask):
            await broker.purge_terminal(archive_retention=timedelta(seconds=-1))
        with pytest.raises(InvalidTask):
            await broker.purge_terminal(
                archive_retention=_DAY, default_retention=timedelta(seconds=-1)
            )
        with pytest.raises(InvalidTask):
            await broker.purge_terminal(archive_retention=_DAY, limit=0)

    async def test_archive_expired(self, broker: Broker, clock: FakeClock) -> None:
        now = clock.now()
        expires = now + timedelta(seconds=10)
        pending = await enqueue(broker, expires_at=expires)
        scheduled = await enqueue(broker, expires_at=expires, process_at=now + _DAY)
        grouped = await enqueue(broker, expires_at=expires, group="g")
        running = await enqueue_and_lease(broker, OTHER_QUEUE, expires_at=expires)
        fresh = await enqueue(broker, expires_at=now + timedelta(seconds=11))
        clock.advance(timedelta(seconds=9))
        assert await broker.archive_expired() == []
        clock.advance(timedelta(seconds=1))
        archived = await broker.archive_expired()
        assert {t.id for t in archived} == {pending.id, scheduled.id, grouped.id}
        for task in archived:
            assert task.state == TaskState.ARCHIVED
            assert task.last_error == EXPIRED_ERROR
            assert task.completed_at == clock.now()
            assert await broker.get_task(task.id) == task
        assert (await broker.get_task(running.id)).state == TaskState.ACTIVE
        assert (await broker.get_task(fresh.id)).state == TaskState.PENDING
        assert await broker.archive_expired() == []

    async def test_archive_expired_takes_retry_tasks_and_honours_limit(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        now = clock.now()
        first = await enqueue_and_lease(broker, expires_at=now + timedelta(seconds=5))
        await broker.fail(first.id, first.lease_id or "", "boom", timedelta(hours=1))
        second = await enqueue(broker, expires_at=now + timedelta(seconds=6))
        clock.advance(timedelta(seconds=6))
        assert [t.id for t in await broker.archive_expired(limit=1)] == [first.id]
        assert [t.id for t in await broker.archive_expired(limit=1)] == [second.id]
        with pytest.raises(InvalidTask):
            await broker.archive_expired(limit=MAX_BATCH + 1)

    async def test_pending_count(self, broker: Broker, clock: FakeClock) -> None:
        now = clock.now()
        assert await broker.pending_count() == {}
        await broker.enqueue_batch([new_task(), new_task(), new_task(OTHER_QUEUE)])
        await enqueue(broker, process_at=now + timedelta(seconds=5))
        await enqueue(broker, expires_at=now + timedelta(seconds=1))
        await enqueue(broker, group="g")
        await enqueue_and_lease(broker, "third")
        assert await broker.pending_count() == {QUEUE: 3, OTHER_QUEUE: 1}
        assert await broker.pending_count(OTHER_QUEUE) == {OTHER_QUEUE: 1}
        assert await broker.pending_count("third") == {}
        clock.advance(timedelta(seconds=1))
        assert await broker.pending_count(QUEUE) == {QUEUE: 2}
        with pytest.raises(InvalidTask):
            await broker.pending_count("not a queue")

    async def test_pending_count_includes_due_retries(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        a, b = sorted_ids(clock, 2)
        await broker.enqueue_batch([new_task(id=a), new_task(id=b)])
        for task in await broker.lease(QUEUE, 2, TTL):
            delay = timedelta(0) if task.id == a else timedelta(seconds=30)
            await broker.fail(task.id, task.lease_id or "", "boom", delay)
        assert await broker.pending_count() == {QUEUE: 1}
