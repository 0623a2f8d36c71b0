"""AdminService concurrency-limit RPCs over a real gRPC socket: set, list and delete, the
wake that lets the queue's owner lease what a change released, enqueue with a key, and
clear errors for bad input with nothing stored lost."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import grpc
from conveyor_broker import ConcurrencyLimit, TaskState
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime.bus import Bus
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.stream import Recorder, refused


def limit(**fields: Any) -> service_pb2.SetConcurrencyLimitRequest:
    fields.setdefault("queue", "calls")
    return service_pb2.SetConcurrencyLimitRequest(limit=service_pb2.ConcurrencyLimit(**fields))


async def test_set_list_and_delete(admin: Any, broker: CountingBroker) -> None:
    set_ = await admin.SetConcurrencyLimit(limit(per_key=2))
    assert (set_.limit.queue, set_.limit.pattern, set_.limit.per_key) == ("calls", "*", 2)
    await admin.SetConcurrencyLimit(limit(per_key=5, pattern="vip-*"))
    await admin.SetConcurrencyLimit(limit(queue="other", per_key=1))
    assert await broker.list_concurrency_limits("calls") == [
        ConcurrencyLimit("calls", 2, "*"),
        ConcurrencyLimit("calls", 5, "vip-*"),
    ]
    listed = await admin.ListConcurrencyLimits(service_pb2.ListConcurrencyLimitsRequest())
    assert [(c.queue, c.pattern, c.per_key) for c in listed.limits] == [
        ("calls", "*", 2),
        ("calls", "vip-*", 5),
        ("other", "*", 1),
    ]
    one = await admin.ListConcurrencyLimits(service_pb2.ListConcurrencyLimitsRequest(queue="other"))
    assert [c.queue for c in one.limits] == ["other"]
    await admin.DeleteConcurrencyLimit(service_pb2.DeleteConcurrencyLimitRequest(queue="calls"))
    await admin.DeleteConcurrencyLimit(
        service_pb2.DeleteConcurrencyLimitRequest(queue="calls", pattern="vip-*")
    )
    assert await broker.list_concurrency_limits() == [ConcurrencyLimit("other", 1)]


async def test_a_change_that_releases_held_tasks_wakes_the_queue(
    admin: Any, tasks: Any, broker: CountingBroker, bus: Bus
) -> None:
    await admin.SetConcurrencyLimit(limit(per_key=1))
    for _ in range(3):
        await tasks.Enqueue(
            service_pb2.EnqueueRequest(
                task=task_pb2.NewTask(
                    queue="calls",
                    type="t",
                    options=task_pb2.TaskOptions(concurrency_key="tenant-1"),
                )
            )
        )
    leased = await broker.lease("calls", 10, timedelta(seconds=30))
    assert [t.concurrency_key for t in leased] == ["tenant-1"]
    assert (await broker.queue_stats("calls"))[0].count(TaskState.HELD) == 2
    wakes = await Recorder(cluster_pb2.Wake).start(bus, queue="calls")
    await admin.SetConcurrencyLimit(limit(per_key=3))
    assert (await broker.queue_stats("calls"))[0].count(TaskState.HELD) == 0
    await wakes.wait_for(lambda m: True)


async def test_bad_input_is_invalid_argument_and_keeps_the_stored_limit(
    admin: Any, broker: CountingBroker
) -> None:
    await admin.SetConcurrencyLimit(limit(per_key=4))
    code, message = await refused(
        admin.SetConcurrencyLimit, service_pb2.SetConcurrencyLimitRequest()
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "limit is required" in message
    for bad in (
        limit(queue="a b", per_key=1),
        limit(queue="", per_key=1),
        limit(per_key=0),
        limit(per_key=-3),
        limit(per_key=5_000_000),
        limit(per_key=1, pattern="x" * 300),
        limit(per_key=1, pattern="a\x01"),
    ):
        code, message = await refused(admin.SetConcurrencyLimit, bad)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert message
    assert await broker.list_concurrency_limits() == [ConcurrencyLimit("calls", 4)]


async def test_delete_missing_is_not_found(admin: Any) -> None:
    code, message = await refused(
        admin.DeleteConcurrencyLimit,
        service_pb2.DeleteConcurrencyLimitRequest(queue="calls", pattern="vip-*"),
    )
    assert code == grpc.StatusCode.NOT_FOUND
    assert "vip-*" in message
    code, _ = await refused(
        admin.DeleteConcurrencyLimit, service_pb2.DeleteConcurrencyLimitRequest(queue="a b")
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
