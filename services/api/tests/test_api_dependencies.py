"""Dependencies through the api: enqueue with depends_on (and its bad input), the ends
the api makes (a worker's ack, an operator's cancel or delete) announced to the resolver
as Resolve messages, the operator's views and overrides, and a running task's read of its
dependencies' results."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import grpc
import pytest
from conveyor_api import ApiServer
from conveyor_broker import FakeClock, NewTask, OnFailure, TaskState
from conveyor_broker.ids import new_id
from conveyor_broker.validation import MAX_DEPENDENCIES
from conveyor_protos.v1 import cluster_pb2, service_pb2, service_pb2_grpc, task_pb2
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


# ------------------------------------------------------------------ operator views


async def test_list_task_dependencies_both_ways(
    admin: Any, broker: CountingBroker, clock: FakeClock
) -> None:
    parents = sorted(
        [(await broker.enqueue(NewTask("p", "t"))).task for _ in range(3)], key=lambda t: t.id
    )
    child = (await broker.enqueue(NewTask("c", "t", depends_on=tuple(p.id for p in parents)))).task
    await broker.cancel_task(parents[0].id)
    await broker.resolve_dependents([parents[0].id])
    first = await admin.ListTaskDependencies(
        service_pb2.ListTaskDependenciesRequest(id=child.id, limit=2)
    )
    assert [d.task_id for d in first.dependencies] == [p.id for p in parents[:2]]
    assert [d.outcome for d in first.dependencies] == [
        service_pb2.DEPENDENCY_OUTCOME_FAILED,
        service_pb2.DEPENDENCY_OUTCOME_OPEN,
    ]
    assert first.dependencies[0].state == task_pb2.TASK_STATE_CANCELED
    assert first.dependencies[1].queue == "p"
    rest = await admin.ListTaskDependencies(
        service_pb2.ListTaskDependenciesRequest(id=child.id, cursor=first.next_cursor)
    )
    assert [d.task_id for d in rest.dependencies] == [parents[2].id]
    assert rest.next_cursor == ""
    waiting = await admin.ListTaskDependencies(
        service_pb2.ListTaskDependenciesRequest(id=parents[1].id, dependents=True)
    )
    [edge] = waiting.dependencies
    assert (edge.task_id, edge.state) == (child.id, task_pb2.TASK_STATE_BLOCKED)
    for request, code in (
        (
            service_pb2.ListTaskDependenciesRequest(id=new_id(clock.now())),
            grpc.StatusCode.NOT_FOUND,
        ),
        (service_pb2.ListTaskDependenciesRequest(id="nope"), grpc.StatusCode.INVALID_ARGUMENT),
        (
            service_pb2.ListTaskDependenciesRequest(id=child.id, limit=5000),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await admin.ListTaskDependencies(request)
        assert info.value.code() == code


async def test_run_now_runs_a_blocked_task_and_wakes_its_queue(
    admin: Any, bus: Bus, broker: CountingBroker
) -> None:
    wakes = await Recorder(cluster_pb2.Wake).start(bus)
    dep = (await broker.enqueue(NewTask("q", "t"))).task
    blocked = (await broker.enqueue(NewTask("override", "t", depends_on=(dep.id,)))).task
    response = await admin.RunTaskNow(service_pb2.TaskActionRequest(id=blocked.id))
    assert response.task.state == task_pb2.TASK_STATE_PENDING
    await wakes.wait_for(lambda m: m.queue == "override")
    await wakes.stop()


# ------------------------------------------------------------------ results for workers


@pytest.fixture
def workers(channel: grpc.aio.Channel) -> Any:
    stub: Any = service_pb2_grpc.WorkerServiceStub
    return stub(channel)


async def test_a_running_task_reads_its_dependencies_results_in_order(
    workers: Any, broker: CountingBroker
) -> None:
    a, b, c = [(await broker.enqueue(NewTask(q, "t"))).task for q in ("a", "b", "c")]
    waits = (
        await broker.enqueue(
            NewTask("w", "t", depends_on=(c.id, a.id, b.id), on_failure=OnFailure.CONTINUE)
        )
    ).task
    for task, result in ((a, b'"A"'), (c, None)):
        [leased] = await broker.lease(task.queue, 1, TTL)
        await broker.ack(leased.id, leased.lease_id or "", result)
    [leased_b] = await broker.lease("b", 1, TTL)
    await broker.fail(leased_b.id, leased_b.lease_id or "", "broke", TTL, skip_retry=True)
    await broker.resolve_dependents([a.id, b.id, c.id])
    [running] = await broker.lease("w", 1, TTL)
    assert running.id == waits.id
    lease = running.lease_id or ""

    first = await workers.GetDependencyResults(
        service_pb2.GetDependencyResultsRequest(task_id=waits.id, lease_id=lease, limit=2)
    )
    assert [r.task_id for r in first.results] == [c.id, a.id]
    assert [r.state for r in first.results] == [task_pb2.TASK_STATE_COMPLETED] * 2
    assert [r.has_result for r in first.results] == [False, True]
    assert first.results[1].result == b'"A"'
    rest = await workers.GetDependencyResults(
        service_pb2.GetDependencyResultsRequest(
            task_id=waits.id, lease_id=lease, cursor=first.next_cursor
        )
    )
    [failed] = rest.results
    assert (failed.task_id, failed.state, failed.last_error) == (
        b.id,
        task_pb2.TASK_STATE_ARCHIVED,
        "broke",
    )
    assert rest.next_cursor == ""

    # Only under its live lease.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await workers.GetDependencyResults(
            service_pb2.GetDependencyResultsRequest(task_id=waits.id, lease_id=a.id)
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await workers.GetDependencyResults(
            service_pb2.GetDependencyResultsRequest(task_id=waits.id, lease_id=lease, cursor="x")
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
