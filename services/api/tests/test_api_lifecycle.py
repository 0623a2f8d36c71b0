"""Server-side enforcement of an attempt's timeout and deadline, and enqueue-time checks of
time bounds: a raw worker stream against a real server, this test acting as dispatcher."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from conveyor_api import ApiServer
from conveyor_broker import FakeClock, NewTask, TaskState
from conveyor_gateway.attempt_bounds import (
    DEADLINE_EXCEEDED_ERROR,
    SERVER_TIMEOUT_ERROR,
    AttemptBound,
    attempt_bound,
    deadline_error,
    retry_misses_deadline,
)
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime import wire
from conveyor_runtime.bus import Bus
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.polling import wait_until
from conveyor_testkit.stream import MakeApi, Recorder, WorkerStream, dispatch

TTL = timedelta(seconds=30)
GRACE = 0.05
T0 = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture
async def api(make_api: MakeApi) -> ApiServer:
    """A server that gives a silent attempt only a short grace past its bound."""
    return await make_api(timeout_grace=GRACE)


@pytest.fixture
async def worker(channel: grpc.aio.Channel, bus: Bus) -> AsyncIterator[tuple[WorkerStream, str]]:
    """A raw worker session on queue ``q`` (concurrency 4), registered; and its gateway id."""
    registers = await Recorder(cluster_pb2.Register).start(bus, queue="q")
    stream = WorkerStream(channel)
    welcome = await stream.hello({"q": 1}, 4)
    await registers.wait_for(lambda m: m.gateway == welcome.session_id)
    await registers.stop()
    yield stream, welcome.session_id
    stream.cancel()


async def deliver(
    broker: CountingBroker,
    bus: Bus,
    worker: tuple[WorkerStream, str],
    task: NewTask,
) -> task_pb2.TaskEnvelope:
    """Enqueue ``task``, lease it and dispatch it to the worker; the envelope it got."""
    await broker.enqueue(task)
    [leased] = await broker.lease(task.queue, 1, TTL)
    env = wire.task_to_envelope(leased)
    stream, gateway = worker
    reply = await dispatch(bus, gateway, task.queue, [env])
    assert list(reply.accepted) == [env.id]
    assert (await stream.read_kind("dispatch")).dispatch.task.id == env.id
    return env


async def wait_state(broker: CountingBroker, task_id: str, state: TaskState) -> None:
    async def reached() -> bool:
        return (await broker.get_task(task_id)).state is state

    await wait_until(reached, message=f"task {task_id} {state}")


# ------------------------------------------------------------------ pure rules


def test_attempt_bound_takes_the_earlier_of_timeout_and_deadline() -> None:
    grace = timedelta(seconds=1)
    assert attempt_bound(None, None, T0, grace) is None
    assert attempt_bound(timedelta(seconds=10), None, T0, grace) == AttemptBound(11.0, False)
    deadline = T0 + timedelta(seconds=4)
    assert attempt_bound(None, deadline, T0, grace) == AttemptBound(5.0, True)
    assert attempt_bound(timedelta(seconds=10), deadline, T0, grace) == AttemptBound(5.0, True)
    assert attempt_bound(timedelta(seconds=2), deadline, T0, grace) == AttemptBound(3.0, False)
    # A deadline already past leaves only the grace; a tie goes to the deadline.
    assert attempt_bound(None, T0 - timedelta(hours=1), T0, grace) == AttemptBound(1.0, True)
    assert attempt_bound(timedelta(seconds=4), deadline, T0, grace) == AttemptBound(5.0, True)


def test_retry_past_the_deadline_is_not_made() -> None:
    deadline = T0 + timedelta(minutes=10)
    assert not retry_misses_deadline(None, T0, timedelta(days=1))
    assert not retry_misses_deadline(deadline, T0, timedelta(minutes=9))
    assert retry_misses_deadline(deadline, T0, timedelta(minutes=10))
    assert retry_misses_deadline(deadline, T0 + timedelta(minutes=11), timedelta(0))
    assert deadline_error("boom") == "deadline exceeded (not retried): boom"
    assert deadline_error(DEADLINE_EXCEEDED_ERROR) == DEADLINE_EXCEEDED_ERROR


# ------------------------------------------------------------ server enforcement


async def test_a_silent_attempt_is_cancelled_and_failed_at_its_timeout(
    worker: tuple[WorkerStream, str], broker: CountingBroker, bus: Bus
) -> None:
    dones = await Recorder(cluster_pb2.Done).start(bus, queue="q")
    task = NewTask(queue="q", type="t", timeout=timedelta(seconds=0.2), max_retry=3)
    env = await deliver(broker, bus, worker, task)
    stream, gateway = worker
    # The worker keeps heartbeating (its lease stays alive) but never reports.
    await stream.send(service_pb2.WorkerFrame(heartbeat=service_pb2.Heartbeat()))
    cancel = (await stream.read_kind("cancel")).cancel
    assert (cancel.task_id, cancel.lease_id, cancel.reason) == (env.id, env.lease_id, "timed out")
    await wait_state(broker, env.id, TaskState.RETRY)
    stored = await broker.get_task(env.id)
    assert stored.retried == 1
    assert stored.last_error == SERVER_TIMEOUT_ERROR
    await dones.wait_for(lambda m: m.gateway == gateway)  # the slot was refunded
    await dones.stop()


async def test_a_silent_attempt_past_the_deadline_is_archived(
    worker: tuple[WorkerStream, str],
    broker: CountingBroker,
    bus: Bus,
    clock: FakeClock,
) -> None:
    deadline = clock.now() + timedelta(seconds=0.2)
    task = NewTask(queue="q", type="t", deadline=deadline, max_retry=10)
    env = await deliver(broker, bus, worker, task)
    stream, _ = worker
    cancel = (await stream.read_kind("cancel")).cancel
    assert (cancel.task_id, cancel.reason) == (env.id, "deadline exceeded")
    await wait_state(broker, env.id, TaskState.ARCHIVED)
    assert (await broker.get_task(env.id)).last_error == DEADLINE_EXCEEDED_ERROR


async def test_a_result_in_time_disarms_the_bound(
    worker: tuple[WorkerStream, str],
    broker: CountingBroker,
    bus: Bus,
    api: ApiServer,
) -> None:
    task = NewTask(queue="q", type="t", timeout=timedelta(seconds=0.3))
    env = await deliver(broker, bus, worker, task)
    stream, gateway = worker
    assert api.registry.gateways[gateway].timed == 1
    await stream.result(env, service_pb2.OUTCOME_SUCCESS, result=b"ok")
    await wait_state(broker, env.id, TaskState.COMPLETED)
    assert api.registry.gateways[gateway].timed == 0


async def test_a_failure_whose_retry_misses_the_deadline_is_archived(
    worker: tuple[WorkerStream, str],
    broker: CountingBroker,
    bus: Bus,
    clock: FakeClock,
) -> None:
    deadline = clock.now() + timedelta(minutes=10)
    stream, _ = worker
    soon = await deliver(broker, bus, worker, NewTask(queue="q", type="t", deadline=deadline))
    late = await deliver(broker, bus, worker, NewTask(queue="q", type="t", deadline=deadline))
    await stream.result(soon, service_pb2.OUTCOME_FAILURE, error="boom", retry_after=60)
    await stream.result(late, service_pb2.OUTCOME_FAILURE, error="boom", retry_after=600)
    await wait_state(broker, soon.id, TaskState.RETRY)
    await wait_state(broker, late.id, TaskState.ARCHIVED)
    assert (await broker.get_task(late.id)).last_error == "deadline exceeded (not retried): boom"


# --------------------------------------------------------------- enqueue checks


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({"deadline": -1}, "deadline .* is not in the future"),
        ({"expires_at": 0}, "expires_at .* is not in the future"),
        ({"deadline": 60, "process_at": 120}, "deadline .* must be after process_at"),
        ({"expires_at": 60, "process_at": 60}, "expires_at .* must be after process_at"),
    ],
)
async def test_time_bounds_that_can_never_be_met_are_refused(
    tasks: Any, broker: CountingBroker, clock: FakeClock, options: dict[str, int], text: str
) -> None:
    opts = task_pb2.TaskOptions()
    for name, seconds in options.items():
        getattr(opts, name).CopyFrom(wire.timestamp(clock.now() + timedelta(seconds=seconds)))
    request = service_pb2.EnqueueRequest(task=task_pb2.NewTask(queue="q", type="t", options=opts))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tasks.Enqueue(request)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.match(text)
    assert await broker.queue_stats() == []
