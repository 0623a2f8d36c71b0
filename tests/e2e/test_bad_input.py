"""Bad input through the real api process: a clear gRPC status, the stream or server stays
up, and nothing already stored is lost or changed."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import grpc
import pytest
from conveyor import (
    AsyncAdminClient,
    AsyncClient,
    InvalidArgument,
    ResourceExhausted,
    TaskState,
    spec,
)
from conveyor_broker import Task, TaskListParams
from conveyor_broker import TaskState as BrokerState
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
        # A dependency that does not exist (tests/e2e/test_dependencies.py has the rest).
        with pytest.raises(InvalidArgument, match="unknown dependency"):
            await client.enqueue(
                "e2e.noop", {}, queue="bad", depends_on=["01ARZ3NDEKTSV4RRFFQ69G5FAV"]
            )
        # A group is delivered whole: a concurrency key per member has no meaning.
        with pytest.raises(InvalidArgument, match="concurrency_key"):
            await client.enqueue("e2e.noop", {}, queue="bad", group="digest", concurrency_key="k")

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
    return {t.id: t for t in (await store.list_tasks(TaskListParams(limit=1000))).tasks}


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


def _new(queue: str = "hardened", type: str = "e2e.noop", **fields: Any) -> task_pb2.NewTask:
    return task_pb2.NewTask(queue=queue, type=type, payload=b"{}", **fields)


#: The issue's bad inputs, each beside good items: refused on its own, with a reason.
BAD_ITEMS: dict[str, tuple[task_pb2.NewTask, str]] = {
    "queue 0\\n": (_new(queue="0\n"), "invalid queue name '0\\n'"),
    "look-alike queue": (_new(queue="h\u0430rdened"), "invalid queue name"),
    "NUL in type": (_new(type="e2e.noop\x00"), "task type contains the control character"),
    "NUL in unique key": (
        _new(options=task_pb2.TaskOptions(unique_key="key\x00")),
        "unique_key contains the control character",
    ),
    "NUL in header value": (
        _new(headers={"h": "v\x00"}),
        "header 'h' contains the control character",
    ),
    "NUL in header key": (_new(headers={"h\x00": "v"}), "a header key contains"),
    "newline in type": (_new(type="e2e.noop\n"), "task type contains the control character"),
}


async def test_bad_inputs_fail_alone_and_other_producers_are_stored(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    stack = await start_stack(cluster, tmp_path, queues={"hardened": 1}, concurrency=16)
    [api] = [p for p in cluster.procs if p.name.startswith("api")]
    async with (
        grpc.aio.insecure_channel(stack.target) as channel,
        AsyncClient(stack.target) as client,
    ):
        task_stub: Any = service_pb2_grpc.TaskServiceStub
        tasks = task_stub(channel)
        # Producer A: one EnqueueBatch mixing every bad item with good ones. Producer B,
        # at the same time: single enqueues and a batch, through the SDK, sharing the
        # api's group commits with A.
        mixed = [_new(headers={"n": "a0"})]
        mixed += [item for item, _ in BAD_ITEMS.values()]
        mixed += [_new(headers={"n": "a1"})]
        singles = [
            client.enqueue("e2e.noop", {}, queue="hardened", headers={"n": f"b{n}"})
            for n in range(50)
        ]
        batch = [spec("e2e.noop", {}, queue="hardened", headers={"n": f"c{n}"}) for n in range(100)]
        answer, *others = await asyncio.gather(
            tasks.EnqueueBatch(service_pb2.EnqueueBatchRequest(tasks=mixed)),
            client.enqueue_batch(batch),
            *singles,
        )
        results = list(answer.results)
        assert results[0].created
        assert results[-1].created
        for (case, (_, reason)), result in zip(BAD_ITEMS.items(), results[1:-1], strict=True):
            assert result.error_code == "INVALID_ARGUMENT", case
            assert reason in result.error, (case, result.error)
            assert not result.HasField("task"), case
        [from_batch, *from_singles] = others
        assert all(r.ok and r.created for r in from_batch)
        good = {results[0].task.id, results[-1].task.id}
        good |= {r.task.id for r in from_batch if r.task is not None}
        good |= {t.id for t in from_singles}
        assert len(good) == 152

        # One at a time, the same: a clear INVALID_ARGUMENT, nothing stored.
        for case, (item, reason) in BAD_ITEMS.items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await tasks.Enqueue(service_pb2.EnqueueRequest(task=item))
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, case
            assert reason in (info.value.details() or ""), case

    # Every good task is stored and runs: the wake path is healthy after the bad ones.
    async def all_ran() -> bool:
        page = await store.list_tasks(
            TaskListParams(queue="hardened", state=BrokerState.COMPLETED, limit=1000)
        )
        return good <= {t.id for t in page.tasks}

    await wait_until(
        all_ran, within=60, message="every good task completed", interval=POLL_INTERVAL
    )
    stored = await all_tasks(store)
    assert {t.queue for t in stored.values()} == {"hardened"}
    assert all(t.type == "e2e.noop" and not t.unique_key for t in stored.values())

    # A Hello with too much in it ends the stream, naming the field and the limit.
    labels = {f"label-{n}": "v" * 10 for n in range(17)}
    big = service_pb2.Hello(queues={"hardened": 1}, concurrency=1, sdk_version="0.1.0")
    big.labels.update(labels)
    refused = await session_error(stack.target, [service_pb2.WorkerFrame(hello=big)])
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == "Hello has 17 labels; at most 16 are allowed"
    long_label = service_pb2.Hello(
        queues={"hardened": 1}, concurrency=1, sdk_version="0.1.0", labels={"zone": "x" * 5000}
    )
    refused = await session_error(stack.target, [service_pb2.WorkerFrame(hello=long_label)])
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "label 'zone' is 5000 characters; at most 256" in (refused.details() or "")
    greedy = service_pb2.Hello(queues={"hardened": 1}, concurrency=10**9, sdk_version="0.1.0")
    refused = await session_error(stack.target, [service_pb2.WorkerFrame(hello=greedy)])
    assert "concurrency must be 1..10000" in (refused.details() or "")

    # A lease token nested past the JSON parser's depth: UNAUTHENTICATED, not INTERNAL.
    async with grpc.aio.insecure_channel(stack.target) as channel:
        hook_stub: Any = service_pb2_grpc.WebhookServiceStub
        hooks = hook_stub(channel)
        nested = "v1." + base64.urlsafe_b64encode(b"[" * 3000).rstrip(b"=").decode() + ".AAAA"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await hooks.Heartbeat(service_pb2.WebhookHeartbeatRequest(lease_token=nested))
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED

    # Nothing above was an internal error in the api.
    assert "rpc.failed" not in api.log()


async def test_listings_are_bounded_in_bytes_and_pages(
    cluster: Cluster, store: PostgresBroker
) -> None:
    target = await cluster.start_services()
    async with AsyncClient(target) as client, AsyncAdminClient(target) as admin:
        # Six tasks of 900 kB: one page of them would be 5.4 MB; the api stops at 4 MiB.
        big = [
            await client.enqueue("e2e.noop", "x" * 900_000, queue="big", process_in=3600)
            for _ in range(6)
        ]
        first = await admin.list_tasks(queue="big")
        assert [t.id for t in first.tasks] == [t.id for t in big[:4]]
        assert first.tasks[0].payload == "x" * 900_000
        assert first.next_cursor is not None
        rest = await admin.list_tasks(queue="big", cursor=first.next_cursor)
        assert [t.id for t in rest.tasks] == [t.id for t in big[4:]]
        assert rest.next_cursor is None
        bare = await admin.list_tasks(queue="big", with_payloads=False)
        assert [t.id for t in bare.tasks] == [t.id for t in big]
        assert all(t.payload is None for t in bare.tasks)
        assert [t.id async for t in admin.iter_tasks(queue="big", page_size=1000)] == [
            t.id for t in big
        ]

        # Queues page by name.
        names = [f"paged-{n:02d}" for n in range(25)]
        await client.enqueue_batch([spec("e2e.noop", {}, queue=q, process_in=3600) for q in names])
        page = await admin.list_queues(limit=10)
        assert len(page.queues) == 10
        assert page.next_cursor is not None
        listed = [q.name async for q in admin.iter_queues(page_size=10)]
        assert listed == sorted(["big", *names])
