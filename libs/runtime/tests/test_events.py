"""EventPublisher: the broker's lifecycle events reach NATS on per-queue, per-state subjects."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from conveyor_broker.clock import FakeClock
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.types import NewTask, TaskEvent, TaskState
from conveyor_protos.v1 import service_pb2, task_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.events import MAX_EVENTS_PER_MESSAGE, EventGate, EventPublisher
from conveyor_runtime.nats_connect import NatsClient, close_nats, connect_nats
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.wire import decode_events, event_from_proto
from conveyor_testkit.polling import wait_until
from nats.aio.msg import Msg

TIMEOUT = 10.0


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    """A connection to the session's private nats-server."""
    client = await connect_nats(nats_url, name="runtime-test")
    try:
        yield client
    finally:
        await close_nats(client)


@pytest.fixture
def subjects() -> Subjects:
    """Subjects and buckets no other test uses."""
    return Subjects(prefix=f"t{uuid.uuid4().hex[:12]}")


async def collect(nc: NatsClient, subject: str, count: int) -> tuple[list[Msg], asyncio.Event]:
    """Messages on ``subject``; the event is set once they carry ``count`` events."""
    got: list[Msg] = []
    enough = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        got.append(msg)
        if len(unpack(got)) >= count:
            enough.set()

    await nc.subscribe(subject, cb=on_msg)
    await nc.flush()
    return got, enough


def unpack(messages: list[Msg]) -> list[tuple[str, service_pb2.TaskEvent]]:
    """Every event of ``messages``, in order, with the subject it came on."""
    return [(m.subject, event) for m in messages for event in decode_events(m.data)]


async def test_broker_events_are_published_per_queue_and_state(
    nc: NatsClient, subjects: Subjects, bus: Bus
) -> None:
    got, enough = await collect(nc, subjects.events_wildcard(), 4)
    broker = MemoryBroker(FakeClock())
    publisher = EventPublisher(bus)
    await publisher.start()
    broker.set_event_sink(publisher)
    try:
        first = (await broker.enqueue(NewTask(queue="emails", type="send"))).task
        second = (await broker.enqueue(NewTask(queue="emails", type="send"))).task
        await broker.lease("emails", 1, ttl=timedelta(seconds=30))
        await broker.delete_task(second.id)
        async with asyncio.timeout(TIMEOUT):
            await enough.wait()
    finally:
        broker.set_event_sink(None)
        await publisher.stop()
        await broker.close()

    p = subjects.prefix
    unpacked = unpack(got)
    assert [subject for subject, _ in unpacked] == [
        f"{p}.events.emails.pending",
        f"{p}.events.emails.pending",
        f"{p}.events.emails.active",
        f"{p}.events.emails.deleted",
    ]
    events = [event_from_proto(pb) for _, pb in unpacked]
    assert events[0].task_id == first.id
    assert events[0].previous_state is None
    assert events[2].state is TaskState.ACTIVE
    assert events[2].previous_state is TaskState.PENDING
    assert events[3].task_id == second.id
    assert unpacked[3][1].state == task_pb2.TASK_STATE_UNSPECIFIED
    assert publisher.published == 4
    assert publisher.messages == len(got)
    assert publisher.backlog == 0


async def test_a_run_of_one_queue_and_state_is_one_message(
    nc: NatsClient, subjects: Subjects, bus: Bus
) -> None:
    at = datetime(2030, 1, 1, tzinfo=UTC)
    done, pending = TaskState.COMPLETED, TaskState.PENDING
    plan = [("a", pending)] * 3 + [("a", done)] * 2 + [("b", pending)] + [("a", pending)]
    plan += [("c", done)] * (2 * MAX_EVENTS_PER_MESSAGE + 5)
    got, enough = await collect(nc, subjects.events_wildcard(), len(plan))
    publisher = EventPublisher(bus)
    # Buffered before the publisher starts, so it finds them all at once.
    for n, (queue, state) in enumerate(plan):
        publisher(TaskEvent(f"id{n}", queue, "t", state, None, at))
    await publisher.start()
    async with asyncio.timeout(TIMEOUT):
        await enough.wait()
    await publisher.stop()
    p = subjects.prefix
    assert [(m.subject, len(decode_events(m.data))) for m in got] == [
        (f"{p}.events.a.pending", 3),
        (f"{p}.events.a.completed", 2),
        (f"{p}.events.b.pending", 1),
        (f"{p}.events.a.pending", 1),
        (f"{p}.events.c.completed", MAX_EVENTS_PER_MESSAGE),
        (f"{p}.events.c.completed", MAX_EVENTS_PER_MESSAGE),
        (f"{p}.events.c.completed", 5),
    ]
    assert [pb.task_id for _, pb in unpack(got)] == [f"id{n}" for n in range(len(plan))]
    assert publisher.messages == 7
    assert publisher.published == len(plan)


async def test_overflow_drops_the_oldest_and_never_blocks(
    nc: NatsClient, subjects: Subjects, bus: Bus
) -> None:
    got, enough = await collect(nc, subjects.events_wildcard(), 2)
    publisher = EventPublisher(bus, max_buffered=2)
    at = datetime(2030, 1, 1, tzinfo=UTC)
    # Not started yet: the sink only buffers.
    for n in range(3):
        publisher(TaskEvent(f"id{n}", "q", "t", TaskState.PENDING, None, at))
    assert publisher.dropped == 1
    assert publisher.backlog == 2
    await publisher.start()
    async with asyncio.timeout(TIMEOUT):
        await enough.wait()
    await publisher.stop()
    ids = [pb.task_id for _, pb in unpack(got)]
    assert ids == ["id1", "id2"]


async def test_stop_flushes_what_is_buffered(nc: NatsClient, subjects: Subjects, bus: Bus) -> None:
    got, enough = await collect(nc, subjects.events_wildcard(), 50)
    publisher = EventPublisher(bus)
    await publisher.start()
    at = datetime(2030, 1, 1, tzinfo=UTC)
    for n in range(50):
        publisher(TaskEvent(f"id{n}", "q", "t", TaskState.COMPLETED, TaskState.ACTIVE, at))
    await publisher.stop()
    await nc.flush()
    async with asyncio.timeout(TIMEOUT):
        await enough.wait()
    assert [pb.task_id for _, pb in unpack(got)] == [f"id{n}" for n in range(50)]


async def test_gate_publishes_only_while_someone_watches(
    nc: NatsClient, subjects: Subjects, bus: Bus
) -> None:
    """Unwatched, the broker builds no events; an announcement turns them on for the TTL,
    and they stop again once the TTL passes without another one."""
    got, _ = await collect(nc, subjects.events_wildcard(), 1)
    broker = MemoryBroker(FakeClock())
    publisher = EventPublisher(bus)
    await publisher.start()
    gate = EventGate(broker, publisher, bus, ttl=0.5)
    await gate.start()
    await nc.flush()
    try:
        unwatched = (await broker.enqueue(NewTask(queue="emails", type="send"))).task
        assert not gate.open

        await bus.publish_watch()
        await wait_until(lambda: gate.open, within=TIMEOUT)
        watched = (await broker.enqueue(NewTask(queue="emails", type="send"))).task
        await wait_until(lambda: any(e.task_id == watched.id for _, e in unpack(got)))

        # The TTL lapses with no further announcement.
        await wait_until(lambda: not gate.open, within=TIMEOUT)
        after = (await broker.enqueue(NewTask(queue="emails", type="send"))).task
        await publisher.stop()  # flushes anything buffered
        await nc.flush()
        ids = {e.task_id for _, e in unpack(got)}
        assert watched.id in ids
        assert unwatched.id not in ids
        assert after.id not in ids
        assert publisher.published == 1
    finally:
        await gate.stop()
        await publisher.stop()
        await broker.close()


async def test_gate_in_process_keep_open_needs_no_round_trip(
    nc: NatsClient, subjects: Subjects, bus: Bus
) -> None:
    """A watcher in the same process opens the gate at once, before any NATS message."""
    broker = MemoryBroker(FakeClock())
    publisher = EventPublisher(bus)
    gate = EventGate(broker, publisher, bus, ttl=30)
    try:
        gate.keep_open()
        assert gate.open
        await broker.enqueue(NewTask(queue="emails", type="send"))
        assert publisher.backlog == 1
    finally:
        await gate.stop()
        await broker.close()
    assert not gate.open
