"""AsyncAdminClient and AdminClient against a scripted AdminService double on a real gRPC
socket: what they send, how they read answers, errors and event streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import grpc.aio
import pytest
from conveyor import (
    AdminClient,
    AsyncAdminClient,
    BatchActionResult,
    FailedPrecondition,
    InvalidArgument,
    QueueInfo,
    QueuePage,
    TaskEvent,
    TaskNotFound,
    TaskState,
)
from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb
from google.protobuf.message import Message

T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
ULID_A = "01HZZZZZZZZZZZZZZZZZZZZZZA"
ULID_B = "01HZZZZZZZZZZZZZZZZZZZZZZB"

_UNARY: dict[str, type[Message]] = {
    "GetTask": svc.GetTaskRequest,
    "ListTasks": svc.ListTasksRequest,
    "ListQueues": svc.ListQueuesRequest,
    "GetQueueStats": svc.GetQueueStatsRequest,
    "PauseQueue": svc.PauseQueueRequest,
    "ResumeQueue": svc.ResumeQueueRequest,
    "CancelTask": svc.TaskActionRequest,
    "RunTaskNow": svc.TaskActionRequest,
    "DeleteTask": svc.TaskActionRequest,
    "ArchiveTask": svc.TaskActionRequest,
    "ReviveTask": svc.TaskActionRequest,
    "RescheduleTask": svc.RescheduleTaskRequest,
    "BatchTaskAction": svc.BatchTaskActionRequest,
}


def wire_task(task_id: str = ULID_A, state: pb.TaskState = pb.TASK_STATE_ARCHIVED) -> pb.Task:
    task = pb.Task(id=task_id, queue="q", type="t", state=state, payload=b'{"n":1}')
    task.created_at.FromDatetime(T0)
    task.updated_at.FromDatetime(T0)
    return task


def wire_event(
    task_id: str, state: pb.TaskState, previous: pb.TaskState = pb.TASK_STATE_UNSPECIFIED
) -> svc.TaskEvent:
    event = svc.TaskEvent(
        task_id=task_id, queue="q", type="t", state=state, previous_state=previous
    )
    event.at.FromDatetime(T0)
    return event


@dataclass
class AdminDouble:
    """A scripted conveyor.v1.AdminService: records requests; answers per method."""

    replies: dict[str, Callable[[Any], Message] | grpc.StatusCode] = field(default_factory=dict)
    requests: list[tuple[str, Any]] = field(default_factory=list)
    events: list[svc.TaskEvent] = field(default_factory=list)

    def handler(self) -> grpc.GenericRpcHandler:
        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            name: grpc.unary_unary_rpc_method_handler(
                self._unary(name),
                request_deserializer=kind.FromString,
                response_serializer=lambda m: m.SerializeToString(),
            )
            for name, kind in _UNARY.items()
        }
        methods["WatchEvents"] = grpc.unary_stream_rpc_method_handler(
            self._watch,
            request_deserializer=svc.WatchEventsRequest.FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )
        return grpc.method_handlers_generic_handler("conveyor.v1.AdminService", methods)

    def _unary(self, name: str) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]:
        async def behaviour(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            self.requests.append((name, request))
            reply = self.replies[name]
            if isinstance(reply, grpc.StatusCode):
                await context.abort(reply, f"{name} refused")
            return reply(request)

        return behaviour

    async def _watch(
        self, request: svc.WatchEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[svc.TaskEvent]:
        self.requests.append(("WatchEvents", request))
        if "WatchEvents" in self.replies:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad filter")
        await context.send_initial_metadata(())
        for event in self.events:
            yield event


@pytest.fixture
async def double() -> AsyncIterator[tuple[AdminDouble, str]]:
    service = AdminDouble()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield service, f"127.0.0.1:{port}"
    await server.stop(None)


async def test_task_actions_send_the_id_and_read_the_task(double: tuple[AdminDouble, str]) -> None:
    service, target = double
    service.replies["GetTask"] = lambda r: svc.GetTaskResponse(task=wire_task(r.id))
    for name in ("CancelTask", "RunTaskNow", "ArchiveTask", "ReviveTask"):
        service.replies[name] = lambda r: svc.TaskActionResponse(task=wire_task(r.id))
    service.replies["DeleteTask"] = lambda _: svc.TaskActionResponse()
    service.replies["RescheduleTask"] = lambda r: svc.TaskActionResponse(task=wire_task(r.id))
    async with AsyncAdminClient(target) as admin:
        got = await admin.get_task(ULID_A)
        assert (got.id, got.state, got.payload) == (ULID_A, TaskState.ARCHIVED, {"n": 1})
        assert (await admin.cancel_task(ULID_B)).id == ULID_B
        await admin.run_task_now(ULID_A)
        await admin.archive_task(ULID_A)
        await admin.revive_task(ULID_A)
        assert await admin.delete_task(ULID_A) is None  # type: ignore[func-returns-value]
        await admin.reschedule_task(ULID_A, T0 + timedelta(hours=1))
        with pytest.raises(InvalidArgument, match="timezone-aware"):
            await admin.reschedule_task(ULID_A, datetime(2030, 1, 1))
    names = [name for name, _ in service.requests]
    assert names == [
        "GetTask",
        "CancelTask",
        "RunTaskNow",
        "ArchiveTask",
        "ReviveTask",
        "DeleteTask",
        "RescheduleTask",
    ]
    assert service.requests[1][1].id == ULID_B
    assert service.requests[-1][1].process_at.ToDatetime(tzinfo=UTC) == T0 + timedelta(hours=1)


async def test_errors_name_the_task(double: tuple[AdminDouble, str]) -> None:
    service, target = double
    service.replies["CancelTask"] = grpc.StatusCode.NOT_FOUND
    service.replies["ReviveTask"] = grpc.StatusCode.FAILED_PRECONDITION
    async with AsyncAdminClient(target) as admin:
        with pytest.raises(TaskNotFound) as info:
            await admin.cancel_task(ULID_A)
        assert info.value.task_id == ULID_A
        with pytest.raises(FailedPrecondition, match="ReviveTask refused"):
            await admin.revive_task(ULID_A)


async def test_list_tasks_pages_and_filters(double: tuple[AdminDouble, str]) -> None:
    service, target = double
    pages = {
        "": svc.ListTasksResponse(tasks=[wire_task(ULID_A)], next_cursor="c1"),
        "c1": svc.ListTasksResponse(tasks=[wire_task(ULID_B)]),
    }
    service.replies["ListTasks"] = lambda request: pages[request.cursor]
    async with AsyncAdminClient(target) as admin:
        page = await admin.list_tasks(queue="q", state="archived", limit=1)
        assert [t.id for t in page.tasks] == [ULID_A]
        assert page.next_cursor == "c1"
        every = [t.id async for t in admin.iter_tasks(queue="q", state=TaskState.ARCHIVED)]
        assert every == [ULID_A, ULID_B]
        with pytest.raises(InvalidArgument, match="limit"):
            await admin.list_tasks(limit=0)
        with pytest.raises(InvalidArgument, match="unknown task state"):
            await admin.list_tasks(state="lost")
        with pytest.raises(InvalidArgument, match="cannot filter"):
            await admin.list_tasks(state=TaskState.UNKNOWN)
    first: svc.ListTasksRequest = service.requests[0][1]
    assert (first.queue, first.state, first.limit, first.cursor) == (
        "q",
        pb.TASK_STATE_ARCHIVED,
        1,
        "",
    )
    assert not first.omit_payloads


async def test_list_tasks_can_leave_payloads_out(double: tuple[AdminDouble, str]) -> None:
    service, target = double
    bare = pb.Task(id=ULID_A, queue="q", type="t", state=pb.TASK_STATE_COMPLETED)
    service.replies["ListTasks"] = lambda _: svc.ListTasksResponse(tasks=[bare])
    async with AsyncAdminClient(target) as admin:
        page = await admin.list_tasks(with_payloads=False)
        [task] = page.tasks
        assert (task.payload, task.result, task.progress) == (None, None, None)
        assert [t.id async for t in admin.iter_tasks(with_payloads=False)] == [ULID_A]

    def blocking() -> None:
        with AdminClient(target) as admin:
            assert [t.id for t in admin.iter_tasks(with_payloads=False)] == [ULID_A]
            assert admin.list_tasks().tasks[0].id == ULID_A

    await asyncio.to_thread(blocking)
    sent = [request.omit_payloads for name, request in service.requests if name == "ListTasks"]
    assert sent == [True, True, True, False]


async def test_batch_actions_select_by_ids_or_by_queue_and_state(
    double: tuple[AdminDouble, str],
) -> None:
    service, target = double
    service.replies["BatchTaskAction"] = lambda _: svc.BatchTaskActionResponse(
        affected=1, failures={ULID_B: "cannot cancel"}
    )
    async with AsyncAdminClient(target) as admin:
        result = await admin.cancel_tasks([ULID_A, ULID_B])
        assert result == BatchActionResult(affected=1, failures={ULID_B: "cannot cancel"})
        await admin.revive_tasks(queue="q", state="archived")
        await admin.reschedule_tasks(T0, queue="q")
        for call in (admin.delete_tasks, admin.archive_tasks, admin.run_tasks_now):
            await call(queue="q")
        with pytest.raises(InvalidArgument, match="not both"):
            await admin.cancel_tasks([ULID_A], queue="q")
        with pytest.raises(InvalidArgument, match="by ids, or by queue"):
            await admin.cancel_tasks()
        with pytest.raises(InvalidArgument, match="not one string"):
            await admin.cancel_tasks(ULID_A)
    requests: list[svc.BatchTaskActionRequest] = [r for _, r in service.requests]
    assert requests[0].action == svc.TASK_ACTION_CANCEL
    assert list(requests[0].selector.ids) == [ULID_A, ULID_B]
    assert requests[1].action == svc.TASK_ACTION_REVIVE
    assert (requests[1].selector.queue, requests[1].selector.state) == ("q", pb.TASK_STATE_ARCHIVED)
    assert requests[2].action == svc.TASK_ACTION_RESCHEDULE
    assert requests[2].process_at.ToDatetime(tzinfo=UTC) == T0
    assert [r.action for r in requests[3:]] == [
        svc.TASK_ACTION_DELETE,
        svc.TASK_ACTION_ARCHIVE,
        svc.TASK_ACTION_RUN_NOW,
    ]


async def test_queues(double: tuple[AdminDouble, str]) -> None:
    service, target = double
    stats = svc.QueueStats(queue="q", paused=True, counts={"pending": 2, "archived": 1, "x": 4})
    service.replies["ListQueues"] = lambda _: svc.ListQueuesResponse(queues=[stats])
    service.replies["GetQueueStats"] = lambda r: svc.GetQueueStatsResponse(
        stats=svc.QueueStats(queue=r.queue)
    )
    service.replies["PauseQueue"] = lambda _: svc.PauseQueueResponse()
    service.replies["ResumeQueue"] = lambda _: svc.ResumeQueueResponse()
    async with AsyncAdminClient(target) as admin:
        page = await admin.list_queues()
        assert page.next_cursor is None
        [queue] = page.queues
        assert isinstance(queue, QueueInfo)
        assert (queue.name, queue.paused, queue.total) == ("q", True, 7)
        assert queue.count(TaskState.PENDING) == 2
        assert queue.count(TaskState.UNKNOWN) == 4
        assert queue.count(TaskState.ACTIVE) == 0
        assert (await admin.queue_stats("other")).name == "other"
        await admin.pause_queue("q")
        await admin.resume_queue("q")
    assert [(n, getattr(r, "queue", None)) for n, r in service.requests[2:]] == [
        ("PauseQueue", "q"),
        ("ResumeQueue", "q"),
    ]


async def test_list_queues_pages(double: tuple[AdminDouble, str]) -> None:
    service, target = double
    pages = {
        "": svc.ListQueuesResponse(
            queues=[svc.QueueStats(queue="a"), svc.QueueStats(queue="b")], next_cursor="b"
        ),
        "b": svc.ListQueuesResponse(queues=[svc.QueueStats(queue="c")]),
    }
    service.replies["ListQueues"] = lambda request: pages[request.cursor]
    async with AsyncAdminClient(target) as admin:
        first = await admin.list_queues(limit=2)
        assert isinstance(first, QueuePage)
        assert [q.name for q in first.queues] == ["a", "b"]
        assert first.next_cursor == "b"
        last = await admin.list_queues(limit=2, cursor=first.next_cursor)
        assert [q.name for q in last.queues] == ["c"]
        assert last.next_cursor is None
        assert [q.name async for q in admin.iter_queues(page_size=2)] == ["a", "b", "c"]
        for limit in (0, 1001, True):
            with pytest.raises(InvalidArgument, match="limit"):
                await admin.list_queues(limit=limit)

    def blocking() -> list[str]:
        with AdminClient(target) as admin:
            return [q.name for q in admin.iter_queues()]

    assert await asyncio.to_thread(blocking) == ["a", "b", "c"]
    sent = [(r.limit, r.cursor) for name, r in service.requests if name == "ListQueues"]
    assert sent == [(2, ""), (2, "b"), (2, ""), (2, "b"), (100, ""), (100, "b")]


async def test_watch_events_async(double: tuple[AdminDouble, str]) -> None:
    service, target = double
    service.events = [
        wire_event(ULID_A, pb.TASK_STATE_PENDING),
        wire_event(ULID_A, pb.TASK_STATE_UNSPECIFIED, pb.TASK_STATE_PENDING),
    ]
    async with AsyncAdminClient(target) as admin:
        async with admin.watch_events(queues="q", states=["pending", "archived"]) as events:
            got = [event async for event in events]
        assert got == [
            TaskEvent(ULID_A, "q", "t", TaskState.PENDING, None, T0),
            TaskEvent(ULID_A, "q", "t", None, TaskState.PENDING, T0),
        ]
        assert got[1].deleted
        service.replies["WatchEvents"] = grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(InvalidArgument, match="bad filter"):
            async with admin.watch_events():
                pass
    request: svc.WatchEventsRequest = service.requests[0][1]
    assert list(request.queues) == ["q"]
    assert list(request.states) == [pb.TASK_STATE_PENDING, pb.TASK_STATE_ARCHIVED]


async def test_the_blocking_client(double: tuple[AdminDouble, str]) -> None:
    service, target = double
    service.replies["CancelTask"] = lambda r: svc.TaskActionResponse(task=wire_task(r.id))
    service.replies["GetTask"] = grpc.StatusCode.NOT_FOUND
    service.replies["BatchTaskAction"] = lambda _: svc.BatchTaskActionResponse(affected=3)
    service.events = [wire_event(ULID_B, pb.TASK_STATE_ACTIVE, pb.TASK_STATE_PENDING)]

    def run() -> list[TaskEvent]:
        with AdminClient(target) as admin:
            assert admin.cancel_task(ULID_A).id == ULID_A
            with pytest.raises(TaskNotFound):
                admin.get_task(ULID_B)
            assert admin.archive_tasks(queue="q").affected == 3
            with admin.watch_events() as events:
                return list(events)

    [event] = await asyncio.to_thread(run)
    assert (event.task_id, event.state, event.previous_state) == (
        ULID_B,
        TaskState.ACTIVE,
        TaskState.PENDING,
    )
