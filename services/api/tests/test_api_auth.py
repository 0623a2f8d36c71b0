"""Token roles over a real gRPC socket: what each role may call, what it is refused with
PERMISSION_DENIED (naming the role needed), queue-limited worker tokens, and tokens read
from a file at start."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from conveyor_api import ApiServer
from conveyor_api.auth import ADMIN_READS, ANY_ROLE
from conveyor_broker import NewTask, TaskState
from conveyor_protos.v1 import cluster_pb2, service_pb2, service_pb2_grpc, task_pb2
from conveyor_runtime import wire
from conveyor_runtime.bus import Bus
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.polling import wait_until
from conveyor_testkit.stream import MakeApi, Recorder, WorkerStream, dispatch, refused

TTL = timedelta(seconds=30)

#: name -> (role as configured, secret)
TOKENS = {
    "ops": ("admin", "ops-secret-0123456789abcdef"),
    "ci": ("producer", "ci-secret-0123456789abcdef"),
    "pool": ("worker", "pool-secret-0123456789abcdef"),
    "mailer": ("worker=emails+reports", "mailer-secret-0123456789abcdef"),
    "dash": ("read-only", "dash-secret-0123456789abcdef"),
}
SERVICES = service_pb2.DESCRIPTOR.services_by_name


def secret(name: str) -> str:
    return TOKENS[name][1]


def bearer(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {secret(name)}"),)


def entries() -> list[str]:
    return [f"{name}:{role}:{secret}" for name, (role, secret) in TOKENS.items()]


@pytest.fixture
async def secured(make_api: MakeApi) -> ApiServer:
    """An api with one token of every role."""
    return await make_api(auth_tokens=entries(), allow_unauthenticated=False)


@pytest.fixture
async def channel(secured: ApiServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{secured.port}") as ch:
        yield ch


def stub(channel: grpc.aio.Channel, service: str) -> Any:
    cls: Any = getattr(service_pb2_grpc, f"{service}Stub")
    return cls(channel)


async def unary_status(
    channel: grpc.aio.Channel, method: str, token: str
) -> tuple[grpc.StatusCode, str]:
    """Call ``method`` with an empty request (every field at its default)."""
    call = channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)
    try:
        await call(b"", metadata=bearer(token), timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def watch_status(channel: grpc.aio.Channel, token: str) -> tuple[grpc.StatusCode, str]:
    """Open WatchEvents: OK once the server has accepted the stream."""
    call = stub(channel, "AdminService").WatchEvents(
        service_pb2.WatchEventsRequest(), metadata=bearer(token)
    )
    try:
        await asyncio.wait_for(call.initial_metadata(), 10)
        code = await call.code() if call.done() else grpc.StatusCode.OK
        return code, (await call.details() if call.done() else "") or ""
    finally:
        call.cancel()


async def session_status(
    channel: grpc.aio.Channel, token: str, queues: dict[str, int]
) -> tuple[grpc.StatusCode, str]:
    """Open a session and say Hello: OK once welcomed (then end it as a worker does)."""
    worker = WorkerStream(channel, token=secret(token))
    try:
        await worker.hello(queues, 1)
    except EOFError:
        return await worker.status(), await worker.details()
    # Half-close rather than cancel: the session ends once its gateway has started.
    await worker.close()
    assert await worker.status() == grpc.StatusCode.OK
    return grpc.StatusCode.OK, ""


def allowed(token: str, service: str, method: str) -> bool:
    role = TOKENS[token][0].partition("=")[0]
    if role == "admin" or (service == "AdminService" and method in ANY_ROLE):
        return True
    return {
        "producer": service == "TaskService",
        "worker": service == "WorkerService",
        "read-only": service == "AdminService" and method in ADMIN_READS,
    }[role]


def needed(service: str, method: str) -> str:
    if service == "TaskService":
        return "producer or admin"
    if service == "WorkerService":
        return "worker or admin"
    if method in ADMIN_READS:
        return "read-only or admin"
    return "admin"


# ----------------------------------------------------------------- the matrix


@pytest.mark.parametrize("token", sorted(TOKENS))
async def test_every_call_is_allowed_or_refused_by_role(
    channel: grpc.aio.Channel, token: str
) -> None:
    """Every method of every service a bearer token reaches, for every role: allowed
    calls get past auth (whatever the empty request then earns), the rest get
    PERMISSION_DENIED naming the role they need and the token's own."""
    checked = 0
    for service in ("TaskService", "WorkerService", "AdminService"):
        for method in SERVICES[service].methods:
            path = f"/conveyor.v1.{service}/{method.name}"
            if method.client_streaming:
                code, details = await session_status(channel, token, {"emails": 1})
            elif method.server_streaming:
                code, details = await watch_status(channel, token)
            else:
                code, details = await unary_status(channel, path, token)
            if allowed(token, service, method.name):
                assert code not in (
                    grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.UNAUTHENTICATED,
                ), f"{token} must be allowed {path}: {code} {details}"
            else:
                assert code == grpc.StatusCode.PERMISSION_DENIED, f"{token} {path}: {code}"
                assert details == (
                    f"{service}.{method.name} needs role {needed(service, method.name)}; "
                    f"token {token!r} has role {TOKENS[token][0]}"
                )
            checked += 1
    assert checked == sum(len(SERVICES[s].methods) for s in SERVICES if s != "WebhookService")


# ------------------------------------------------------------------ each role


async def test_a_producer_enqueues_and_reads_its_tasks_and_nothing_else(
    channel: grpc.aio.Channel, broker: CountingBroker
) -> None:
    tasks = stub(channel, "TaskService")
    created = await tasks.Enqueue(
        service_pb2.EnqueueRequest(task=task_pb2.NewTask(queue="emails", type="send")),
        metadata=bearer("ci"),
    )
    got = await tasks.GetTask(service_pb2.GetTaskRequest(id=created.task.id), metadata=bearer("ci"))
    assert got.task.state == task_pb2.TASK_STATE_PENDING
    admin = stub(channel, "AdminService")
    code, details = await refused(
        admin.DeleteTask, service_pb2.TaskActionRequest(id=created.task.id), metadata=bearer("ci")
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details == "AdminService.DeleteTask needs role admin; token 'ci' has role producer"
    code, details = await refused(
        admin.ListTasks, service_pb2.ListTasksRequest(), metadata=bearer("ci")
    )
    assert (code, details) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "AdminService.ListTasks needs role read-only or admin; token 'ci' has role producer",
    )
    assert (await broker.get_task(created.task.id)).state is TaskState.PENDING


async def test_read_only_reads_but_changes_nothing(
    channel: grpc.aio.Channel, broker: CountingBroker
) -> None:
    task = (await broker.enqueue(NewTask(queue="emails", type="send"))).task
    admin = stub(channel, "AdminService")
    got = await admin.GetTask(service_pb2.GetTaskRequest(id=task.id), metadata=bearer("dash"))
    assert got.task.id == task.id
    listed = await admin.ListTasks(service_pb2.ListTasksRequest(), metadata=bearer("dash"))
    assert [t.id for t in listed.tasks] == [task.id]
    queues = await admin.ListQueues(service_pb2.ListQueuesRequest(), metadata=bearer("dash"))
    assert [q.queue for q in queues.queues] == ["emails"]
    await admin.GetQueueStats(
        service_pb2.GetQueueStatsRequest(queue="emails"), metadata=bearer("dash")
    )
    await admin.ListWebhookWorkers(service_pb2.ListWebhookWorkersRequest(), metadata=bearer("dash"))
    await admin.ListCronEntries(service_pb2.ListCronEntriesRequest(), metadata=bearer("dash"))
    await admin.GetClusterInfo(service_pb2.GetClusterInfoRequest(), metadata=bearer("dash"))
    for call, request in (
        (admin.CancelTask, service_pb2.TaskActionRequest(id=task.id)),
        (admin.DeleteTask, service_pb2.TaskActionRequest(id=task.id)),
        (admin.PauseQueue, service_pb2.PauseQueueRequest(queue="emails")),
        (
            admin.UpsertWebhookWorker,
            service_pb2.UpsertWebhookWorkerRequest(
                worker=service_pb2.WebhookWorker(
                    name="hook", url="https://example.com/hook", queues={"emails": 1}
                )
            ),
        ),
        (
            admin.UpsertCronEntry,
            service_pb2.UpsertCronEntryRequest(
                entry=service_pb2.CronEntry(
                    name="nightly",
                    spec="@daily",
                    task=task_pb2.NewTask(queue="emails", type="send"),
                )
            ),
        ),
        (admin.TriggerCronEntry, service_pb2.TriggerCronEntryRequest(name="nightly")),
    ):
        code, details = await refused(call, request, metadata=bearer("dash"))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "needs role admin; token 'dash' has role read-only" in details
    code, details = await refused(
        stub(channel, "TaskService").Enqueue,
        service_pb2.EnqueueRequest(task=task_pb2.NewTask(queue="emails", type="send")),
        metadata=bearer("dash"),
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "TaskService.Enqueue needs role producer or admin" in details
    assert (await broker.get_task(task.id)).state is TaskState.PENDING
    assert not await broker.queue_paused("emails")
    assert await broker.list_webhook_workers() == []
    assert await broker.list_cron_entries() == []
    assert await broker.queue_stats() != []


async def test_a_worker_token_opens_sessions_and_nothing_else(
    channel: grpc.aio.Channel, broker: CountingBroker
) -> None:
    assert await session_status(channel, "pool", {"anything": 1, "billing": 2}) == (
        grpc.StatusCode.OK,
        "",
    )
    code, details = await refused(
        stub(channel, "TaskService").Enqueue,
        service_pb2.EnqueueRequest(task=task_pb2.NewTask(queue="emails", type="send")),
        metadata=bearer("pool"),
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert (
        details == "TaskService.Enqueue needs role producer or admin; token 'pool' has role worker"
    )
    assert await broker.queue_stats() == []


async def test_admin_may_do_everything(channel: grpc.aio.Channel, broker: CountingBroker) -> None:
    created = await stub(channel, "TaskService").Enqueue(
        service_pb2.EnqueueRequest(task=task_pb2.NewTask(queue="emails", type="send")),
        metadata=bearer("ops"),
    )
    admin = stub(channel, "AdminService")
    await admin.PauseQueue(service_pb2.PauseQueueRequest(queue="emails"), metadata=bearer("ops"))
    await admin.DeleteTask(
        service_pb2.TaskActionRequest(id=created.task.id), metadata=bearer("ops")
    )
    assert await broker.queue_paused("emails")
    assert await session_status(channel, "ops", {"billing": 1}) == (grpc.StatusCode.OK, "")


# ------------------------------------------------------- queue-limited workers


@pytest.mark.parametrize(
    ("queues", "refused_queue"),
    [
        ({"billing": 1}, "'billing'"),
        ({"emails": 1, "billing": 1}, "'billing'"),
        ({"emails": 1, "billing": 1, "alerts": 1}, "'alerts' (and 1 more)"),
    ],
)
async def test_a_queue_limited_worker_is_refused_another_queue(
    channel: grpc.aio.Channel, secured: ApiServer, queues: dict[str, int], refused_queue: str
) -> None:
    code, details = await session_status(channel, "mailer", queues)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details == (
        f"token 'mailer' (role worker=emails+reports) may not serve queue {refused_queue}; "
        "it is limited to emails, reports"
    )
    # Refused before the session made a gateway: nothing registers, nothing is leased.
    assert secured.registry.gateways == {}


async def test_a_queue_limited_worker_serves_its_queues(
    channel: grpc.aio.Channel,
    secured: ApiServer,
    broker: CountingBroker,
    bus: Bus,
) -> None:
    registers = await Recorder(cluster_pb2.Register).start(bus)
    worker = WorkerStream(channel, token=secret("mailer"))
    try:
        welcome = await worker.hello({"emails": 2, "reports": 1}, 2)
        await registers.wait_for(lambda m: m.gateway == welcome.session_id, count=2)
        # A subset is fine too.
        assert await session_status(channel, "mailer", {"reports": 1}) == (
            grpc.StatusCode.OK,
            "",
        )
        await broker.enqueue(NewTask(queue="emails", type="send", payload=b"p"))
        [task] = await broker.lease("emails", 1, TTL)
        env = wire.task_to_envelope(task)
        reply = await dispatch(bus, welcome.session_id, "emails", [env])
        assert list(reply.accepted) == [task.id]
        frame = await worker.read_kind("dispatch")
        assert frame.dispatch.task.id == task.id
        # Frames after Hello go through: the result is applied.
        await worker.result(frame.dispatch.task, service_pb2.OUTCOME_SUCCESS)

        async def completed() -> bool:
            return (await broker.get_task(task.id)).state is TaskState.COMPLETED

        await wait_until(completed, message="the result is applied")
    finally:
        worker.cancel()
        await registers.stop()


# ------------------------------------------------------- unknown tokens, modes


async def test_unknown_tokens_stay_unauthenticated(channel: grpc.aio.Channel) -> None:
    enqueue = stub(channel, "TaskService").Enqueue
    request = service_pb2.EnqueueRequest(task=task_pb2.NewTask(queue="emails", type="send"))
    whole_entry = f"ci:producer:{secret('ci')}"
    for metadata in (
        None,
        (("authorization", "Bearer not-a-configured-secret"),),
        (("authorization", f"Bearer {whole_entry}"),),  # the secret alone is presented
        (("authorization", secret("ci")),),  # no scheme
    ):
        code, details = await refused(enqueue, request, metadata=metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "missing or invalid bearer token" in details
        assert secret("ci") not in details


async def test_read_only_mode_refuses_mutations_even_to_admin(
    make_api: MakeApi, broker: CountingBroker
) -> None:
    api = await make_api(auth_tokens=entries(), allow_unauthenticated=False, read_only=True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        admin = stub(ch, "AdminService")
        code, details = await refused(
            admin.PauseQueue, service_pb2.PauseQueueRequest(queue="q"), metadata=bearer("ops")
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "the server is read-only" in details
        # Auth still comes first: a producer hears about its role.
        code, details = await refused(
            admin.PauseQueue, service_pb2.PauseQueueRequest(queue="q"), metadata=bearer("ci")
        )
        assert "needs role admin" in details
        await admin.ListQueues(service_pb2.ListQueuesRequest(), metadata=bearer("dash"))
    assert not await broker.queue_paused("q")


# ------------------------------------------------------------------ who am I


async def test_every_token_learns_its_role_and_what_it_may_do(
    channel: grpc.aio.Channel,
) -> None:
    """WhoAmI answers every role (the interceptor lets it through for all), with the
    token's name and role as configured and what the AdminService allows it."""
    admin = stub(channel, "AdminService")
    seen = {}
    for name in TOKENS:
        me = await admin.WhoAmI(service_pb2.WhoAmIRequest(), metadata=bearer(name))
        assert me.token_name == name
        assert me.role == TOKENS[name][0]
        assert me.auth_enabled
        assert not me.read_only
        seen[name] = (me.can_read, me.can_mutate)
    assert seen == {
        "ops": (True, True),
        "ci": (False, False),
        "pool": (False, False),
        "mailer": (False, False),
        "dash": (True, False),
    }
    for metadata in (None, (("authorization", "Bearer not-a-configured-secret"),)):
        code, details = await refused(admin.WhoAmI, service_pb2.WhoAmIRequest(), metadata=metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "missing or invalid bearer token" in details


async def test_who_am_i_under_read_only_and_with_auth_off(make_api: MakeApi) -> None:
    strict = await make_api(auth_tokens=entries(), allow_unauthenticated=False, read_only=True)
    open_api = await make_api()  # the tests' default: no tokens, allow_unauthenticated
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{strict.port}") as ch,
        grpc.aio.insecure_channel(f"127.0.0.1:{open_api.port}") as open_ch,
    ):
        me = await stub(ch, "AdminService").WhoAmI(
            service_pb2.WhoAmIRequest(), metadata=bearer("ops")
        )
        assert (me.role, me.read_only, me.can_read, me.can_mutate) == ("admin", True, True, False)
        me = await stub(ch, "AdminService").WhoAmI(
            service_pb2.WhoAmIRequest(), metadata=bearer("ci")
        )
        assert (me.role, me.can_read, me.can_mutate) == ("producer", False, False)
        anyone = await stub(open_ch, "AdminService").WhoAmI(service_pb2.WhoAmIRequest())
        assert anyone == service_pb2.WhoAmIResponse(
            role="admin", auth_enabled=False, can_read=True, can_mutate=True
        )


async def test_webhook_callbacks_need_no_bearer_token(channel: grpc.aio.Channel) -> None:
    # Past auth (no UNAUTHENTICATED, no PERMISSION_DENIED): the lease token is checked.
    hooks = stub(channel, "WebhookService")
    code, details = await refused(
        hooks.Heartbeat, service_pb2.WebhookHeartbeatRequest(lease_token="v1.forged")
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "lease token" in details
    code, _ = await refused(
        hooks.Heartbeat,
        service_pb2.WebhookHeartbeatRequest(lease_token="v1.forged"),
        metadata=bearer("ci"),
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED


# ------------------------------------------------------------- a tokens file


async def test_tokens_are_read_from_a_file_at_start(make_api: MakeApi, tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(
        "# Conveyor api tokens: name:role:secret\n"
        "\n"
        f"ci:producer:{secret('ci')}\n"
        f"dash:read-only:{secret('dash')}\n"
    )
    api = await make_api(auth_tokens_file=str(path), allow_unauthenticated=False)
    # Read once, at start: a later change needs a restart (see docs/operations.md).
    path.write_text(f"ops:admin:{secret('ops')}\n")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        created = await stub(ch, "TaskService").Enqueue(
            service_pb2.EnqueueRequest(task=task_pb2.NewTask(queue="emails", type="send")),
            metadata=bearer("ci"),
        )
        assert created.created
        admin = stub(ch, "AdminService")
        await admin.ListQueues(service_pb2.ListQueuesRequest(), metadata=bearer("dash"))
        code, details = await refused(
            admin.PauseQueue, service_pb2.PauseQueueRequest(queue="q"), metadata=bearer("dash")
        )
        assert (code, "needs role admin" in details) == (grpc.StatusCode.PERMISSION_DENIED, True)
        code, _ = await refused(
            admin.ListQueues, service_pb2.ListQueuesRequest(), metadata=bearer("ops")
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED
