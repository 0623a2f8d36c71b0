"""Bad input through the real api process: a clear gRPC status, the stream or server stays
up, and nothing already stored is lost or changed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from conveyor import AsyncAdminClient, AsyncClient, InvalidArgument, ResourceExhausted, TaskState
from conveyor_broker import Task
from conveyor_broker.postgres import PostgresBroker
from conveyor_protos.v1 import service_pb2, service_pb2_grpc, task_pb2
from conveyor_testkit.polling import wait_until

from tests.e2e.harness import POLL_INTERVAL, Cluster
from tests.e2e.lifecycle import start_stack, wait_state

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

#: An unfinished varint tag: not a valid encoding of any message.
GARBAGE = b"\xff\xff\xff\xff"


def malformed(type_name: str) -> str:
    """The api's INVALID_ARGUMENT message for bytes that are not a ``type_name``."""
    return f"malformed request: not a valid {type_name} message"


def passthrough(message: Any) -> bytes:
    """Send bytes as they are, a message serialized."""
    return message if isinstance(message, bytes) else bytes(message.SerializeToString())


def worker_stub(channel: grpc.aio.Channel) -> Any:
    stub: Any = service_pb2_grpc.WorkerServiceStub
    return stub(channel)


def hello(queue: str) -> service_pb2.WorkerFrame:
    return service_pb2.WorkerFrame(
        hello=service_pb2.Hello(queues={queue: 1}, concurrency=1, sdk_version="0.1.0")
    )


async def session_error(target: str, frames: list[service_pb2.WorkerFrame]) -> grpc.aio.AioRpcError:
    """Open a raw session, send ``frames``, and return the status the server ends it with."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = worker_stub(channel).Session()
        for frame in frames:
            await call.write(frame)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        return info.value


async def test_bad_input_gets_clear_errors_and_loses_nothing(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    stack = await start_stack(cluster, tmp_path, queues={"bad": 1})
    async with AsyncClient(stack.target) as client, AsyncAdminClient(stack.target) as admin:
        kept = await client.enqueue("e2e.noop", {"keep": True}, queue="bad-idle", process_in=3600)
        done = await client.enqueue("e2e.noop", {"keep": True}, queue="bad")
        await wait_state(admin, done.id, TaskState.COMPLETED)
        before = await store.get_task(kept.id)

        # Oversized payload and malformed options: INVALID_ARGUMENT, nothing stored.
        with pytest.raises(InvalidArgument, match="payload"):
            await client.enqueue("e2e.noop", "x" * (1024 * 1024 + 100), queue="bad")
        # Far past the limit, gRPC itself refuses the message before it is read.
        with pytest.raises(ResourceExhausted):
            await client.enqueue("e2e.noop", "x" * (4 * 1024 * 1024), queue="bad")
        with pytest.raises(InvalidArgument, match="queue"):
            await client.enqueue("e2e.noop", {}, queue="no spaces")

    async with grpc.aio.insecure_channel(stack.target) as channel:
        tasks: Any = service_pb2_grpc.TaskServiceStub
        stub = tasks(channel)
        # Unknown fields are skipped (forward compatibility), not an error.
        request = service_pb2.EnqueueRequest(task=task_pb2.NewTask(queue="bad-idle", type="t"))
        raw = request.SerializeToString() + b"\xf8\x3f\x01"  # field 1023, varint 1
        unary = channel.unary_unary(
            "/conveyor.v1.TaskService/Enqueue",
            request_serializer=lambda body: body,
            response_deserializer=service_pb2.EnqueueResponse.FromString,
        )
        response = await unary(raw)
        assert response.task.queue == "bad-idle"
        # A body that is not a protobuf message at all (more in the test below).
        with pytest.raises(grpc.aio.AioRpcError) as garbage:
            await unary(GARBAGE)
        assert garbage.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert garbage.value.details() == malformed("conveyor.v1.EnqueueRequest")
        batch = [task_pb2.NewTask(queue="bad", type="t")] * 1001
        with pytest.raises(grpc.aio.AioRpcError) as too_many:
            await stub.EnqueueBatch(service_pb2.EnqueueBatchRequest(tasks=batch))
        assert too_many.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    # Malformed sessions end with INVALID_ARGUMENT and a message.
    no_hello = await session_error(
        stack.target, [service_pb2.WorkerFrame(heartbeat=service_pb2.Heartbeat())]
    )
    assert no_hello.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "Hello" in (no_hello.details() or "")
    bad_queue = service_pb2.WorkerFrame(
        hello=service_pb2.Hello(queues={"no spaces": 1}, concurrency=1, sdk_version="0.1.0")
    )
    assert (
        await session_error(stack.target, [bad_queue])
    ).code() is grpc.StatusCode.INVALID_ARGUMENT
    old = service_pb2.WorkerFrame(
        hello=service_pb2.Hello(
            queues={"bad": 1}, concurrency=1, sdk_version="0.1.0", min_server_version="99.0.0"
        )
    )
    assert (await session_error(stack.target, [old])).code() is grpc.StatusCode.FAILED_PRECONDITION

    # A Result for a lease the session does not hold is ignored: the stream stays up.
    async with grpc.aio.insecure_channel(stack.target) as channel:
        call = worker_stub(channel).Session()
        await call.write(hello("bad-raw"))
        welcome = await asyncio.wait_for(call.read(), timeout=10)
        assert welcome.HasField("welcome")
        foreign = service_pb2.Result(
            task_id=kept.id,
            lease_id="01ARZ3NDEKTSV4RRFFQ69G5FAV",
            outcome=service_pb2.OUTCOME_SUCCESS,
        )
        await call.write(service_pb2.WorkerFrame(result=foreign))
        await call.write(service_pb2.WorkerFrame())  # an empty frame, also ignored
        await call.write(service_pb2.WorkerFrame(heartbeat=service_pb2.Heartbeat()))
        await call.done_writing()
        while (frame := await asyncio.wait_for(call.read(), timeout=10)) is not grpc.aio.EOF:
            assert not frame.HasField("dispatch")
        assert await call.code() is grpc.StatusCode.OK

    after = await store.get_task(kept.id)
    assert after == before, "a bad request changed a stored task"
    assert (await store.get_task(done.id)).state.value == "completed"


async def raw_session(target: str) -> tuple[grpc.aio.Channel, Any]:
    """A channel and a Session call on it that can write raw bytes as well as frames."""
    channel = grpc.aio.insecure_channel(target)
    session = channel.stream_stream(
        "/conveyor.v1.WorkerService/Session",
        request_serializer=passthrough,
        response_deserializer=service_pb2.ServerFrame.FromString,
    )
    return channel, session()


async def stream_error(call: Any) -> grpc.aio.AioRpcError:
    """Read ``call`` to its end; the error status it ends with."""

    async def drain() -> None:
        while await call.read() is not grpc.aio.EOF:
            pass

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(drain(), timeout=20)
    return info.value


async def all_tasks(store: PostgresBroker) -> dict[str, Task]:
    return {t.id: t for t in (await store.list_tasks(limit=1000)).tasks}


async def test_undecodable_requests_get_invalid_argument_and_change_nothing(
    cluster: Cluster, store: PostgresBroker
) -> None:
    target = await cluster.start_services()
    async with AsyncClient(target) as client:
        kept = await client.enqueue("e2e.noop", {"keep": True}, queue="bad-idle", process_in=3600)
    before = await all_tasks(store)
    assert kept.id in before

    async with grpc.aio.insecure_channel(target) as channel:
        for path, type_name in [
            ("/conveyor.v1.TaskService/Enqueue", "conveyor.v1.EnqueueRequest"),
            ("/conveyor.v1.AdminService/GetTask", "conveyor.v1.GetTaskRequest"),
            ("/conveyor.v1.WebhookService/Heartbeat", "conveyor.v1.WebhookHeartbeatRequest"),
        ]:
            unary = channel.unary_unary(
                path, request_serializer=passthrough, response_deserializer=bytes
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await unary(GARBAGE, timeout=20)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, path
            assert info.value.details() == malformed(type_name), path

    # Garbage instead of Hello: the stream ends before anything is leased.
    channel, call = await raw_session(target)
    async with channel:
        await call.write(GARBAGE)
        refused = await stream_error(call)
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == malformed("conveyor.v1.WorkerFrame")

    # Garbage mid-session: the stream ends, and the task it was running is released.
    channel, call = await raw_session(target)
    async with channel, AsyncClient(target) as client:
        hello = service_pb2.Hello(queues={"bad-raw": 1}, concurrency=1, sdk_version="0.1.0")
        await call.write(service_pb2.WorkerFrame(hello=hello))
        assert (await asyncio.wait_for(call.read(), timeout=20)).HasField("welcome")
        running = await client.enqueue("e2e.noop", {}, queue="bad-raw")
        frame = await asyncio.wait_for(call.read(), timeout=30)
        assert frame.dispatch.task.id == running.id
        assert (await store.get_task(running.id)).state.value == "active"
        await call.write(GARBAGE)
        ended = await stream_error(call)
    assert ended.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert ended.details() == malformed("conveyor.v1.WorkerFrame")

    async def released() -> bool:
        task = await store.get_task(running.id)
        return task.state.value == "pending" and task.retried == 0

    await wait_until(
        released, within=20, interval=POLL_INTERVAL, message="the session's task released"
    )
    after = await all_tasks(store)
    assert after.pop(running.id).retried == 0
    assert after == before, "an undecodable request changed stored tasks"
