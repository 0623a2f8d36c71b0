"""The REST admin API: each route is one gRPC call to the api service.

The process is a gRPC client of the api (see docs/architecture.md): the bearer token of
each HTTP request is passed through as the call's ``authorization`` metadata, so tokens,
roles and ``CONVEYOR_READ_ONLY`` are the api's, unchanged. A gRPC error becomes an RFC 9457
``application/problem+json`` body whose ``code`` is the gRPC status name.

Request and response bodies are the protobuf messages' canonical JSON mapping
(``google.protobuf.json_format``): field names in lowerCamelCase, enums by name,
timestamps as RFC 3339 strings, bytes as base64.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import grpc
import grpc.aio
from conveyor_protos.v1 import service_pb2 as pb
from conveyor_protos.v1 import service_pb2_grpc as pb_grpc
from conveyor_protos.v1 import task_pb2 as task_pb
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from google.protobuf import json_format
from google.protobuf.message import Message
from pydantic import BaseModel, Field

from conveyor_rest.dashboard import add_dashboard

PROBLEM = "application/problem+json"

# Each gRPC status and the HTTP status its problem+json answer carries.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNAUTHENTICATED: 401,
}

JsonObject = dict[str, Any]


class Problem(BaseModel):
    """An RFC 9457 problem detail; ``code`` is the gRPC status name."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str = ""
    code: str


class TaskActionBody(BaseModel):
    """The body of a reschedule: when the task becomes due (RFC 3339)."""

    process_at: str = Field(description="RFC 3339 time, e.g. 2026-01-01T00:00:00Z")


class BatchBody(BaseModel):
    """A batch action on a selection: ids, or a queue and a state."""

    action: str = Field(description="cancel, run-now, delete, archive, revive or reschedule")
    ids: list[str] = Field(default_factory=list, max_length=10_000)
    queue: str = ""
    state: str = ""
    process_at: str | None = None


class WhoAmI(BaseModel):
    """What the caller's token may do, as the api answers two probes (see ``whoami``)."""

    role: str = Field(description="admin, read-only, or none (no AdminService access)")
    can_read: bool
    can_mutate: bool


class BatchResult(BaseModel):
    """How many tasks a batch action changed, and the ids it could not act on."""

    affected: int
    failures: dict[str, str]


PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": Problem, "content": {PROBLEM: {}}}
    for status in (400, 401, 403, 404, 409, 422, 429, 501, 503)
}


def problem(status: int, code: str, detail: str) -> JSONResponse:
    """A problem+json response."""
    title = code.replace("_", " ").capitalize()
    body = Problem(title=title, status=status, detail=detail, code=code)
    return JSONResponse(body.model_dump(), status_code=status, media_type=PROBLEM)


def to_json(message: Message) -> JsonObject:
    """A protobuf message as its canonical JSON object (defaults included)."""
    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)


def task_state(name: str) -> int:
    """A state name ("pending", "TASK_STATE_PENDING") as the enum value; "" is unset."""
    if not name:
        return 0
    key = name.upper()
    if not key.startswith("TASK_STATE_"):
        key = "TASK_STATE_" + key
    try:
        return int(task_pb.TaskState.Value(key))
    except ValueError:
        raise InvalidInput(f"unknown task state {name!r}") from None


def breaker_scope(value: Any) -> Any:
    """A breaker config's ``scope`` in JSON: "worker" and "queue" (any case) stand for
    their enum names; anything else is left for the JSON parser to judge."""
    if isinstance(value, str) and value and not value.upper().startswith("BREAKER_SCOPE_"):
        return "BREAKER_SCOPE_" + value.upper()
    return value


class InvalidInput(Exception):
    """Input the REST layer refuses before any gRPC call (400 INVALID_ARGUMENT)."""


def create_app(target: str, *, channel: grpc.aio.Channel | None = None) -> FastAPI:
    """The FastAPI application, calling the api service at ``target``."""
    app = FastAPI(
        title="Conveyor admin API",
        version="1",
        description="REST/JSON over Conveyor's gRPC AdminService and TaskService.",
    )
    state: dict[str, Any] = {"channel": channel}

    def open_channel() -> grpc.aio.Channel:
        if state["channel"] is None:
            state["channel"] = grpc.aio.insecure_channel(target)
        chan: grpc.aio.Channel = state["channel"]
        return chan

    def admin() -> pb_grpc.AdminServiceStub:
        return pb_grpc.AdminServiceStub(open_channel())  # type: ignore[no-untyped-call]

    def tasks() -> pb_grpc.TaskServiceStub:
        return pb_grpc.TaskServiceStub(open_channel())  # type: ignore[no-untyped-call]

    def metadata(request: Request) -> list[tuple[str, str]]:
        auth = request.headers.get("authorization")
        return [("authorization", auth)] if auth else []

    @app.exception_handler(grpc.aio.AioRpcError)
    async def on_rpc_error(_: Request, exc: grpc.aio.AioRpcError) -> JSONResponse:
        code = exc.code()
        return problem(HTTP_STATUS.get(code, 500), code.name, exc.details() or "")

    @app.exception_handler(InvalidInput)
    async def on_invalid(_: Request, exc: InvalidInput) -> JSONResponse:
        return problem(400, "INVALID_ARGUMENT", str(exc))

    @app.exception_handler(json_format.ParseError)
    async def on_parse(_: Request, exc: json_format.ParseError) -> JSONResponse:
        return problem(400, "INVALID_ARGUMENT", str(exc))

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', '')}"
            for err in exc.errors()
        )
        return problem(422, "INVALID_ARGUMENT", detail)

    async def call(
        method: Callable[..., Awaitable[Message]], message: Message, request: Request
    ) -> JsonObject:
        reply = await method(message, metadata=metadata(request), timeout=30.0)
        return to_json(reply)

    def parse(body: JsonObject, message: Message) -> Message:
        if not isinstance(body, dict):
            raise InvalidInput("the body must be a JSON object")
        return json_format.ParseDict(body, message)

    # ---------------------------------------------------------------- producers
    @app.post("/v1/tasks", tags=["producers"], responses=PROBLEM_RESPONSES)
    async def enqueue(body: JsonObject, request: Request) -> JsonObject:
        """Enqueue a task: the body is a NewTask (type, payload, queue, ...); a JSON object or
        array as ``payload`` is sent as its JSON bytes, a string is base64 bytes."""
        if not isinstance(body.get("payload", ""), str):
            # A JSON value is the payload itself (as the SDK sends it); a string is base64.
            raw = json.dumps(body["payload"], separators=(",", ":")).encode()
            body = {**body, "payload": base64.b64encode(raw).decode()}
        message = pb.EnqueueRequest(task=parse(body, task_pb.NewTask()))  # type: ignore[arg-type]
        return await call(tasks().Enqueue, message, request)

    # ---------------------------------------------------------------- tasks
    @app.get("/v1/tasks", tags=["tasks"], responses=PROBLEM_RESPONSES)
    async def list_tasks(
        request: Request,
        queue: Annotated[str, Query(max_length=200)] = "",
        state: Annotated[str, Query(max_length=40)] = "",
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: Annotated[str, Query(max_length=1000)] = "",
        omit_payloads: bool = False,
    ) -> JsonObject:
        """Tasks, filtered by queue and state, one page at a time (``nextCursor``)."""
        message = pb.ListTasksRequest(
            queue=queue,
            state=task_state(state),  # type: ignore[arg-type]
            limit=limit,
            cursor=cursor,
            omit_payloads=omit_payloads,
        )
        return await call(admin().ListTasks, message, request)

    @app.get("/v1/tasks/{task_id}", tags=["tasks"], responses=PROBLEM_RESPONSES)
    async def get_task(task_id: str, request: Request) -> JsonObject:
        """One task, with its payload, result, progress and errors (AdminService.GetTask, or
        TaskService.GetTask for a producer token, which may not call the admin one)."""
        message = pb.GetTaskRequest(id=task_id)
        try:
            return await call(admin().GetTask, message, request)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.PERMISSION_DENIED:
                raise
            return await call(tasks().GetTask, message, request)

    actions = {
        "cancel": "CancelTask",
        "run-now": "RunTaskNow",
        "archive": "ArchiveTask",
        "revive": "ReviveTask",
    }

    def list_route(path: str, rpc: str, request_type: Any) -> None:
        async def listing(request: Request) -> JsonObject:
            return await call(getattr(admin(), rpc), request_type(), request)

        listing.__name__ = f"list_{path.strip('/').replace('/', '_')}"
        listing.__doc__ = f"AdminService.{rpc}."
        app.get(path, tags=["limits"], responses=PROBLEM_RESPONSES)(listing)

    def action_route(path: str, rpc: str) -> None:
        async def act(task_id: str, request: Request) -> JsonObject:
            method = getattr(admin(), rpc)
            return await call(method, pb.TaskActionRequest(id=task_id), request)

        act.__name__ = f"task_{path.replace('-', '_')}"
        act.__doc__ = f"AdminService.{rpc} on one task."
        app.post(f"/v1/tasks/{{task_id}}/{path}", tags=["tasks"], responses=PROBLEM_RESPONSES)(act)

    for path, rpc in actions.items():
        action_route(path, rpc)

    @app.delete("/v1/tasks/{task_id}", tags=["tasks"], responses=PROBLEM_RESPONSES)
    async def delete_task(task_id: str, request: Request) -> JsonObject:
        """Delete a task that is not running."""
        return await call(admin().DeleteTask, pb.TaskActionRequest(id=task_id), request)

    @app.post("/v1/tasks/{task_id}/reschedule", tags=["tasks"], responses=PROBLEM_RESPONSES)
    async def reschedule(task_id: str, body: TaskActionBody, request: Request) -> JsonObject:
        """Make a task due at ``process_at``."""
        message = pb.RescheduleTaskRequest(id=task_id)
        try:
            message.process_at.FromJsonString(body.process_at)
        except ValueError as exc:
            raise InvalidInput(f"process_at: {exc}") from None
        return await call(admin().RescheduleTask, message, request)

    @app.get("/v1/tasks/{task_id}/dependencies", tags=["tasks"], responses=PROBLEM_RESPONSES)
    async def dependencies(task_id: str, request: Request, dependents: bool = False) -> JsonObject:
        """What a task waits for (or, with ``dependents``, what waits for it)."""
        message = pb.ListTaskDependenciesRequest(id=task_id, dependents=dependents)
        return await call(admin().ListTaskDependencies, message, request)

    @app.post("/v1/tasks:batch", tags=["tasks"], responses=PROBLEM_RESPONSES)
    async def batch(body: BatchBody, request: Request) -> BatchResult:
        """One action on many tasks: by ids, or by queue and state."""
        key = "TASK_ACTION_" + body.action.upper().replace("-", "_")
        try:
            action = task_pb_action(key)
        except ValueError:
            raise InvalidInput(f"unknown action {body.action!r}") from None
        message = pb.BatchTaskActionRequest(
            action=action,  # type: ignore[arg-type]
            selector=pb.TaskSelector(
                ids=body.ids,
                queue=body.queue,
                state=task_state(body.state),  # type: ignore[arg-type]
            ),
        )
        if body.process_at is not None:
            try:
                message.process_at.FromJsonString(body.process_at)
            except ValueError as exc:
                raise InvalidInput(f"process_at: {exc}") from None
        reply = await admin().BatchTaskAction(message, metadata=metadata(request), timeout=60.0)
        return BatchResult(affected=reply.affected, failures=dict(reply.failures))

    # ---------------------------------------------------------------- queues
    @app.get("/v1/queues", tags=["queues"], responses=PROBLEM_RESPONSES)
    async def list_queues(request: Request) -> JsonObject:
        """Every queue, with its counts and its breakers that are not closed."""
        return await call(admin().ListQueues, pb.ListQueuesRequest(), request)

    @app.get("/v1/queues/{queue}/stats", tags=["queues"], responses=PROBLEM_RESPONSES)
    async def queue_stats(queue: str, request: Request) -> JsonObject:
        """A queue's task counts per state, whether it is paused, and its circuit
        breakers that are open or half-open."""
        return await call(admin().GetQueueStats, pb.GetQueueStatsRequest(queue=queue), request)

    @app.post("/v1/queues/{queue}/pause", tags=["queues"], responses=PROBLEM_RESPONSES)
    async def pause_queue(queue: str, request: Request) -> JsonObject:
        """Stop dispatching a queue's tasks."""
        return await call(admin().PauseQueue, pb.PauseQueueRequest(queue=queue), request)

    @app.post("/v1/queues/{queue}/resume", tags=["queues"], responses=PROBLEM_RESPONSES)
    async def resume_queue(queue: str, request: Request) -> JsonObject:
        """Dispatch a paused queue's tasks again."""
        return await call(admin().ResumeQueue, pb.ResumeQueueRequest(queue=queue), request)

    # ---------------------------------------------------------------- webhooks, cron
    @app.get("/v1/webhooks", tags=["webhooks"], responses=PROBLEM_RESPONSES)
    async def list_webhooks(request: Request) -> JsonObject:
        """Webhook registrations, with their breaker state."""
        return await call(admin().ListWebhookWorkers, pb.ListWebhookWorkersRequest(), request)

    @app.get("/v1/cron", tags=["cron"], responses=PROBLEM_RESPONSES)
    async def list_cron(request: Request) -> JsonObject:
        """Cron entries, with their next and last runs."""
        return await call(admin().ListCronEntries, pb.ListCronEntriesRequest(), request)

    def named_route(
        verb: str, path: str, rpc: str, request_type: Any, tag: str, **fields: Any
    ) -> None:
        """A route whose only input is the ``{name}`` in its path (plus fixed fields)."""

        async def by_name(name: str, request: Request) -> JsonObject:
            message = request_type(name=name, **fields)
            return await call(getattr(admin(), rpc), message, request)

        by_name.__name__ = (
            rpc[0].lower()
            + "".join(f"_{c.lower()}" if c.isupper() else c for c in rpc[1:])
            + ("_paused" if fields.get("paused") else "")
        )
        by_name.__doc__ = f"AdminService.{rpc}."
        app.api_route(path, methods=[verb], tags=[tag], responses=PROBLEM_RESPONSES)(by_name)

    def body_route(
        path: str, rpc: str, request_type: Any, field: str, inner: Any, tag: str
    ) -> None:
        """A PUT whose JSON body is one message (``inner``), its ``name`` from the path."""

        async def upsert(name: str, body: JsonObject, request: Request) -> JsonObject:
            value = parse(
                {**body, "name": name} if "name" in inner.DESCRIPTOR.fields_by_name else body,
                inner(),
            )
            return await call(getattr(admin(), rpc), request_type(**{field: value}), request)

        upsert.__name__ = f"put_{tag}"
        upsert.__doc__ = f"AdminService.{rpc}: the body is a {inner.DESCRIPTOR.name} in JSON."
        app.put(path, tags=[tag], responses=PROBLEM_RESPONSES)(upsert)

    hook = "/v1/webhooks/{name}"
    named_route("GET", hook, "GetWebhookWorker", pb.GetWebhookWorkerRequest, "webhooks")
    named_route("DELETE", hook, "DeleteWebhookWorker", pb.DeleteWebhookWorkerRequest, "webhooks")
    named_route(
        "POST",
        hook + "/pause",
        "SetWebhookWorkerPaused",
        pb.SetWebhookWorkerPausedRequest,
        "webhooks",
        paused=True,
    )
    named_route(
        "POST",
        hook + "/resume",
        "SetWebhookWorkerPaused",
        pb.SetWebhookWorkerPausedRequest,
        "webhooks",
        paused=False,
    )
    body_route(
        hook,
        "UpsertWebhookWorker",
        pb.UpsertWebhookWorkerRequest,
        "worker",
        pb.WebhookWorker,
        "webhooks",
    )

    cron = "/v1/cron/{name}"
    named_route("GET", cron, "GetCronEntry", pb.GetCronEntryRequest, "cron")
    named_route("DELETE", cron, "DeleteCronEntry", pb.DeleteCronEntryRequest, "cron")
    named_route("POST", cron + "/trigger", "TriggerCronEntry", pb.TriggerCronEntryRequest, "cron")
    named_route(
        "POST", cron + "/pause", "SetCronPaused", pb.SetCronPausedRequest, "cron", paused=True
    )
    named_route(
        "POST", cron + "/resume", "SetCronPaused", pb.SetCronPausedRequest, "cron", paused=False
    )
    body_route(cron, "UpsertCronEntry", pb.UpsertCronEntryRequest, "entry", pb.CronEntry, "cron")

    rate = "/v1/limits/rate/{queue}"

    @app.put(rate, tags=["limits"], responses=PROBLEM_RESPONSES)
    async def put_rate_limit(queue: str, body: JsonObject, request: Request) -> JsonObject:
        """AdminService.SetRateLimit: the body is a RateLimit in JSON (``perSecond``,
        ``burst``: 0 or absent for one second's worth), its queue from the path."""
        message = pb.SetRateLimitRequest()
        parse({**body, "queue": queue}, message.limit)
        return await call(admin().SetRateLimit, message, request)

    @app.delete(rate, tags=["limits"], responses=PROBLEM_RESPONSES)
    async def delete_rate_limit(queue: str, request: Request) -> JsonObject:
        """AdminService.DeleteRateLimit."""
        message = pb.DeleteRateLimitRequest(queue=queue)
        return await call(admin().DeleteRateLimit, message, request)

    keyed = "/v1/limits/concurrency/{queue}"

    @app.put(keyed, tags=["limits"], responses=PROBLEM_RESPONSES)
    async def put_concurrency_limit(queue: str, body: JsonObject, request: Request) -> JsonObject:
        """AdminService.SetConcurrencyLimit: the body is a ConcurrencyLimit in JSON
        (``perKey``, ``pattern``: absent for ``*``), its queue from the path."""
        message = pb.SetConcurrencyLimitRequest()
        parse({**body, "queue": queue}, message.limit)
        return await call(admin().SetConcurrencyLimit, message, request)

    @app.delete(keyed, tags=["limits"], responses=PROBLEM_RESPONSES)
    async def delete_concurrency_limit(
        queue: str, request: Request, pattern: Annotated[str, Query(max_length=256)] = "*"
    ) -> JsonObject:
        """AdminService.DeleteConcurrencyLimit (``?pattern=``, default ``*``)."""
        message = pb.DeleteConcurrencyLimitRequest(queue=queue, pattern=pattern)
        return await call(admin().DeleteConcurrencyLimit, message, request)

    breaker = "/v1/limits/breakers/{queue}"

    @app.put(breaker, tags=["limits"], responses=PROBLEM_RESPONSES)
    async def put_breaker_config(queue: str, body: JsonObject, request: Request) -> JsonObject:
        """AdminService.SetBreakerConfig: the body is a BreakerConfig in JSON
        (``failures``, ``window`` and ``cooldown`` as durations such as ``"60s"``,
        ``pattern``: absent for ``*``, ``scope``: ``worker`` (the default) or
        ``queue``), its queue from the path."""
        message = pb.SetBreakerConfigRequest()
        if isinstance(body, dict) and "scope" in body:
            body = {**body, "scope": breaker_scope(body["scope"])}
        parse({**body, "queue": queue}, message.config)
        return await call(admin().SetBreakerConfig, message, request)

    @app.delete(breaker, tags=["limits"], responses=PROBLEM_RESPONSES)
    async def delete_breaker_config(
        queue: str, request: Request, pattern: Annotated[str, Query(max_length=256)] = "*"
    ) -> JsonObject:
        """AdminService.DeleteBreakerConfig (``?pattern=``, default ``*``)."""
        message = pb.DeleteBreakerConfigRequest(queue=queue, pattern=pattern)
        return await call(admin().DeleteBreakerConfig, message, request)

    @app.get("/v1/limits/breakers", tags=["limits"], responses=PROBLEM_RESPONSES)
    async def list_breaker_configs(
        request: Request, queue: Annotated[str, Query(max_length=200)] = ""
    ) -> JsonObject:
        """AdminService.ListBreakerConfigs (``?queue=``: one queue's; default: all)."""
        message = pb.ListBreakerConfigsRequest(queue=queue)
        return await call(admin().ListBreakerConfigs, message, request)

    @app.get("/v1/breakers", tags=["breakers"], responses=PROBLEM_RESPONSES)
    async def list_breakers(
        request: Request, queue: Annotated[str, Query(max_length=200)] = ""
    ) -> JsonObject:
        """AdminService.ListBreakers: the circuit breakers that are open or half-open
        (``?queue=``: one queue's; default: all)."""
        message = pb.ListBreakersRequest(queue=queue)
        return await call(admin().ListBreakers, message, request)

    # The lists of the limits and group configs: each one GET; an api without one answers
    # UNIMPLEMENTED, which is a 501 problem.
    for path, rpc, request_type in (
        ("/v1/limits/rate", "ListRateLimits", pb.ListRateLimitsRequest),
        ("/v1/limits/concurrency", "ListConcurrencyLimits", pb.ListConcurrencyLimitsRequest),
        ("/v1/groups", "ListGroupConfigs", pb.ListGroupConfigsRequest),
    ):
        list_route(path, rpc, request_type)

    @app.get("/v1/cluster", tags=["cluster"], responses=PROBLEM_RESPONSES)
    async def cluster(request: Request) -> JsonObject:
        """The cluster's services and dispatch owners."""
        return await call(admin().GetClusterInfo, pb.GetClusterInfoRequest(), request)

    # ---------------------------------------------------------------- who am I
    @app.get("/v1/whoami", tags=["auth"], responses=PROBLEM_RESPONSES)
    async def whoami(request: Request) -> WhoAmI:
        """What the caller's token may do on the AdminService: ``admin`` (reads and
        mutations), ``read-only`` (reads: a read-only token, or an api under
        ``CONVEYOR_READ_ONLY``) or ``none`` (a producer or worker token). The tokens are
        the api's, so this asks the api: a ListQueues of one queue, then a DeleteTask of
        the empty id, which no task has (the api refuses a role before it looks at the
        request, and an allowed call fails on the empty id: nothing is changed). A missing
        or unknown token is a 401 problem, like any route."""
        md = metadata(request)
        try:
            await admin().ListQueues(pb.ListQueuesRequest(limit=1), metadata=md, timeout=30.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.PERMISSION_DENIED:
                raise
            return WhoAmI(role="none", can_read=False, can_mutate=False)
        try:
            await admin().DeleteTask(pb.TaskActionRequest(id=""), metadata=md, timeout=30.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                return WhoAmI(role="read-only", can_read=True, can_mutate=False)
        return WhoAmI(role="admin", can_read=True, can_mutate=True)

    # ---------------------------------------------------------------- events
    @app.get(
        "/v1/events",
        tags=["events"],
        responses={**PROBLEM_RESPONSES, 200: {"content": {"text/event-stream": {}}}},
        response_model=None,
    )
    async def events(
        request: Request, queue: Annotated[list[str] | None, Query(max_length=1000)] = None
    ) -> StreamingResponse | JSONResponse:
        """Server-Sent Events: one ``data:`` line of TaskEvent JSON per lifecycle event."""
        stream = admin().WatchEvents(
            pb.WatchEventsRequest(queues=queue or []), metadata=metadata(request)
        )
        # The api sends initial metadata once the subscription is live, or refuses: a bad
        # token or filter is a problem+json answer, and ": watching" means subscribed.
        try:
            await asyncio.wait_for(stream.initial_metadata(), 30)
        except TimeoutError:
            stream.cancel()
            return problem(504, "DEADLINE_EXCEEDED", "the event subscription did not start")
        if stream.done():
            code = await stream.code()
            if code != grpc.StatusCode.OK:
                stream.cancel()
                details = await stream.details()
                return problem(HTTP_STATUS.get(code, 500), code.name, details or "")

        async def body() -> AsyncIterator[bytes]:
            try:
                yield b": watching\n\n"
                async for event in stream:
                    yield _sse(event)
            except grpc.aio.AioRpcError as exc:
                payload = json.dumps({"code": exc.code().name, "detail": exc.details()})
                yield f"event: error\ndata: {payload}\n\n".encode()
            finally:
                stream.cancel()

        return StreamingResponse(body(), media_type="text/event-stream")

    add_dashboard(app, admin)
    return app


def task_pb_action(key: str) -> int:
    """A TaskAction enum value by its name (ValueError if none)."""
    value = int(pb.TaskAction.Value(key))
    if value == 0:
        raise ValueError(key)
    return value


def _sse(event: Message) -> bytes:
    return f"data: {json.dumps(to_json(event))}\n\n".encode()
