"""Enqueue admission (CONVEYOR_ENQUEUE_BACKLOG_LIMIT): a queue at its backlog limit holds
new enqueues back, then refuses them with RESOURCE_EXHAUSTED; nothing stored is lost,
other queues go on, and room made by the workers lets a waiting enqueue through."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from conveyor_api.admission import Admission
from conveyor_broker import QueueFull, TaskState
from conveyor_broker.testing.builders import lease_one
from conveyor_protos.v1 import service_pb2, service_pb2_grpc, task_pb2
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.polling import wait_until
from conveyor_testkit.stream import MakeApi


def _one(queue: str = "q") -> service_pb2.EnqueueRequest:
    return service_pb2.EnqueueRequest(task=task_pb2.NewTask(queue=queue, type="t"))


async def _stub(make_api: MakeApi, **settings: Any) -> tuple[grpc.aio.Channel, Any]:
    api = await make_api(**settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{api.port}")
    stub: Any = service_pb2_grpc.TaskServiceStub
    return channel, stub(channel)


async def _pending(broker: CountingBroker, queue: str) -> int:
    return (await broker.queue_stats(queue))[0].count(TaskState.PENDING)


async def test_a_full_queue_refuses_enqueue_and_keeps_what_it_holds(
    make_api: MakeApi, broker: CountingBroker
) -> None:
    channel, tasks = await _stub(make_api, enqueue_backlog_limit=3, enqueue_admission_wait=0)
    async with channel:
        for _ in range(3):
            await tasks.Enqueue(_one())
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await tasks.Enqueue(_one())
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "backlog limit" in (refused.value.details() or "")
        # Another queue is not held back.
        assert (await tasks.Enqueue(_one("other"))).created
        # An all-or-nothing EnqueueTx touching the full queue stores nothing.
        with pytest.raises(grpc.aio.AioRpcError) as tx:
            await tasks.EnqueueTx(
                service_pb2.EnqueueTxRequest(
                    tasks=[task_pb2.NewTask(queue="other", type="t"), _one().task]
                )
            )
        assert tx.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await _pending(broker, "q") == 3
    assert await _pending(broker, "other") == 1


async def test_a_batch_fails_only_the_items_of_the_full_queue(
    make_api: MakeApi, broker: CountingBroker
) -> None:
    channel, tasks = await _stub(make_api, enqueue_backlog_limit=2, enqueue_admission_wait=0)
    async with channel:
        await tasks.EnqueueBatch(service_pb2.EnqueueBatchRequest(tasks=[_one().task] * 2))
        reply = await tasks.EnqueueBatch(
            service_pb2.EnqueueBatchRequest(
                tasks=[
                    _one().task,
                    _one("other").task,
                    task_pb2.NewTask(queue="other"),
                    task_pb2.NewTask(queue="bad name", type="t"),
                    _one().task,
                ]
            )
        )
    codes = [r.error_code for r in reply.results]
    # The items of "q" are refused; the item with no type and the one with a bad queue
    # name are invalid on their own.
    assert codes == [
        "RESOURCE_EXHAUSTED",
        "",
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "RESOURCE_EXHAUSTED",
    ]
    assert reply.results[1].created
    assert await _pending(broker, "q") == 2
    assert await _pending(broker, "other") == 1


async def test_a_waiting_enqueue_goes_through_once_workers_make_room(
    make_api: MakeApi, broker: CountingBroker
) -> None:
    channel, tasks = await _stub(make_api, enqueue_backlog_limit=1, enqueue_admission_wait=30)
    async with channel:
        await tasks.Enqueue(_one())
        waiting = asyncio.ensure_future(tasks.Enqueue(_one()))
        # Held back: admission has read the backlog again at least once since.
        reads = len(broker.due_counts)
        await wait_until(lambda: len(broker.due_counts) > reads, within=10, interval=0.01)
        assert not waiting.done()
        await lease_one(broker, "q")  # a worker takes the first task: room for one
        reply = await asyncio.wait_for(waiting, timeout=10)
    assert reply.created
    assert await _pending(broker, "q") == 1


async def test_no_limit_reads_nothing(make_api: MakeApi, broker: CountingBroker) -> None:
    channel, tasks = await _stub(make_api)
    async with channel:
        for _ in range(5):
            await tasks.Enqueue(_one())
    assert broker.due_counts == []
    assert await _pending(broker, "q") == 5


async def test_callers_sharing_one_read_are_admitted_up_to_the_limit(
    broker: CountingBroker,
) -> None:
    admission = Admission(broker, limit=10, wait=0)
    outcomes = await asyncio.gather(
        *(admission.admit("q") for _ in range(25)), return_exceptions=True
    )
    assert len(broker.due_counts) == 1  # one read, shared
    assert outcomes.count(None) == 10
    assert all(isinstance(o, QueueFull) for o in outcomes if o is not None)
