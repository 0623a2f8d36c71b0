"""Dependencies through the api: enqueue with depends_on (and its bad input), and the
ends the api makes (a worker's ack, an operator's cancel or delete) announced to the
resolver as Resolve messages."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import grpc
import pytest
from conveyor_api import ApiServer
from conveyor_broker import FakeClock, NewTask, OnFailure, TaskState
from conveyor_broker.ids import new_id
from conveyor_broker.validation import MAX_DEPENDENCIES
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime import wire
from conveyor_runtime.bus import Bus
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.stream import Recorder, WorkerStream, dispatch

TTL = timedelta(seconds=30)


def new(**fields: Any) -> task_pb2.NewTask:
    fields.setdefault("queue", "q")
    fields.setdefault("type", "t")
    return task_pb2.NewTask(**fields)


def after(*ids: str, **options: Any) -> task_pb2.TaskOptions:
    return task_pb2.TaskOptions(depends_on=list(ids), **options)


async def stored_count(broker: CountingBroker) -> int:
    return len((await broker.list_tasks()).tasks)


async def test_a_task_with_dependencies_is_stored_blocked(
    tasks: Any, broker: CountingBroker
) -> None:
    first = await tasks.Enqueue(service_pb2.EnqueueRequest(task=new()))
    response = await tasks.Enqueue(
        service_pb2.EnqueueRequest(task=new(options=after(first.task.id)))
    )
    assert response.task.state == task_pb2.TASK_STATE_BLOCKED
    assert list(response.task.options.depends_on) == [first.task.id]


async def test_a_pipeline_in_one_transaction_may_name_later_items(
    tasks: Any, clock: FakeClock
) -> None:
    a, b = sorted(new_id(clock.now()) for _ in range(2))
    response = await tasks.EnqueueTx(
        service_pb2.EnqueueTxRequest(tasks=[new(id=b, options=after(a)), new(id=a)])
    )
    assert [t.state for t in response.tasks] == [
        task_pb2.TASK_STATE_BLOCKED,
        task_pb2.TASK_STATE_PENDING,
    ]


async def _refused(call: Any, request: Any) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details() or ""


async def test_bad_dependencies_are_invalid_argument_and_store_nothing(
    tasks: Any, broker: CountingBroker, clock: FakeClock
) -> None:
    missing = new_id(clock.now())
    details = await _refused(
        tasks.Enqueue, service_pb2.EnqueueRequest(task=new(options=after(missing)))
    )
    assert f"unknown dependency '{missing}'" in details

    own = new_id(clock.now())
    details = await _refused(
        tasks.Enqueue, service_pb2.EnqueueRequest(task=new(id=own, options=after(own)))
    )
    assert "itself" in details

    details = await _refused(
        tasks.Enqueue,
        service_pb2.EnqueueRequest(
            task=new(options=after(*[new_id(clock.now()) for _ in range(MAX_DEPENDENCIES + 1)]))
        ),
    )
    assert f"at most {MAX_DEPENDENCIES}" in details

    a, b, c = sorted(new_id(clock.now()) for _ in range(3))
    details = await _refused(
        tasks.EnqueueTx,
        service_pb2.EnqueueTxRequest(
            tasks=[
                new(id=a, options=after(b)),
                new(id=b, options=after(c)),
                new(id=c, options=after(a)),
            ]
        ),
    )
    assert "dependency cycle" in details
    for n, task_id in enumerate((a, b, c)):
        assert f"task {n} ({task_id})" in details
    assert await stored_count(broker) == 0


async def test_an_ack_announces_the_end_to_the_resolver(
    channel: grpc.aio.Channel, bus: Bus, broker: CountingBroker
) -> None:
    resolves = await Recorder(cluster_pb2.Resolve).start(bus)
    registers = await Recorder(cluster_pb2.Register).start(bus)
    dep = (await broker.enqueue(NewTask("work", "job"))).task
    await broker.enqueue(NewTask("next", "job", depends_on=(dep.id,)))
    lone = (await broker.enqueue(NewTask("work", "job"))).task
    worker = WorkerStream(channel)
    welcome = await worker.hello({"work": 1}, 2)
    await registers.wait_for(lambda m: m.gateway == welcome.session_id)
    leased = await broker.lease("work", 2, TTL)
    envelopes = [wire.task_to_envelope(t) for t in leased]
    reply = await dispatch(bus, welcome.session_id, "work", envelopes)
    assert len(reply.accepted) == 2
    for env in envelopes:
        await worker.result(env, service_pb2.OUTCOME_SUCCESS)
    [resolve] = await resolves.wait_for()
    assert list(resolve.task_ids) == [dep.id]
    # The task nobody waits for is not announced.
    assert all(lone.id not in m.task_ids for m in resolves.messages)
    worker.cancel()
    await resolves.stop()
    await registers.stop()


async def test_admin_cancel_and_delete_announce_what_they_leave(
    admin: Any, bus: Bus, broker: CountingBroker
) -> None:
    resolves = await Recorder(cluster_pb2.Resolve).start(bus)
    wakes = await Recorder(cluster_pb2.Wake).start(bus)
    canceled = (await broker.enqueue(NewTask("q", "t"))).task
    await broker.enqueue(NewTask("q", "t", depends_on=(canceled.id,)))
    await admin.CancelTask(service_pb2.TaskActionRequest(id=canceled.id))
    await resolves.wait_for(lambda m: list(m.task_ids) == [canceled.id])

    deleted = (await broker.enqueue(NewTask("q", "t"))).task
    runs = (
        await broker.enqueue(
            NewTask("runs-after", "t", depends_on=(deleted.id,), on_failure=OnFailure.CONTINUE)
        )
    ).task
    await admin.DeleteTask(service_pb2.TaskActionRequest(id=deleted.id))
    # Resolved in the delete's own transaction; the promoted task's queue is woken.
    assert (await broker.get_task(runs.id)).state is TaskState.PENDING
    await wakes.wait_for(lambda m: m.queue == "runs-after")
    await resolves.stop()
    await wakes.stop()


async def test_the_server_stops_reporting_when_it_stops(
    make_api: Any, broker: CountingBroker
) -> None:
    server: ApiServer = await make_api()
    assert broker.dependency_sink is server.resolves
    await server.stop(grace=0.5)
    assert broker.dependency_sink is None
