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
    Breaker,
    BreakerConfig,
    BreakerConfigNotFound,
    BreakerScope,
    BreakerState,
    FailedPrecondition,
    InvalidArgument,
    QueueInfo,
    QueuePage,
    TaskEvent,
    TaskNotFound,
    TaskState,
    Unauthenticated,
    WhoAmI,
)
from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb
from google.protobuf.duration_pb2 import Duration
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
    "SetBreakerConfig": svc.SetBreakerConfigRequest,
    "DeleteBreakerConfig": svc.DeleteBreakerConfigRequest,
    "ListBreakerConfigs": svc.ListBreakerConfigsRequest,
    "ListBreakers": svc.ListBreakersRequest,
    "WhoAmI": svc.WhoAmIRequest,
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


async def test_whoami_reads_the_callers_role_both_ways(double: tuple[AdminDouble, str]) -> None:
    service, target = double
    service.replies["WhoAmI"] = lambda _: svc.WhoAmIResponse(
        role="read-only", token_name="dash", auth_enabled=True, can_read=True
    )
    expected = WhoAmI(
        role="read-only",
        token_name="dash",
        auth_enabled=True,
        read_only=False,
        can_read=True,
        can_mutate=False,
    )
    async with AsyncAdminClient(target, token="dash-secret-0123456789") as admin:
        assert await admin.whoami() == expected

    def blocking() -> WhoAmI:
        with AdminClient(target) as admin:
            return admin.whoami()

    assert await asyncio.to_thread(blocking) == expected
    service.replies["WhoAmI"] = lambda _: svc.WhoAmIResponse(
        role="admin", auth_enabled=False, can_read=True, can_mutate=True
    )
    async with AsyncAdminClient(target) as admin:
        assert (await admin.whoami()).token_name is None
    service.replies["WhoAmI"] = grpc.StatusCode.UNAUTHENTICATED
    async with AsyncAdminClient(target) as admin:
        with pytest.raises(Unauthenticated):
            await admin.whoami()
    assert [name for name, _ in service.requests] == ["WhoAmI"] * 4


# ------------------------------------------------------------- circuit breakers


def wire_breaker(
    queue: str = "q", type: str = "pay.charge", gateway: str = "gw-1", state: str = "open"
) -> svc.Breaker:
    breaker = svc.Breaker(
        queue=queue,
        type=type,
        scope=svc.BREAKER_SCOPE_WORKER if gateway else svc.BREAKER_SCOPE_QUEUE,
        gateway=gateway,
        worker_id=f"worker-of-{gateway}" if gateway else "",
        state=state,
        failures=5,
    )
    breaker.opened_at.FromDatetime(T0)
    breaker.until.FromDatetime(T0 + timedelta(seconds=30))
    return breaker


async def test_breaker_configs_send_what_was_asked_and_read_what_was_stored(
    double: tuple[AdminDouble, str],
) -> None:
    service, target = double
    service.replies["SetBreakerConfig"] = lambda r: svc.SetBreakerConfigResponse(config=r.config)
    service.replies["ListBreakerConfigs"] = lambda r: svc.ListBreakerConfigsResponse(
        configs=[
            svc.BreakerConfig(
                queue=r.queue or "q",
                pattern="*",
                failures=5,
                window=Duration(seconds=60),
                cooldown=Duration(seconds=30),
                scope=svc.BREAKER_SCOPE_WORKER,
            )
        ]
    )
    service.replies["DeleteBreakerConfig"] = lambda _: svc.DeleteBreakerConfigResponse()
    async with AsyncAdminClient(target) as admin:
        stored = await admin.set_breaker_config("q", 5, 60, timedelta(milliseconds=1500))
        assert stored == BreakerConfig(
            queue="q",
            pattern="*",
            failures=5,
            window=timedelta(seconds=60),
            cooldown=timedelta(seconds=1.5),
            scope=BreakerScope.WORKER,
        )
        queue_wide = await admin.set_breaker_config("q", 2, 10.5, 1, pattern="pay.*", scope="queue")
        assert (queue_wide.pattern, queue_wide.scope) == ("pay.*", BreakerScope.QUEUE)
        assert await admin.list_breaker_configs() == [
            BreakerConfig("q", "*", 5, timedelta(seconds=60), timedelta(seconds=30))
        ]
        [other] = await admin.list_breaker_configs("other")
        assert other.queue == "other"
        await admin.delete_breaker_config("q", pattern="pay.*")
        await admin.delete_breaker_config("q")
    sent = [r for name, r in service.requests if name == "SetBreakerConfig"]
    assert [(r.config.queue, r.config.failures, r.config.pattern) for r in sent] == [
        ("q", 5, "*"),
        ("q", 2, "pay.*"),
    ]
    assert (sent[1].config.window.seconds, sent[1].config.window.nanos) == (10, 500_000_000)
    assert [r.config.scope for r in sent] == [svc.BREAKER_SCOPE_WORKER, svc.BREAKER_SCOPE_QUEUE]
    listed = [r.queue for name, r in service.requests if name == "ListBreakerConfigs"]
    assert listed == ["", "other"]
    deleted = [
        (r.queue, r.pattern) for name, r in service.requests if name == "DeleteBreakerConfig"
    ]
    assert deleted == [("q", "pay.*"), ("q", "*")]


async def test_breaker_config_errors(double: tuple[AdminDouble, str]) -> None:
    service, target = double
    service.replies["DeleteBreakerConfig"] = grpc.StatusCode.NOT_FOUND
    service.replies["SetBreakerConfig"] = grpc.StatusCode.INVALID_ARGUMENT
    async with AsyncAdminClient(target) as admin:
        with pytest.raises(BreakerConfigNotFound) as info:
            await admin.delete_breaker_config("q", pattern="pay.*")
        assert (info.value.queue, info.value.pattern, info.value.code) == (
            "q",
            "pay.*",
            "NOT_FOUND",
        )
        assert isinstance(info.value, LookupError)
        # The server's refusal of a value is InvalidArgument with its message.
        with pytest.raises(InvalidArgument, match="SetBreakerConfig refused"):
            await admin.set_breaker_config("q", 5, 60, 0.01)
        # What the SDK can tell is wrong never reaches the server.
        sent_before = len(service.requests)
        for kwargs, says in (
            ({"failures": 0}, "failures"),
            ({"failures": True}, "failures"),
            ({"failures": 2.5}, "failures"),
            ({"window": "60"}, "window"),
            ({"window": None}, "window is required"),
            ({"cooldown": None}, "cooldown is required"),
            ({"window": float("inf")}, "window is out of range"),
            ({"cooldown": float("nan")}, "cooldown is out of range"),
            ({"scope": "everyone"}, "scope must be 'worker' or 'queue'"),
        ):
            arguments: dict[str, Any] = {"failures": 5, "window": 60, "cooldown": 30, **kwargs}
            scope = arguments.pop("scope", "worker")
            with pytest.raises(InvalidArgument, match=says):
                await admin.set_breaker_config("q", scope=scope, **arguments)
        assert len(service.requests) == sent_before


async def test_breakers_and_queue_stats_show_the_ones_not_closed(
    double: tuple[AdminDouble, str],
) -> None:
    service, target = double
    service.replies["ListBreakers"] = lambda r: svc.ListBreakersResponse(
        breakers=[
            wire_breaker(),
            wire_breaker(type="pay.refund", gateway="", state="half_open"),
            wire_breaker(type="pay.new", state="something_newer"),
        ]
    )
    service.replies["GetQueueStats"] = lambda r: svc.GetQueueStatsResponse(
        stats=svc.QueueStats(queue=r.queue, counts={"pending": 1}, breakers=[wire_breaker()])
    )
    service.replies["ListQueues"] = lambda _: svc.ListQueuesResponse(
        queues=[svc.QueueStats(queue="a"), svc.QueueStats(queue="q", breakers=[wire_breaker()])]
    )
    expected = Breaker(
        queue="q",
        type="pay.charge",
        scope=BreakerScope.WORKER,
        state=BreakerState.OPEN,
        opened_at=T0,
        until=T0 + timedelta(seconds=30),
        failures=5,
        gateway="gw-1",
        worker_id="worker-of-gw-1",
    )
    async with AsyncAdminClient(target) as admin:
        worker, queue_wide, newer = await admin.list_breakers()
        assert worker == expected
        assert (queue_wide.scope, queue_wide.state) == (BreakerScope.QUEUE, BreakerState.HALF_OPEN)
        assert (queue_wide.gateway, queue_wide.worker_id) == (None, None)
        assert newer.state is BreakerState.UNKNOWN
        await admin.list_breakers("q")
        stats = await admin.queue_stats("q")
        assert list(stats.breakers) == [expected]
        assert stats.count(TaskState.PENDING) == 1
        page = await admin.list_queues()
        assert {q.name: list(q.breakers) for q in page.queues} == {"a": [], "q": [expected]}
    asked = [r.queue for name, r in service.requests if name == "ListBreakers"]
    assert asked == ["", "q"]


async def test_breaker_events_are_no_task_events(double: tuple[AdminDouble, str]) -> None:
    service, target = double
    opened = svc.TaskEvent(queue="q", type="pay.charge", breaker=wire_breaker())
    opened.at.FromDatetime(T0)
    closed = svc.TaskEvent(
        queue="q", type="pay.charge", breaker=wire_breaker(gateway="", state="closed")
    )
    closed.at.FromDatetime(T0)
    service.events = [opened, wire_event(ULID_A, pb.TASK_STATE_UNSPECIFIED), closed]
    async with AsyncAdminClient(target) as admin, admin.watch_events(queues="q") as events:
        first, deleted, last = [event async for event in events]
    assert first.breaker is not None
    assert (first.task_id, first.state, first.deleted) == ("", None, False)
    assert (first.breaker.state, first.breaker.worker_id) == (BreakerState.OPEN, "worker-of-gw-1")
    assert deleted.deleted
    assert deleted.breaker is None
    assert last.breaker is not None
    assert (last.breaker.state, last.breaker.scope) == (BreakerState.CLOSED, BreakerScope.QUEUE)


async def test_the_blocking_client_has_the_breakers_too(double: tuple[AdminDouble, str]) -> None:
    service, target = double
    service.replies["SetBreakerConfig"] = lambda r: svc.SetBreakerConfigResponse(config=r.config)
    service.replies["ListBreakerConfigs"] = lambda _: svc.ListBreakerConfigsResponse()
    service.replies["ListBreakers"] = lambda _: svc.ListBreakersResponse(breakers=[wire_breaker()])
    service.replies["DeleteBreakerConfig"] = grpc.StatusCode.NOT_FOUND

    def run() -> tuple[BreakerConfig, list[Breaker]]:
        with AdminClient(target) as admin:
            stored = admin.set_breaker_config(
                "q", 3, timedelta(minutes=2), 5, scope=BreakerScope.QUEUE
            )
            assert admin.list_breaker_configs("q") == []
            with pytest.raises(BreakerConfigNotFound):
                admin.delete_breaker_config("q")
            return stored, admin.list_breakers()

    stored, breakers = await asyncio.to_thread(run)
    assert (stored.failures, stored.window, stored.cooldown, stored.scope) == (
        3,
        timedelta(minutes=2),
        timedelta(seconds=5),
        BreakerScope.QUEUE,
    )
    assert [b.type for b in breakers] == ["pay.charge"]
