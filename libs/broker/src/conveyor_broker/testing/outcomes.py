"""Conformance: ack, ack_batch, fail, release, archive, and LeaseLost on every one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import InvalidTask, LeaseLost
from conveyor_broker.interface import MAX_BATCH, Broker
from conveyor_broker.testing.builders import (
    QUEUE,
    TTL,
    enqueue,
    enqueue_and_lease,
    lease_one,
    new_task,
    unused_id,
)
from conveyor_broker.types import AckItem, LeaseRef, Task, TaskState
from conveyor_broker.validation import MAX_ERROR_LEN

#: Puts a leased task somewhere its lease no longer works; returns the lease id to try.
LoseLease = Callable[[Broker, FakeClock, Task], Awaitable[str]]


async def _wrong_lease_id(broker: Broker, clock: FakeClock, task: Task) -> str:
    return unused_id(clock)


async def _after_reap(broker: Broker, clock: FakeClock, task: Task) -> str:
    clock.advance(TTL)
    assert [r.task_id for r in await broker.reap_expired_leases()] == [task.id]
    return task.lease_id or ""


async def _after_release(broker: Broker, clock: FakeClock, task: Task) -> str:
    await broker.release(task.id, task.lease_id or "")
    return task.lease_id or ""


async def _after_cancel(broker: Broker, clock: FakeClock, task: Task) -> str:
    await broker.cancel_task(task.id)
    return task.lease_id or ""


async def _after_release_and_release(broker: Broker, clock: FakeClock, task: Task) -> str:
    # The task is ACTIVE again under a new lease: the old one must still be lost.
    await broker.release(task.id, task.lease_id or "")
    again = await lease_one(broker)
    assert again.id == task.id
    return task.lease_id or ""


_LOSE_LEASE: dict[str, LoseLease] = {
    "wrong-lease-id": _wrong_lease_id,
    "after-reap": _after_reap,
    "after-release": _after_release,
    "after-cancel": _after_cancel,
    "after-re-lease": _after_release_and_release,
}


class OutcomeTests:
    """ack, ack_batch, fail, release, archive."""

    async def test_ack_completes(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue_and_lease(broker)
        clock.advance(timedelta(seconds=2))
        done = await broker.ack(task.id, task.lease_id or "", b"result")
        now = clock.now()
        assert done.state == TaskState.COMPLETED
        assert done.result == b"result"
        assert done.completed_at == now
        assert done.updated_at == now
        assert done.lease_id is None
        assert done.lease_expires_at is None
        assert done.started_at == task.started_at
        assert await broker.get_task(task.id) == done

    async def test_ack_without_result(self, broker: Broker) -> None:
        task = await enqueue_and_lease(broker)
        done = await broker.ack(task.id, task.lease_id or "")
        assert done.result is None

    async def test_ack_twice_loses_the_lease(self, broker: Broker) -> None:
        task = await enqueue_and_lease(broker)
        await broker.ack(task.id, task.lease_id or "")
        with pytest.raises(LeaseLost) as caught:
            await broker.ack(task.id, task.lease_id or "")
        assert caught.value.task_id == task.id
        assert caught.value.lease_id == task.lease_id

    async def test_ack_after_lease_expiry_but_before_reap(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue_and_lease(broker)
        clock.advance(TTL * 2)
        done = await broker.ack(task.id, task.lease_id or "")
        assert done.state == TaskState.COMPLETED
        assert await broker.reap_expired_leases() == []

    async def test_ack_batch_skips_lost_items(self, broker: Broker, clock: FakeClock) -> None:
        await broker.enqueue_batch([new_task() for _ in range(3)])
        one, two, three = await broker.lease(QUEUE, 3, TTL)
        done = await broker.ack_batch(
            [
                AckItem(one.id, one.lease_id or "", b"r1"),
                AckItem(two.id, unused_id(clock)),
                AckItem(three.id, three.lease_id or ""),
                AckItem(unused_id(clock), unused_id(clock)),
                AckItem(one.id, one.lease_id or "", b"again"),
            ]
        )
        assert done == [True, False, True, False, False]
        assert (await broker.get_task(one.id)).result == b"r1"
        assert (await broker.get_task(two.id)).state == TaskState.ACTIVE
        assert (await broker.get_task(three.id)).state == TaskState.COMPLETED

    async def test_ack_batch_rejects_bad_input(self, broker: Broker) -> None:
        task = await enqueue_and_lease(broker)
        item = AckItem(task.id, task.lease_id or "")
        assert await broker.ack_batch([]) == []
        with pytest.raises(InvalidTask):
            await broker.ack_batch([item] * (MAX_BATCH + 1))
        with pytest.raises(InvalidTask):
            await broker.ack_batch([item, AckItem("bad-id", "x")])
        assert (await broker.get_task(task.id)).state == TaskState.ACTIVE

    async def test_fail_schedules_a_retry(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue_and_lease(broker, max_retry=3)
        failed = await broker.fail(task.id, task.lease_id or "", "boom", timedelta(seconds=10))
        now = clock.now()
        assert failed.state == TaskState.RETRY
        assert failed.retried == 1
        assert failed.last_error == "boom"
        assert failed.available_at == now + timedelta(seconds=10)
        assert failed.lease_id is None
        assert failed.lease_expires_at is None
        assert failed.completed_at is None
        assert await broker.get_task(task.id) == failed

    async def test_retry_is_leased_after_its_backoff(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue_and_lease(broker, max_retry=3)
        await broker.fail(task.id, task.lease_id or "", "boom", timedelta(seconds=10))
        clock.advance(timedelta(seconds=9))
        assert await broker.lease(QUEUE, 1, TTL) == []
        assert await broker.pending_count() == {}
        clock.advance(timedelta(seconds=1))
        again = await lease_one(broker)
        assert again.id == task.id
        assert again.retried == 1
        assert again.last_error == "boom"

    async def test_exhausted_retries_archive(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue_and_lease(broker, max_retry=1)
        await broker.fail(task.id, task.lease_id or "", "first", timedelta(0))
        again = await lease_one(broker)
        clock.advance(timedelta(seconds=1))
        archived = await broker.fail(again.id, again.lease_id or "", "second", timedelta(0))
        assert archived.state == TaskState.ARCHIVED
        assert archived.retried == 2
        assert archived.last_error == "second"
        assert archived.completed_at == clock.now()
        assert archived.lease_id is None
        assert await broker.lease(QUEUE, 1, TTL) == []

    async def test_max_retry_zero_archives_on_first_failure(self, broker: Broker) -> None:
        task = await enqueue_and_lease(broker, max_retry=0)
        failed = await broker.fail(task.id, task.lease_id or "", "once", timedelta(0))
        assert failed.state == TaskState.ARCHIVED
        assert failed.retried == 1

    async def test_skip_retry_archives(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue_and_lease(broker, max_retry=5)
        failed = await broker.fail(
            task.id, task.lease_id or "", "fatal", timedelta(seconds=5), skip_retry=True
        )
        assert failed.state == TaskState.ARCHIVED
        assert failed.retried == 1
        assert failed.last_error == "fatal"
        assert failed.completed_at == clock.now()

    async def test_fail_keeps_progress(self, broker: Broker) -> None:
        task = await enqueue_and_lease(broker)
        await broker.set_progress(task.id, task.lease_id or "", b"half")
        failed = await broker.fail(task.id, task.lease_id or "", "boom", timedelta(0))
        assert failed.progress == b"half"

    async def test_any_error_text_is_stored_mended(self, broker: Broker) -> None:
        # Error texts come from workers and endpoints: whatever they hold, the outcome is
        # stored; a NUL (which Postgres cannot store) or a lone surrogate becomes U+FFFD.
        task = await enqueue_and_lease(broker, max_retry=1)
        failed = await broker.fail(task.id, task.lease_id or "", "a\x00b\ud800c\n", timedelta(0))
        assert failed.last_error == "a\ufffdb\ufffdc\n"
        assert (await broker.get_task(task.id)).last_error == failed.last_error
        leased = await lease_one(broker)
        archived = await broker.archive(leased.id, leased.lease_id or "", "x" * 10_000 + "\x00")
        assert archived.last_error == "x" * (MAX_ERROR_LEN - 3) + "..."
        assert (await broker.get_task(task.id)).last_error == archived.last_error

    async def test_fail_rejects_a_negative_delay(self, broker: Broker) -> None:
        task = await enqueue_and_lease(broker)
        with pytest.raises(InvalidTask):
            await broker.fail(task.id, task.lease_id or "", "boom", timedelta(seconds=-1))
        assert (await broker.get_task(task.id)).state == TaskState.ACTIVE

    async def test_release_gives_the_task_back(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue_and_lease(broker, max_retry=1)
        await broker.fail(task.id, task.lease_id or "", "boom", timedelta(0))
        leased = await lease_one(broker)
        clock.advance(timedelta(seconds=7))
        released = await broker.release(leased.id, leased.lease_id or "")
        assert released.state == TaskState.PENDING
        assert released.available_at == clock.now()
        assert released.retried == 1
        assert released.last_error == "boom"
        assert released.lease_id is None
        assert released.lease_expires_at is None
        assert (await lease_one(broker)).id == task.id

    async def test_archive_ends_the_task(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue_and_lease(broker, max_retry=5)
        archived = await broker.archive(task.id, task.lease_id or "", "bad input")
        assert archived.state == TaskState.ARCHIVED
        assert archived.last_error == "bad input"
        assert archived.retried == 0
        assert archived.completed_at == clock.now()
        assert archived.lease_id is None

    async def test_lease_scoped_methods_reject_a_malformed_task_id(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        lease_id = unused_id(clock)
        with pytest.raises(InvalidTask):
            await broker.ack("nope", lease_id)
        with pytest.raises(InvalidTask):
            await broker.fail("nope", lease_id, "e", timedelta(0))
        with pytest.raises(InvalidTask):
            await broker.release("nope", lease_id)
        with pytest.raises(InvalidTask):
            await broker.archive("nope", lease_id, "e")
        with pytest.raises(InvalidTask):
            await broker.set_progress("nope", lease_id, b"")

    @pytest.mark.parametrize("lose", list(_LOSE_LEASE.values()), ids=list(_LOSE_LEASE))
    async def test_every_lease_scoped_method_raises_lease_lost(
        self, broker: Broker, clock: FakeClock, lose: LoseLease
    ) -> None:
        task = await enqueue_and_lease(broker, max_retry=5)
        lease_id = await lose(broker, clock, task)
        before = await broker.get_task(task.id)
        with pytest.raises(LeaseLost):
            await broker.extend_lease(task.id, lease_id, TTL)
        with pytest.raises(LeaseLost):
            await broker.set_progress(task.id, lease_id, b"p")
        with pytest.raises(LeaseLost):
            await broker.ack(task.id, lease_id, b"r")
        with pytest.raises(LeaseLost):
            await broker.fail(task.id, lease_id, "e", timedelta(0))
        with pytest.raises(LeaseLost):
            await broker.release(task.id, lease_id)
        with pytest.raises(LeaseLost):
            await broker.archive(task.id, lease_id, "e")
        ref = LeaseRef(task.id, lease_id)
        assert await broker.extend_leases([ref], TTL) == [ref]
        assert await broker.ack_batch([AckItem(task.id, lease_id)]) == [False]
        assert await broker.get_task(task.id) == before

    async def test_unknown_task_is_lease_lost(self, broker: Broker, clock: FakeClock) -> None:
        task_id, lease_id = unused_id(clock), unused_id(clock)
        with pytest.raises(LeaseLost):
            await broker.ack(task_id, lease_id)
        with pytest.raises(LeaseLost):
            await broker.fail(task_id, lease_id, "e", timedelta(0))

    async def test_waiting_task_has_no_lease(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue(broker)
        with pytest.raises(LeaseLost):
            await broker.ack(task.id, unused_id(clock))
