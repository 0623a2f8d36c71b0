"""Broker model <-> protobuf conversions (conveyor_runtime.wire)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import InvalidTask
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.types import (
    Breaker,
    BreakerConfig,
    BreakerScope,
    BreakerStatus,
    NewTask,
    OnFailure,
    QueueStats,
    TaskEvent,
    TaskState,
)
from conveyor_protos.v1 import service_pb2, task_pb2
from conveyor_runtime.wire import (
    TaskProtos,
    breaker_config_from_proto,
    breaker_config_to_proto,
    breaker_scope_from_proto,
    breaker_to_proto,
    decode_events,
    encode_events,
    event_from_proto,
    event_state_token,
    event_to_proto,
    from_timestamp,
    new_task_from_proto,
    new_task_to_proto,
    state_from_proto,
    state_to_proto,
    stats_to_proto,
    task_to_envelope,
    task_to_proto,
    timestamp,
)
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

START = datetime(2030, 1, 1, tzinfo=UTC)


def full_new_task(**overrides: object) -> NewTask:
    fields: dict[str, object] = {
        "queue": "emails",
        "type": "email.send",
        "payload": b"\x00payload",
        "headers": {"trace": "abc"},
        "max_retry": 7,
        "timeout": timedelta(seconds=90),
        "deadline": START + timedelta(hours=2),
        "expires_at": START + timedelta(hours=1),
        "retention": timedelta(minutes=5),
        "unique_key": "user-1",
        "unique_ttl": timedelta(minutes=10),
        "concurrency_key": "tenant-9",
        "on_failure": OnFailure.CONTINUE,
    }
    fields.update(overrides)
    return NewTask(**fields)  # type: ignore[arg-type]


async def test_envelope_carries_what_a_worker_needs() -> None:
    clock = FakeClock(START)
    broker = MemoryBroker(clock)
    created = (await broker.enqueue(full_new_task())).task
    clock.advance(timedelta(seconds=3))
    (leased,) = await broker.lease("emails", 1, timedelta(seconds=30))

    env = task_to_envelope(leased)
    assert isinstance(env, task_pb2.TaskEnvelope)
    assert (env.id, env.queue, env.type, env.payload) == (
        created.id,
        "emails",
        "email.send",
        b"\x00payload",
    )
    assert dict(env.headers) == {"trace": "abc"}
    assert env.lease_id == leased.lease_id
    assert env.attempt == 1
    assert env.max_retry == 7
    assert env.timeout.ToTimedelta() == timedelta(seconds=90)
    assert from_timestamp(env.deadline) == START + timedelta(hours=2)
    assert from_timestamp(env.lease_expires_at) == START + timedelta(seconds=33)
    assert from_timestamp(env.enqueued_at) == START
    assert env.concurrency_key == "tenant-9"
    assert not env.group
    assert task_to_envelope(leased, attempt=4).attempt == 4
    # The envelope survives the wire.
    assert task_pb2.TaskEnvelope.FromString(env.SerializeToString()) == env
    await broker.close()


async def test_task_proto_reflects_state_and_options() -> None:
    clock = FakeClock(START)
    broker = MemoryBroker(clock)
    scheduled = (await broker.enqueue(full_new_task(process_at=START + timedelta(minutes=1)))).task
    pb = task_to_proto(scheduled)
    assert pb.state == task_pb2.TASK_STATE_SCHEDULED
    assert pb.max_retry == 7
    assert pb.retried == 0
    assert from_timestamp(pb.next_process_at) == START + timedelta(minutes=1)
    assert from_timestamp(pb.options.process_at) == START + timedelta(minutes=1)
    assert pb.options.unique_key == "user-1"
    assert pb.options.unique_ttl.ToTimedelta() == timedelta(minutes=10)
    assert pb.options.retention.ToTimedelta() == timedelta(minutes=5)
    assert pb.options.on_failure == task_pb2.ON_FAILURE_CONTINUE
    assert from_timestamp(pb.created_at) == START
    assert not pb.HasField("started_at")
    assert not pb.HasField("lease_expires_at")

    await broker.run_task_now(scheduled.id)
    (active,) = await broker.lease("emails", 1, timedelta(seconds=30))
    pb = task_to_proto(active)
    assert pb.state == task_pb2.TASK_STATE_ACTIVE
    assert pb.HasField("started_at")
    assert from_timestamp(pb.lease_expires_at) == START + timedelta(seconds=30)
    assert not pb.HasField("next_process_at")
    await broker.close()


def test_every_state_maps_both_ways() -> None:
    for state in TaskState:
        value = state_to_proto(state)
        assert value != task_pb2.TASK_STATE_UNSPECIFIED
        assert task_pb2.TaskState.Name(value) == f"TASK_STATE_{state.name}"
        assert state_from_proto(value) is state
    assert state_to_proto(None) == task_pb2.TASK_STATE_UNSPECIFIED
    assert state_from_proto(task_pb2.TASK_STATE_UNSPECIFIED) is None


def test_event_round_trip_and_subject_token() -> None:
    event = TaskEvent(
        task_id="01HZY0000000000000000000AA",
        queue="emails",
        type="email.send",
        state=TaskState.RETRY,
        previous_state=TaskState.ACTIVE,
        at=START,
        error="boom",
    )
    pb = event_to_proto(event)
    assert isinstance(pb, service_pb2.TaskEvent)
    assert pb.state == task_pb2.TASK_STATE_RETRY
    assert pb.previous_state == task_pb2.TASK_STATE_ACTIVE
    assert event_from_proto(service_pb2.TaskEvent.FromString(pb.SerializeToString())) == event
    assert event_state_token(TaskState.RETRY) == "retry"

    deleted = TaskEvent("01HZY0000000000000000000AB", "q", "t", None, TaskState.PENDING, START)
    pb = event_to_proto(deleted)
    assert pb.state == task_pb2.TASK_STATE_UNSPECIFIED
    assert event_from_proto(pb) == deleted
    assert event_state_token(None) == "deleted"


def test_new_task_round_trip() -> None:
    task = full_new_task(
        id="01HZY0000000000000000000AC",
        process_at=START + timedelta(days=1),
        group="batch-1",
        depends_on=("01HZY0000000000000000000AD",),
    )
    assert new_task_from_proto(new_task_to_proto(task), now=START) == task
    bare = NewTask(queue="q", type="t")
    assert new_task_from_proto(new_task_to_proto(bare), now=START) == bare


def test_process_in_is_resolved_against_now_and_exclusive_with_process_at() -> None:
    pb = task_pb2.NewTask(queue="q", type="t")
    pb.options.process_in.FromTimedelta(timedelta(minutes=3))
    assert new_task_from_proto(pb, now=START).process_at == START + timedelta(minutes=3)
    pb.options.process_at.FromDatetime(START)
    with pytest.raises(InvalidTask, match="exclusive"):
        new_task_from_proto(pb, now=START)


async def test_task_protos_write_what_task_to_proto_makes() -> None:
    """The templates of TaskProtos (shared by tasks that agree on all but their identity and
    content) give every task exactly task_to_proto's message, whatever mix a batch holds."""
    clock = FakeClock(START)
    broker = MemoryBroker(clock)
    plain = [NewTask(queue="q", type="t", payload=bytes([i])) for i in range(5)]
    mixed = [
        full_new_task(),
        full_new_task(unique_key="user-2", headers={}),
        full_new_task(process_at=START + timedelta(minutes=1), unique_key="user-3"),
        NewTask(queue="other", type="u", headers={"a": "b"}, depends_on=()),
        NewTask(queue="q", type="t", max_retry=0, group="g"),
    ]
    results = await broker.enqueue_batch([*plain, *mixed, *plain[:2]])
    clock.advance(timedelta(seconds=1))
    (active,) = await broker.lease("emails", 1, timedelta(seconds=30))
    tasks = [r.task for r in results] + [active]
    for limit in (64, 1):  # with templates, and past the limit (converted on their own)
        protos = TaskProtos(templates=limit)
        response = service_pb2.EnqueueBatchResponse()
        for task in tasks:
            protos.write(response.results.add(created=True).task, task)
        assert [item.task for item in response.results] == [task_to_proto(t) for t in tasks]
    await broker.close()


def test_new_task_from_proto_reads_shared_options_once_and_each_task_on_its_own() -> None:
    """Options are cached by their serialized form: tasks that share them still get their
    own process_at (relative to each call's now), and defaults apply per call."""
    pb = task_pb2.NewTask(queue="q", type="t")
    pb.options.process_in.FromTimedelta(timedelta(minutes=3))
    first = new_task_from_proto(pb, now=START, max_retry=2)
    later = new_task_from_proto(pb, now=START + timedelta(hours=1), max_retry=5)
    assert first.process_at == START + timedelta(minutes=3)
    assert later.process_at == START + timedelta(hours=1, minutes=3)
    assert (first.max_retry, later.max_retry) == (2, 5)
    # A refused option set stays refused (nothing cached for it).
    pb.options.process_at.FromDatetime(START)
    for _ in range(2):
        with pytest.raises(InvalidTask, match="exclusive"):
            new_task_from_proto(pb, now=START)
    # Long option sets (a long depends_on) are read each time, not kept: same result.
    many = task_pb2.NewTask(queue="q", type="t")
    many.options.depends_on.extend(f"01HZY{i:021d}" for i in range(100))
    assert new_task_from_proto(many, now=START).depends_on == tuple(many.options.depends_on)


@pytest.mark.parametrize(
    "value",
    [
        START,
        datetime(2030, 1, 1, 12, 30, 15, 123456, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 500000, tzinfo=UTC),
        datetime(2030, 6, 1, 8, 0, tzinfo=timezone(timedelta(hours=-7))),
        datetime(2030, 6, 1, 8, 0, 0, 7),  # naive: taken as UTC, as protobuf does
    ],
)
def test_timestamps_match_protobufs_own_conversion(value: datetime) -> None:
    expected = Timestamp()
    expected.FromDatetime(value)
    assert timestamp(value) == expected


def test_event_batches_round_trip_in_order() -> None:
    events = [
        TaskEvent(f"01HZY00000000000000000{n:04d}", "q", "t", TaskState.PENDING, None, START)
        for n in range(300)
    ]
    # An error long enough that its event's length prefix takes two varint bytes.
    events.append(
        TaskEvent("01HZY0000000000000000000ZZ", "q", "t", TaskState.RETRY, None, START, "x" * 300)
    )
    data = encode_events(events)
    assert [event_from_proto(pb) for pb in decode_events(data)] == events
    single = encode_events(events[:1])
    assert decode_events(single) == [event_to_proto(events[0])]
    assert decode_events(b"") == []


@pytest.mark.parametrize("data", [b"\x05abc", b"\x80", b"\xff\xff\xff\xff\xff\x01"])
def test_a_malformed_event_batch_is_a_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_events(data)


def test_breaker_config_round_trip_and_request_defaults() -> None:
    config = BreakerConfig(
        queue="calls",
        pattern="pay.*",
        failures=3,
        window=timedelta(seconds=90),
        cooldown=timedelta(milliseconds=1500),
        scope=BreakerScope.QUEUE,
    )
    pb = breaker_config_to_proto(config)
    assert pb.scope == service_pb2.BREAKER_SCOPE_QUEUE
    assert (pb.window.seconds, pb.cooldown.seconds, pb.cooldown.nanos) == (90, 1, 500_000_000)
    assert breaker_config_from_proto(pb) == config
    # In a request, an empty pattern is "*" and scope UNSPECIFIED is WORKER.
    bare = service_pb2.BreakerConfig(
        queue="calls", failures=5, window=Duration(seconds=60), cooldown=Duration(seconds=30)
    )
    assert breaker_config_from_proto(bare) == BreakerConfig("calls", "*", 5)
    assert breaker_scope_from_proto(service_pb2.BREAKER_SCOPE_WORKER) is BreakerScope.WORKER


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cooldown": Duration(seconds=30)}, "window is required"),
        ({"window": Duration(seconds=60)}, "cooldown is required"),
        (
            {"window": Duration(seconds=60), "cooldown": Duration(seconds=30), "scope": 9},
            "scope must be worker or queue",
        ),
        (
            {"window": Duration(seconds=10**14), "cooldown": Duration(seconds=30)},
            "window is not a valid Duration",
        ),
    ],
)
def test_a_bad_breaker_config_request_is_invalid_task(
    fields: dict[str, object], message: str
) -> None:
    pb = service_pb2.BreakerConfig(queue="calls", failures=5, **fields)  # type: ignore[arg-type]
    with pytest.raises(InvalidTask, match=message):
        breaker_config_from_proto(pb)


def test_breaker_on_the_wire_and_in_queue_stats() -> None:
    worker = Breaker(
        queue="calls",
        type="pay.charge",
        status=BreakerStatus.OPEN,
        opened_at=START,
        until=START + timedelta(seconds=30),
        failures=5,
        gateway="gw-1",
        worker_id="w-1",
        holder="h-1",
    )
    pb = breaker_to_proto(worker)
    assert (pb.queue, pb.type, pb.scope, pb.gateway, pb.worker_id, pb.state, pb.failures) == (
        "calls",
        "pay.charge",
        service_pb2.BREAKER_SCOPE_WORKER,
        "gw-1",
        "w-1",
        "open",
        5,
    )
    assert from_timestamp(pb.opened_at) == START
    assert from_timestamp(pb.until) == START + timedelta(seconds=30)
    queue_wide = breaker_to_proto(
        Breaker("calls", "pay.refund", BreakerStatus.HALF_OPEN, START, START, 2)
    )
    assert (queue_wide.scope, queue_wide.gateway, queue_wide.state) == (
        service_pb2.BREAKER_SCOPE_QUEUE,
        "",
        "half_open",
    )
    stats = QueueStats(queue="calls", paused=False, counts={TaskState.PENDING: 2})
    assert list(stats_to_proto(stats).breakers) == []
    with_breakers = stats_to_proto(stats, [worker])
    assert [b.type for b in with_breakers.breakers] == ["pay.charge"]
    assert with_breakers.counts["pending"] == 2
