"""Conformance: the event sink sees every committed state change, in order."""

from __future__ import annotations

from datetime import timedelta

from conveyor_broker.clock import FakeClock
from conveyor_broker.interface import Broker
from conveyor_broker.testing.builders import (
    QUEUE,
    TTL,
    TYPE,
    enqueue,
    enqueue_and_lease,
    new_task,
    sorted_ids,
)
from conveyor_broker.types import (
    EXPIRED_ERROR,
    LEASE_EXPIRED_ERROR,
    TaskEvent,
    TaskState,
)

_Transition = tuple[str, TaskState | None, TaskState | None]


def _recorder(broker: Broker) -> list[TaskEvent]:
    events: list[TaskEvent] = []
    broker.set_event_sink(events.append)
    return events


def _transitions(events: list[TaskEvent]) -> list[_Transition]:
    return [(e.task_id, e.previous_state, e.state) for e in events]


class EventTests:
    """set_event_sink."""

    async def test_enqueue_reports_creation(self, broker: Broker, clock: FakeClock) -> None:
        events = _recorder(broker)
        a, b = sorted_ids(clock, 2)
        await broker.enqueue_batch([new_task(id=a), new_task(id=b, process_at=clock.now() + TTL)])
        assert events == [
            TaskEvent(a, QUEUE, TYPE, TaskState.PENDING, None, clock.now()),
            TaskEvent(b, QUEUE, TYPE, TaskState.SCHEDULED, None, clock.now()),
        ]

    async def test_no_event_for_what_did_not_change(self, broker: Broker) -> None:
        task = await enqueue(broker)
        events = _recorder(broker)
        assert not (await broker.enqueue(new_task(id=task.id))).created
        await broker.run_task_now(task.id)
        leased = await broker.lease(QUEUE, 1, TTL)
        await broker.extend_lease(task.id, leased[0].lease_id or "", TTL)
        await broker.set_progress(task.id, leased[0].lease_id or "", b"p")
        assert _transitions(events) == [(task.id, TaskState.PENDING, TaskState.ACTIVE)]

    async def test_a_task_life_in_order(self, broker: Broker, clock: FakeClock) -> None:
        events = _recorder(broker)
        task = await enqueue_and_lease(broker, max_retry=1)
        clock.advance(timedelta(seconds=1))
        await broker.fail(task.id, task.lease_id or "", "boom", timedelta(0))
        [again] = await broker.lease(QUEUE, 1, TTL)
        await broker.release(again.id, again.lease_id or "")
        [third] = await broker.lease(QUEUE, 1, TTL)
        await broker.ack(third.id, third.lease_id or "")
        await broker.delete_task(task.id)
        pending, active, retry = TaskState.PENDING, TaskState.ACTIVE, TaskState.RETRY
        assert _transitions(events) == [
            (task.id, None, pending),
            (task.id, pending, active),
            (task.id, active, retry),
            (task.id, retry, active),
            (task.id, active, pending),
            (task.id, pending, active),
            (task.id, active, TaskState.COMPLETED),
            (task.id, TaskState.COMPLETED, None),
        ]
        failed = events[2]
        assert failed.error == "boom"
        assert failed.at == clock.now()
        assert all(e.queue == QUEUE and e.type == TYPE for e in events)
        assert all(e.error is None for i, e in enumerate(events) if i != 2)

    async def test_sweeps_report_their_changes(self, broker: Broker, clock: FakeClock) -> None:
        now = clock.now()
        running = await enqueue_and_lease(broker, max_retry=0)
        scheduled = await enqueue(broker, process_at=now + timedelta(seconds=5))
        expiring = await enqueue(broker, expires_at=now + timedelta(seconds=5))
        events = _recorder(broker)
        clock.advance(TTL)
        await broker.reap_expired_leases()
        await broker.promote_scheduled()
        await broker.archive_expired()
        assert _transitions(events) == [
            (running.id, TaskState.ACTIVE, TaskState.ARCHIVED),
            (scheduled.id, TaskState.SCHEDULED, TaskState.PENDING),
            (expiring.id, TaskState.PENDING, TaskState.ARCHIVED),
        ]
        assert [e.error for e in events] == [LEASE_EXPIRED_ERROR, None, EXPIRED_ERROR]

    async def test_admin_operations_report_their_changes(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        running = await enqueue_and_lease(broker)
        waiting = await enqueue(broker, process_at=clock.now() + TTL)
        events = _recorder(broker)
        await broker.cancel_task(running.id)
        await broker.run_task_now(waiting.id)
        await broker.archive_task(waiting.id)
        await broker.revive_task(waiting.id)
        await broker.reschedule_task(waiting.id, clock.now() + TTL)
        assert _transitions(events) == [
            (running.id, TaskState.ACTIVE, TaskState.ARCHIVED),
            (waiting.id, TaskState.SCHEDULED, TaskState.PENDING),
            (waiting.id, TaskState.PENDING, TaskState.ARCHIVED),
            (waiting.id, TaskState.ARCHIVED, TaskState.PENDING),
            (waiting.id, TaskState.PENDING, TaskState.SCHEDULED),
        ]

    async def test_none_stops_reporting(self, broker: Broker) -> None:
        events = _recorder(broker)
        await enqueue(broker)
        broker.set_event_sink(None)
        await enqueue(broker)
        assert len(await broker.lease(QUEUE, 10, TTL)) == 2
        assert len(events) == 1

    async def test_a_failing_sink_does_not_undo_the_change(self, broker: Broker) -> None:
        def explode(event: TaskEvent) -> None:
            raise RuntimeError("sink is broken")

        broker.set_event_sink(explode)
        task = await enqueue(broker)
        assert (await broker.get_task(task.id)).state == TaskState.PENDING
