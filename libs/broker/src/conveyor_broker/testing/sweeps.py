"""Conformance: the maintenance sweeps, pending_count and due_queues."""

from __future__ import annotations

from datetime import timedelta

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import BrokerClosed, InvalidTask, TaskNotFound
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
from conveyor_broker.types import (
    EXPIRED_ERROR,
    LEASE_EXPIRED_ERROR,
    LeaseReapParams,
    ReapedTask,
    Task,
    TaskState,
    TerminalPurgeParams,
)

_DAY = timedelta(days=1)


class SweepTests:
    """reap_expired_leases, promote_scheduled, purge_terminal, archive_expired,
    pending_count, due_queues."""

    async def test_reap_returns_expired_leases_to_retry(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue_and_lease(broker, max_retry=3)
        clock.advance(TTL - timedelta(seconds=1))
        assert await broker.reap_expired_leases() == []
        clock.advance(timedelta(seconds=1))
        reaped = await broker.reap_expired_leases(LeaseReapParams(retry_delay=timedelta(seconds=5)))
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
        first = await broker.reap_expired_leases(LeaseReapParams(limit=1))
        assert [r.task_id for r in first] == [early[0].id]
        rest = await broker.reap_expired_leases(LeaseReapParams(limit=5))
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
            await broker.reap_expired_leases(LeaseReapParams(limit=0))
        with pytest.raises(InvalidTask):
            await broker.reap_expired_leases(LeaseReapParams(limit=MAX_BATCH + 1))
        with pytest.raises(InvalidTask):
            await broker.reap_expired_leases(LeaseReapParams(retry_delay=timedelta(seconds=-1)))

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
        assert (
            await broker.purge_terminal(
                TerminalPurgeParams(archive_retention=_DAY, default_retention=_DAY)
            )
            == 0
        )
        assert await broker.purge_terminal(TerminalPurgeParams(archive_retention=_DAY)) == 1
        with pytest.raises(TaskNotFound):
            await broker.get_task(task.id)

    async def test_purge_honours_per_task_retention(self, broker: Broker, clock: FakeClock) -> None:
        kept = await enqueue(broker, retention=timedelta(hours=2))
        zero = await enqueue(broker, retention=timedelta(0))
        default = await enqueue(broker)
        for _ in range(3):
            task = await lease_one(broker)
            await broker.ack(task.id, task.lease_id or "")
        assert (
            await broker.purge_terminal(
                TerminalPurgeParams(archive_retention=_DAY, default_retention=_DAY)
            )
            == 1
        )
        with pytest.raises(TaskNotFound):
            await broker.get_task(zero.id)
        clock.advance(timedelta(hours=2))
        assert (
            await broker.purge_terminal(
                TerminalPurgeParams(archive_retention=_DAY, default_retention=_DAY)
            )
            == 1
        )
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
        assert (
            await broker.purge_terminal(TerminalPurgeParams(archive_retention=timedelta(hours=3)))
            == 0
        )
        clock.advance(timedelta(hours=1))
        assert (
            await broker.purge_terminal(TerminalPurgeParams(archive_retention=timedelta(hours=3)))
            == 2
        )
        remaining = {t.id for t in (await broker.list_tasks()).tasks}
        assert remaining == {waiting.id, active.id}

    async def test_purge_respects_limit_and_rejects_bad_input(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        for _ in range(3):
            task = await enqueue(broker)
            await broker.cancel_task(task.id)
        assert (
            await broker.purge_terminal(
                TerminalPurgeParams(archive_retention=timedelta(0), limit=2)
            )
            == 2
        )
        assert (
            await broker.purge_terminal(
                TerminalPurgeParams(archive_retention=timedelta(0), limit=2)
            )
            == 1
        )
        with pytest.raises(InvalidTask):
            await broker.purge_terminal(
                TerminalPurgeParams(archive_retention=timedelta(seconds=-1))
            )
        with pytest.raises(InvalidTask):
            await broker.purge_terminal(
                TerminalPurgeParams(archive_retention=_DAY, default_retention=timedelta(seconds=-1))
            )
        with pytest.raises(InvalidTask):
            await broker.purge_terminal(TerminalPurgeParams(archive_retention=_DAY, limit=0))

    async def test_purge_takes_the_oldest_purge_time_first_whatever_the_state(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        """Purge order is completed_at plus the retention that applies, then id, across
        COMPLETED rows with and without a retention of their own and ARCHIVED/CANCELED
        rows: not completed_at alone."""
        start = clock.now()

        async def completed(retention: timedelta | None = None) -> Task:
            task = await enqueue_and_lease(broker, retention=retention)
            return await broker.ack(task.id, task.lease_id or "")

        own_late = await completed(retention=timedelta(hours=2))  # goes at 2h
        canceled = await broker.cancel_task((await enqueue(broker)).id)  # 3h
        clock.set(start + timedelta(minutes=30))
        by_default = await completed()  # 1h30
        clock.set(start + timedelta(hours=1))
        own_early = await completed(retention=timedelta(0))  # 1h
        clock.set(start + timedelta(hours=2))
        tied = await completed()  # 3h, like `canceled`, but a later id
        clock.set(start + timedelta(hours=3, minutes=30))
        kept = await completed()  # 4h30
        clock.set(start + timedelta(hours=4))

        async def purge(limit: int) -> set[str]:
            before = {t.id for t in (await broker.list_tasks()).tasks}
            purged = await broker.purge_terminal(
                TerminalPurgeParams(
                    archive_retention=timedelta(hours=3),
                    default_retention=timedelta(hours=1),
                    limit=limit,
                )
            )
            after = {t.id for t in (await broker.list_tasks()).tasks}
            assert purged == len(before - after)
            return before - after

        assert await purge(2) == {own_early.id, by_default.id}
        assert await purge(1) == {own_late.id}
        assert canceled.id < tied.id
        assert await purge(1) == {canceled.id}
        assert await purge(5) == {tied.id}
        assert await purge(5) == set()
        assert (await broker.get_task(kept.id)).state == TaskState.COMPLETED

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

    async def test_due_count_is_capped(self, broker: Broker, clock: FakeClock) -> None:
        now = clock.now()
        assert await broker.due_count(QUEUE, cap=10) == 0
        await enqueue_and_lease(broker)  # leased: not due
        await broker.enqueue_batch([new_task() for _ in range(4)] + [new_task(OTHER_QUEUE)])
        await enqueue(broker, process_at=now + timedelta(seconds=5))
        assert await broker.due_count(QUEUE, cap=10) == 4
        assert await broker.due_count(QUEUE, cap=3) == 3
        assert await broker.due_count(OTHER_QUEUE, cap=3) == 1
        await enqueue(broker, expires_at=now + timedelta(seconds=1))
        assert await broker.due_count(QUEUE, cap=10) == 5
        clock.advance(timedelta(seconds=1))  # expired: not due any more
        assert await broker.due_count(QUEUE, cap=10) == 4
        with pytest.raises(InvalidTask):
            await broker.due_count("not a queue", cap=1)
        with pytest.raises(InvalidTask):
            await broker.due_count(QUEUE, cap=0)

    async def test_pending_count_includes_due_retries(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        a, b = sorted_ids(clock, 2)
        await broker.enqueue_batch([new_task(id=a), new_task(id=b)])
        for task in await broker.lease(QUEUE, 2, TTL):
            delay = timedelta(0) if task.id == a else timedelta(seconds=30)
            await broker.fail(task.id, task.lease_id or "", "boom", delay)
        assert await broker.pending_count() == {QUEUE: 1}

    async def test_due_queues_are_the_queues_with_due_work(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        now = clock.now()
        assert await broker.due_queues() == []
        await enqueue(broker, "q-pending")
        retry = await enqueue_and_lease(broker, "q-retry")
        await broker.fail(retry.id, retry.lease_id or "", "boom", timedelta(0))
        later = await enqueue_and_lease(broker, "q-later")
        await broker.fail(later.id, later.lease_id or "", "boom", timedelta(seconds=30))
        await enqueue(broker, "q-scheduled", process_at=now + timedelta(seconds=5))
        await enqueue(broker, "q-expiring", expires_at=now + timedelta(seconds=1))
        await enqueue(broker, "q-mixed", expires_at=now + timedelta(seconds=1))
        await enqueue(broker, "q-mixed")
        await enqueue_and_lease(broker, "q-active")
        await enqueue(broker, "q-group", group="g")
        done = await enqueue_and_lease(broker, "q-done")
        await broker.ack(done.id, done.lease_id or "")

        due = ["q-expiring", "q-mixed", "q-pending", "q-retry"]
        assert await broker.due_queues() == due
        assert sorted(await broker.pending_count()) == due
        # A queue whose only due-looking rows have expired has nothing to lease.
        clock.advance(timedelta(seconds=1))
        due = ["q-mixed", "q-pending", "q-retry"]
        assert await broker.due_queues() == due
        assert sorted(await broker.pending_count()) == due
        clock.advance(timedelta(seconds=30))
        due = ["q-later", "q-mixed", "q-pending", "q-retry"]
        assert await broker.due_queues() == due
        assert sorted(await broker.pending_count()) == due

    async def test_due_among_picks_the_queues_with_due_work(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        now = clock.now()
        asked = [
            "q-pending",
            "q-retry",
            "q-later",
            "q-scheduled",
            "q-expiring",
            "q-active",
            "q-done",
            "q-empty",
        ]
        assert await broker.due_among(asked) == []
        assert await broker.due_among([]) == []
        await enqueue(broker, "q-pending")
        retry = await enqueue_and_lease(broker, "q-retry")
        await broker.fail(retry.id, retry.lease_id or "", "boom", timedelta(0))
        later = await enqueue_and_lease(broker, "q-later")
        await broker.fail(later.id, later.lease_id or "", "boom", timedelta(seconds=30))
        await enqueue(broker, "q-scheduled", process_at=now + timedelta(seconds=5))
        await enqueue(broker, "q-expiring", expires_at=now + timedelta(seconds=1))
        await enqueue_and_lease(broker, "q-active")
        done = await enqueue_and_lease(broker, "q-done")
        await broker.ack(done.id, done.lease_id or "")
        # Due work in a queue nobody asked about is left out.
        await enqueue(broker, "q-other")

        assert await broker.due_among(asked) == ["q-expiring", "q-pending", "q-retry"]
        # Sorted and each once, whatever order and repetitions the names came in.
        assert await broker.due_among(["q-retry", "q-pending", "q-retry"]) == [
            "q-pending",
            "q-retry",
        ]
        clock.advance(timedelta(seconds=1))
        assert await broker.due_among(asked) == ["q-pending", "q-retry"]
        clock.advance(timedelta(seconds=30))
        assert await broker.due_among(asked) == ["q-later", "q-pending", "q-retry"]
        # The scheduled task is due only once promoted (the scheduler's business).
        await broker.promote_scheduled(limit=10)
        assert await broker.due_among(asked) == ["q-later", "q-pending", "q-retry", "q-scheduled"]

    async def test_due_among_rejects_bad_input(self, broker: Broker) -> None:
        await enqueue(broker)
        for queues in (["not a queue"], [QUEUE, ""], [QUEUE] * (MAX_BATCH + 1)):
            with pytest.raises(InvalidTask):
                await broker.due_among(queues)
        assert await broker.due_among([QUEUE] * MAX_BATCH) == [QUEUE]
        await broker.close()
        with pytest.raises(BrokerClosed):
            await broker.due_among([QUEUE])

    async def test_oldest_due_gives_when_each_queues_first_due_task_fell_due(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        start = clock.now()
        asked = ["q-pending", "q-retry", "q-later", "q-expiring", "q-active", "q-empty"]
        assert await broker.oldest_due(asked) == {}
        assert await broker.oldest_due([]) == {}
        await enqueue(broker, "q-pending")
        clock.advance(timedelta(seconds=2))
        await enqueue(broker, "q-pending")
        retry = await enqueue_and_lease(broker, "q-retry")
        await broker.fail(retry.id, retry.lease_id or "", "boom", timedelta(seconds=1))
        later = await enqueue_and_lease(broker, "q-later")
        await broker.fail(later.id, later.lease_id or "", "boom", timedelta(seconds=30))
        await enqueue(broker, "q-expiring", expires_at=clock.now() + timedelta(seconds=5))
        await enqueue_and_lease(broker, "q-active")
        await enqueue(broker, "q-other")
        mid = clock.now()
        # The oldest due task's due time: the first enqueue, not the second; a retry not
        # yet due is not due.
        assert await broker.oldest_due(asked) == {"q-expiring": mid, "q-pending": start}
        clock.advance(timedelta(seconds=1))
        assert await broker.oldest_due(["q-retry", "q-pending", "q-retry"]) == {
            "q-pending": start,
            "q-retry": mid + timedelta(seconds=1),
        }
        # Expired rows are nothing to lease; the later retry falls due in its turn.
        clock.advance(timedelta(seconds=30))
        assert await broker.oldest_due(asked) == {
            "q-later": mid + timedelta(seconds=30),
            "q-pending": start,
            "q-retry": mid + timedelta(seconds=1),
        }
        # Leased, the first task no longer counts: the second is the oldest.
        await broker.lease("q-pending", 1, TTL)
        found = await broker.oldest_due(asked)
        assert found["q-pending"] == start + timedelta(seconds=2)
        assert set(found) == set(await broker.due_among(asked))
        for queues in (["not a queue"], [QUEUE] * (MAX_BATCH + 1)):
            with pytest.raises(InvalidTask):
                await broker.oldest_due(queues)
        await broker.close()
        with pytest.raises(BrokerClosed):
            await broker.oldest_due([QUEUE])

    async def test_due_queues_pages_by_name(self, broker: Broker, clock: FakeClock) -> None:
        await enqueue(broker, "page-0", process_at=clock.now() + timedelta(hours=1))
        for n in range(1, 6):
            await broker.enqueue_batch([new_task(f"page-{n}") for _ in range(n)])
        assert await broker.due_queues(limit=2) == ["page-1", "page-2"]
        assert await broker.due_queues(after="page-2", limit=2) == ["page-3", "page-4"]
        assert await broker.due_queues(after="page-4", limit=2) == ["page-5"]
        assert await broker.due_queues(after="page-5") == []
        # ``after`` need not name a queue that has tasks.
        assert await broker.due_queues(after="page-25") == ["page-3", "page-4", "page-5"]
        assert await broker.due_queues(after="a", limit=MAX_BATCH) == [
            f"page-{n}" for n in range(1, 6)
        ]

    async def test_due_queues_rejects_bad_input(self, broker: Broker) -> None:
        await enqueue(broker)
        for limit in (0, MAX_BATCH + 1):
            with pytest.raises(InvalidTask):
                await broker.due_queues(limit=limit)
        # ``after`` is a cursor over stored names: any name a broker could hold pages on,
        # but not one no broker could.
        for after in ("", "a\x00", "q" * 1000):
            with pytest.raises(InvalidTask):
                await broker.due_queues(after=after)
        assert await broker.due_queues(after="a queue") == [QUEUE]
        await broker.close()
        with pytest.raises(BrokerClosed):
            await broker.due_queues()
