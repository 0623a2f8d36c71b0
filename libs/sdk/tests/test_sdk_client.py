"""AsyncClient and Client against a scripted TaskService double on a real gRPC socket."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import grpc.aio
import pytest
from conveyor import (
    AlreadyExists,
    AsyncClient,
    Client,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    OnFailure,
    TaskInfo,
    TaskNotFound,
    TaskState,
    Unavailable,
    spec,
)
from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb
from google.protobuf.message import Message

T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
ULID_A = "01HZZZZZZZZZZZZZZZZZZZZZZA"
ULID_B = "01HZZZZZZZZZZZZZZZZZZZZZZB"


@dataclass
class Abort:
    code: grpc.StatusCode
    details: str
    trailing: tuple[tuple[str, str], ...] = ()


Reply = Callable[[Any], Message] | Abort | None


def stored(new: pb.NewTask, task_id: str = ULID_A, state: int = pb.TASK_STATE_PENDING) -> pb.Task:
    task = pb.Task(
        id=task_id,
        queue=new.queue,
        type=new.type,
        payload=new.payload,
        headers=dict(new.headers),
        options=new.options,
        state=state,  # type: ignore[arg-type]
        max_retry=new.options.max_retry if new.options.HasField("max_retry") else 25,
    )
    task.created_at.FromDatetime(T0)
    task.updated_at.FromDatetime(T0)
    return task


@dataclass
class TaskServiceDouble:
    """A scripted conveyor.v1.TaskService: records each request and its metadata, and
    answers with the reply the test set for that method."""

    replies: dict[str, Reply] = field(default_factory=dict)
    requests: list[tuple[str, Any, dict[str, str]]] = field(default_factory=list)

    def handler(self) -> grpc.GenericRpcHandler:
        types: dict[str, type[Message]] = {
            "Enqueue": svc.EnqueueRequest,
            "EnqueueBatch": svc.EnqueueBatchRequest,
            "EnqueueTx": svc.EnqueueTxRequest,
            "GetTask": svc.GetTaskRequest,
        }
        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            name: grpc.unary_unary_rpc_method_handler(
                self._behaviour(name),
                request_deserializer=request_type.FromString,
                response_serializer=lambda m: m.SerializeToString(),
            )
            for name, request_type in types.items()
        }
        return grpc.method_handlers_generic_handler("conveyor.v1.TaskService", methods)

    def _behaviour(self, name: str) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]:
        async def behaviour(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            metadata = {k: str(v) for k, v in (context.invocation_metadata() or ())}
            self.requests.append((name, request, metadata))
            reply = self.replies.get(name)
            if reply is None:
                await asyncio.Event().wait()  # never answers: the client's timeout ends it
            if isinstance(reply, Abort):
                await context.abort(reply.code, reply.details, trailing_metadata=reply.trailing)
            assert callable(reply)
            return reply(request)

        return behaviour


@pytest.fixture
async def double() -> AsyncIterator[tuple[TaskServiceDouble, str]]:
    service = TaskServiceDouble()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield service, f"127.0.0.1:{port}"
    await server.stop(None)


async def test_enqueue_sends_every_option_and_reads_the_task_back(
    double: tuple[TaskServiceDouble, str],
) -> None:
    service, target = double

    def reply(request: svc.EnqueueRequest) -> svc.EnqueueResponse:
        task = stored(request.task, state=pb.TASK_STATE_ACTIVE)
        task.result = b'{"ok":true}'
        task.progress = b"[1,2]"
        task.retried = 2
        task.last_error = "ValueError: x"
        task.started_at.FromDatetime(T0 + timedelta(seconds=1))
        return svc.EnqueueResponse(task=task, created=True)

    service.replies["Enqueue"] = reply
    async with AsyncClient(target, token="tok") as client:
        info = await client.enqueue(
            "email.send",
            {"to": "a@example.com", "name": "Zoë"},
            queue="emails",
            id=ULID_A,
            headers={"trace": "t1"},
            max_retry=0,
            timeout=1.5,
            deadline=T0,
            process_in=timedelta(minutes=1),
            expires_at=T0 + timedelta(days=1),
            retention=0,
            unique_key="u",
            unique_ttl=60,
            group="g",
            depends_on=[ULID_B],
            on_failure="cascade_cancel",
            concurrency_key="tenant-1",
        )
    name, request, metadata = service.requests[0]
    assert name == "Enqueue"
    assert metadata["authorization"] == "Bearer tok"
    new: pb.NewTask = request.task
    assert (new.id, new.queue, new.type) == (ULID_A, "emails", "email.send")
    assert new.payload == '{"to":"a@example.com","name":"Zoë"}'.encode()
    assert dict(new.headers) == {"trace": "t1"}
    options = new.options
    assert options.HasField("max_retry")
    assert options.max_retry == 0
    assert options.timeout.ToTimedelta() == timedelta(seconds=1.5)
    assert options.deadline.ToDatetime(tzinfo=UTC) == T0
    assert not options.HasField("process_at")
    assert options.process_in.ToTimedelta() == timedelta(minutes=1)
    assert options.HasField("retention")
    assert options.retention.ToTimedelta() == timedelta(0)
    assert options.unique_ttl.ToTimedelta() == timedelta(seconds=60)
    assert (options.unique_key, options.group, options.concurrency_key) == ("u", "g", "tenant-1")
    assert list(options.depends_on) == [ULID_B]
    assert options.on_failure == pb.ON_FAILURE_CASCADE_CANCEL

    assert isinstance(info, TaskInfo)
    assert (info.id, info.queue, info.type, info.state) == (
        ULID_A,
        "emails",
        "email.send",
        TaskState.ACTIVE,
    )
    assert info.payload == {"to": "a@example.com", "name": "Zoë"}
    assert (info.result, info.progress) == ({"ok": True}, [1, 2])
    assert (info.retried, info.max_retry, info.last_error) == (2, 0, "ValueError: x")
    assert info.created_at == T0
    assert info.created_at.tzinfo is not None
    assert info.started_at == T0 + timedelta(seconds=1)
    assert info.completed_at is None
    assert info.options.on_failure is OnFailure.CASCADE_CANCEL
    assert info.options.timeout == timedelta(seconds=1.5)
    assert info.options.depends_on == (ULID_B,)


async def test_unique_key_conflict_raises_already_exists_with_the_existing_id(
    double: tuple[TaskServiceDouble, str],
) -> None:
    service, target = double
    service.replies["Enqueue"] = Abort(
        grpc.StatusCode.ALREADY_EXISTS, "unique key taken", (("conveyor-existing-id", ULID_B),)
    )
    async with AsyncClient(target) as client:
        with pytest.raises(AlreadyExists) as caught:
            await client.enqueue("t", unique_key="k")
    assert caught.value.existing_id == ULID_B
    assert caught.value.code == "ALREADY_EXISTS"
    assert "unique key taken" in str(caught.value)


async def test_get_task_reads_a_task_and_maps_not_found(
    double: tuple[TaskServiceDouble, str],
) -> None:
    service, target = double
    service.replies["GetTask"] = lambda request: svc.GetTaskResponse(
        task=stored(pb.NewTask(queue="q", type="t"), task_id=request.id)
    )
    async with AsyncClient(target) as client:
        info = await client.get_task(ULID_B)
        assert (info.id, info.state, info.payload) == (ULID_B, TaskState.PENDING, None)
        service.replies["GetTask"] = Abort(grpc.StatusCode.NOT_FOUND, "no such task")
        with pytest.raises(TaskNotFound) as caught:
            await client.get_task(ULID_A)
    assert caught.value.task_id == ULID_A
    assert service.requests[0][1].id == ULID_B


def batch_reply(request: svc.EnqueueBatchRequest) -> svc.EnqueueBatchResponse:
    first, _second, _third = request.tasks
    return svc.EnqueueBatchResponse(
        results=[
            svc.EnqueueItemResult(task=stored(first), created=True),
            svc.EnqueueItemResult(
                error_code="ALREADY_EXISTS", error="unique key taken", existing_id=ULID_B
            ),
            svc.EnqueueItemResult(error_code="INVALID_ARGUMENT", error="bad payload"),
        ]
    )


async def test_enqueue_batch_reports_each_item_on_its_own(
    double: tuple[TaskServiceDouble, str],
) -> None:
    service, target = double
    service.replies["EnqueueBatch"] = batch_reply
    async with AsyncClient(target) as client:
        results = await client.enqueue_batch(
            [client.spec("a", 1), spec("b", 2, unique_key="k"), spec("c", 3, queue="other")]
        )
    assert [r.ok for r in results] == [True, False, False]
    assert results[0].task is not None
    assert results[0].task.payload == 1
    assert results[0].created
    assert isinstance(results[1].error, AlreadyExists)
    assert results[1].error.existing_id == ULID_B
    assert isinstance(results[2].error, InvalidArgument)
    sent = service.requests[0][1].tasks
    assert [(t.type, t.payload, t.queue) for t in sent] == [
        ("a", b"1", "default"),
        ("b", b"2", "default"),
        ("c", b"3", "other"),
    ]


async def test_enqueue_tx_is_all_or_nothing(double: tuple[TaskServiceDouble, str]) -> None:
    service, target = double
    service.replies["EnqueueTx"] = lambda request: svc.EnqueueTxResponse(
        tasks=[stored(t, task_id=i) for t, i in zip(request.tasks, (ULID_A, ULID_B), strict=True)]
    )
    async with AsyncClient(target) as client:
        tasks = await client.enqueue_tx([spec("a"), spec("b")])
        assert [t.id for t in tasks] == [ULID_A, ULID_B]
        service.replies["EnqueueTx"] = Abort(grpc.StatusCode.FAILED_PRECONDITION, "dependency gone")
        with pytest.raises(FailedPrecondition, match="dependency gone"):
            await client.enqueue_tx([spec("a"), spec("b")])


async def test_bad_input_is_refused_before_anything_is_sent(
    double: tuple[TaskServiceDouble, str],
) -> None:
    service, target = double
    async with AsyncClient(target) as client:
        with pytest.raises(InvalidArgument, match="queue"):
            await client.enqueue("t", queue="no spaces allowed")
        with pytest.raises(InvalidArgument, match="at most 1000"):
            await client.enqueue_batch([spec("t")] * 1001)
        with pytest.raises(InvalidArgument, match="encode"):
            await client.enqueue("t", {"not json": object()})
    assert service.requests == []


async def test_sync_client_has_the_same_methods(double: tuple[TaskServiceDouble, str]) -> None:
    service, target = double
    service.replies["Enqueue"] = lambda r: svc.EnqueueResponse(task=stored(r.task), created=True)
    service.replies["EnqueueBatch"] = batch_reply
    service.replies["EnqueueTx"] = lambda r: svc.EnqueueTxResponse(tasks=[stored(r.tasks[0])])
    service.replies["GetTask"] = Abort(grpc.StatusCode.NOT_FOUND, "no such task")

    def use_client() -> tuple[TaskInfo, list[bool], list[TaskInfo], TaskNotFound | None]:
        with Client(target, token="sync") as client:
            info = client.enqueue("t", {"x": 1}, process_at=T0)
            batch = [r.ok for r in client.enqueue_batch([spec("a"), spec("b"), spec("c")])]
            tx = client.enqueue_tx([spec("a")])
            try:
                client.get_task(ULID_B)
            except TaskNotFound as exc:
                return info, batch, tx, exc
            return info, batch, tx, None

    # The double serves on this event loop, so the blocking client runs in a thread.
    info, batch, tx, missing = await asyncio.to_thread(use_client)
    assert info.payload == {"x": 1}
    assert info.options.process_at == T0
    assert batch == [True, False, False]
    assert [t.id for t in tx] == [ULID_A]
    assert missing is not None
    assert missing.task_id == ULID_B
    assert {m["authorization"] for _, _, m in service.requests} == {"Bearer sync"}


async def test_unreachable_server_raises_unavailable() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with AsyncClient(f"127.0.0.1:{port}", timeout=5) as client:
        with pytest.raises(Unavailable):
            await client.get_task(ULID_A)


async def test_call_timeout_raises_deadline_exceeded(
    double: tuple[TaskServiceDouble, str],
) -> None:
    _, target = double  # no reply set: the double never answers
    async with AsyncClient(target, timeout=0.1) as client:
        with pytest.raises(DeadlineExceeded):
            await client.get_task(ULID_A)
