"""The REST admin API: each route is one gRPC call to the api service.

The process is a gRPC client of the api (see docs/architecture.md): the bearer token of
each HTTP request is passed through as the call's ``authorization`` metadata, so tokens,
roles and ``CONVEYOR_READ_ONLY`` are the api's, unchanged. A gRPC error becomes an RFC 9457
``application/problem+json`` body whose ``code`` is the gRPC status name.

Request and response bodies are the protobuf messages' canonical JSON mapping
(``google.protobuf.json_format``): field names in lowerCamelCase, enums by name,
timestamps as RFC 3339 strings, bytes as base64. Each route declares its bodies as
pydantic models derived from those messages (:mod:`conveyor_rest.models`), so the OpenAPI
document describes every field, and FastAPI checks the bodies in and out against them.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Annotated, Any

import grpc
import grpc.aio
from conveyor_protos.v1 import service_pb2 as pb
from conveyor_protos.v1 import task_pb2 as task_pb
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from google.protobuf import json_format
from google.protobuf.message import Message
from pydantic import BaseModel

from conveyor_rest.dashboard import add_dashboard
from conveyor_rest.history import QueueHistory
from conveyor_rest.link import ApiLink
from conveyor_rest.models import (
    BatchBody,
    BatchResult,
    HistoryPoint,
    Problem,
    TaskActionBody,
    WhoAmI,
    input_model,
    output_model,
)
from conveyor_rest.models import QueueHistory as QueueHistoryBody

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

_SERVICES = pb.DESCRIPTOR.services_by_name

#: The body of POST /v1/tasks: a NewTask whose payload may be any JSON value.
EnqueueBody = input_model(
    task_pb.NewTask.DESCRIPTOR,
    name="EnqueueBody",
    overrides={
        "payload": (
            Any,
            "the payload: a JSON object, array, number, boolean or null is sent as its "
            "JSON text (as the SDK sends it); a string is base64 of the bytes",
        )
    },
)

PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": Problem, "content": {PROBLEM: {}}}
    for status in (400, 401, 403, 404, 409, 422, 429, 501, 503)
}


def answers(rpc: str, service: str = "AdminService") -> dict[str, Any]:
    """The route options of a route that answers what ``service.rpc`` returns: its
    model (fields the JSON mapping leaves out stay out), and the problem answers."""
    message = _SERVICES[service].methods_by_name[rpc].output_type
    return {
        "response_model": output_model(message),
        "response_model_exclude_unset": True,
        "responses": PROBLEM_RESPONSES,
    }


def typed(route: Callable[..., Any], **annotations: Any) -> Callable[..., Any]:
    """``route`` with some parameters annotated with models made at run time (FastAPI
    reads them for the request bodies; the source keeps a static type for mypy)."""
    route.__annotations__.update(annotations)
    return route


def fields(body: BaseModel) -> JsonObject:
    """A request model's fields as given, by their JSON names (for ``ParseDict``)."""
    return body.model_dump(by_alias=True, exclude_unset=True)


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


def create_app(
    target: str | ApiLink,
    *,
    channel: grpc.aio.Channel | None = None,
    history: QueueHistory | None = None,
) -> FastAPI:
    """The FastAPI application, calling the api service at ``target`` (a ``host:port``
    or ``https://host:port`` target, or the process's :class:`ApiLink`; ``channel``: one
    to use instead of opening one). ``history`` is what the charts and the history route
    show, which a :class:`~conveyor_rest.history.QueueSampler` fills (None: an empty
    one, nothing sampled)."""
    app = FastAPI(
        title="Conveyor admin API",
        version="1",
        description="REST/JSON over Conveyor's gRPC AdminService and TaskService.",
    )
    link = target if isinstance(target, ApiLink) else ApiLink(target, channel=channel)
    history = history if history is not None else QueueHistory(interval=0)
    app.state.link = link
    app.state.history = history

    def admin() -> Any:
        return link.admin()

    def tasks() -> Any:
        return link.tasks()

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
    async def enqueue(body: BaseModel, request: Request) -> JsonObject:
        """Enqueue a task: the body is a NewTask (type, payload, queue, ...); a JSON object or
        array as ``payload`` is sent as its JSON bytes, a string is base64 bytes."""
        given = fields(body)
        if "payload" in given and not isinstance(given["payload"], str):
            # A JSON value is the payload itself (as the SDK sends it); a string is base64.
            raw = json.dumps(given["payload"], separators=(",", ":")).encode()
            given["payload"] = base64.b64encode(raw).decode()
        message = pb.EnqueueRequest(task=parse(given, task_pb.NewTask()))  # type: ignore[arg-type]
        return await call(tasks().Enqueue, message, request)

    app.post("/v1/tasks", tags=["producers"], **answers("Enqueue", "TaskService"))(
        typed(enqueue, body=EnqueueBody)
    )

    # ---------------------------------------------------------------- tasks
    @app.get("/v1/tasks", tags=["tasks"], **answers("ListTasks"))
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

    @app.get("/v1/tasks/{task_id}", tags=["tasks"], **answers("GetTask"))
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
        app.get(path, tags=["limits"], **answers(rpc))(listing)

    def action_route(path: str, rpc: str) -> None:
        async def act(task_id: str, request: Request) -> JsonObject:
            method = getattr(admin(), rpc)
            return await call(method, pb.TaskActionRequest(id=task_id), request)

        act.__name__ = f"task_{path.replace('-', '_')}"
        act.__doc__ = f"AdminService.{rpc} on one task."
        app.post(f"/v1/tasks/{{task_id}}/{path}", tags=["tasks"], **answers(rpc))(act)

    for path, rpc in actions.items():
        action_route(path, rpc)

    @app.delete("/v1/tasks/{task_id}", tags=["tasks"], **answers("DeleteTask"))
    async def delete_task(task_id: str, request: Request) -> JsonObject:
        """Delete a task that is not running."""
        return await call(admin().DeleteTask, pb.TaskActionRequest(id=task_id), request)

    @app.post("/v1/tasks/{task_id}/reschedule", tags=["tasks"], **answers("RescheduleTask"))
    async def reschedule(task_id: str, body: TaskActionBody, request: Request) -> JsonObject:
        """Make a task due at ``process_at``."""
        message = pb.RescheduleTaskRequest(id=task_id)
        try:
            message.process_at.FromJsonString(body.process_at)
        except ValueError as exc:
            raise InvalidInput(f"process_at: {exc}") from None
        return await call(admin().RescheduleTask, message, request)

    @app.get("/v1/tasks/{task_id}/dependencies", tags=["tasks"], **answers("ListTaskDependencies"))
    async def dependencies(task_id: str, request: Request, dependents: bool = False) -> JsonObject:
        """What a task waits for (or, with ``dependents``, what waits for it)."""
        message = pb.ListTaskDependenciesRequest(id=task_id, dependents=dependents)
        return await call(admin().ListTaskDependencies, message, request)

    @app.post(
        "/v1/tasks:batch", tags=["tasks"], response_model=BatchResult, responses=PROBLEM_RESPONSES
    )
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
    @app.get("/v1/queues", tags=["queues"], **answers("ListQueues"))
    async def list_queues(request: Request) -> JsonObject:
        """Every queue, with its counts and its breakers that are not closed."""
        return await call(admin().ListQueues, pb.ListQueuesRequest(), request)

    @app.get("/v1/queues/{queue}/stats", tags=["queues"], **answers("GetQueueStats"))
    async def queue_stats(queue: str, request: Request) -> JsonObject:
        """A queue's task counts per state, whether it is paused, and its circuit
        breakers that are open or half-open."""
        return await call(admin().GetQueueStats, pb.GetQueueStatsRequest(queue=queue), request)

    @app.post("/v1/queues/{queue}/pause", tags=["queues"], **answers("PauseQueue"))
    async def pause_queue(queue: str, request: Request) -> JsonObject:
        """Stop dispatching a queue's tasks."""
        return await call(admin().PauseQueue, pb.PauseQueueRequest(queue=queue), request)

    @app.post("/v1/queues/{queue}/resume", tags=["queues"], **answers("ResumeQueue"))
    async def resume_queue(queue: str, request: Request) -> JsonObject:
        """Dispatch a paused queue's tasks again."""
        return await call(admin().ResumeQueue, pb.ResumeQueueRequest(queue=queue), request)

    # ---------------------------------------------------------------- webhooks, cron
    @app.get("/v1/webhooks", tags=["webhooks"], **answers("ListWebhookWorkers"))
    async def list_webhooks(request: Request) -> JsonObject:
        """Webhook registrations, with their breaker state."""
        return await call(admin().ListWebhookWorkers, pb.ListWebhookWorkersRequest(), request)

    @app.get("/v1/cron", tags=["cron"], **answers("ListCronEntries"))
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
        app.api_route(path, methods=[verb], tags=[tag], **answers(rpc))(by_name)

    def body_route(
        path: str, rpc: str, request_type: Any, field: str, inner: Any, tag: str
    ) -> None:
        """A PUT whose JSON body is one message (``inner``), its ``name`` from the path."""

        async def upsert(name: str, body: BaseModel, request: Request) -> JsonObject:
            given = fields(body)
            if "name" in inner.DESCRIPTOR.fields_by_name:
                given["name"] = name
            value = parse(given, inner())
            return await call(getattr(admin(), rpc), request_type(**{field: value}), request)

        upsert.__name__ = f"put_{tag}"
        upsert.__doc__ = (
            f"AdminService.{rpc}: the body is a {inner.DESCRIPTOR.name} in JSON, its name "
            "from the path."
        )
        app.put(path, tags=[tag], **answers(rpc))(typed(upsert, body=input_model(inner.DESCRIPTOR)))

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

    async def put_rate_limit(queue: str, body: BaseModel, request: Request) -> JsonObject:
        """AdminService.SetRateLimit: the body is a RateLimit in JSON (``perSecond``,
        ``burst``: 0 or absent for one second's worth), its queue from the path."""
        message = pb.SetRateLimitRequest()
        parse({**fields(body), "queue": queue}, message.limit)
        return await call(admin().SetRateLimit, message, request)

    app.put(rate, tags=["limits"], **answers("SetRateLimit"))(
        typed(put_rate_limit, body=input_model(pb.RateLimit.DESCRIPTOR))
    )

    @app.delete(rate, tags=["limits"], **answers("DeleteRateLimit"))
    async def delete_rate_limit(queue: str, request: Request) -> JsonObject:
        """AdminService.DeleteRateLimit."""
        message = pb.DeleteRateLimitRequest(queue=queue)
        return await call(admin().DeleteRateLimit, message, request)

    keyed = "/v1/limits/concurrency/{queue}"

    async def put_concurrency_limit(queue: str, body: BaseModel, request: Request) -> JsonObject:
        """AdminService.SetConcurrencyLimit: the body is a ConcurrencyLimit in JSON
        (``perKey``, ``pattern``: absent for ``*``), its queue from the path."""
        message = pb.SetConcurrencyLimitRequest()
        parse({**fields(body), "queue": queue}, message.limit)
        return await call(admin().SetConcurrencyLimit, message, request)

    app.put(keyed, tags=["limits"], **answers("SetConcurrencyLimit"))(
        typed(put_concurrency_limit, body=input_model(pb.ConcurrencyLimit.DESCRIPTOR))
    )

    @app.delete(keyed, tags=["limits"], **answers("DeleteConcurrencyLimit"))
    async def delete_concurrency_limit(
        queue: str, request: Request, pattern: Annotated[str, Query(max_length=256)] = "*"
    ) -> JsonObject:
        """AdminService.DeleteConcurrencyLimit (``?pattern=``, default ``*``)."""
        message = pb.DeleteConcurrencyLimitRequest(queue=queue, pattern=pattern)
        return await call(admin().DeleteConcurrencyLimit, message, request)

    breaker = "/v1/limits/breakers/{queue}"

    async def put_breaker_config(queue: str, body: BaseModel, request: Request) -> JsonObject:
        """AdminService.SetBreakerConfig: the body is a BreakerConfig in JSON
        (``failures``, ``window`` and ``cooldown`` as durations such as ``"60s"``,
        ``pattern``: absent for ``*``, ``scope``: ``worker`` (the default) or
        ``queue``), its queue from the path."""
        message = pb.SetBreakerConfigRequest()
        given = fields(body)
        if "scope" in given:
            given["scope"] = breaker_scope(given["scope"])
        parse({**given, "queue": queue}, message.config)
        return await call(admin().SetBreakerConfig, message, request)

    app.put(breaker, tags=["limits"], **answers("SetBreakerConfig"))(
        typed(put_breaker_config, body=input_model(pb.BreakerConfig.DESCRIPTOR))
    )

    @app.delete(breaker, tags=["limits"], **answers("DeleteBreakerConfig"))
    async def delete_breaker_config(
        queue: str, request: Request, pattern: Annotated[str, Query(max_length=256)] = "*"
    ) -> JsonObject:
        """AdminService.DeleteBreakerConfig (``?pattern=``, default ``*``)."""
        message = pb.DeleteBreakerConfigRequest(queue=queue, pattern=pattern)
        return await call(admin().DeleteBreakerConfig, message, request)

    @app.get("/v1/limits/breakers", tags=["limits"], **answers("ListBreakerConfigs"))
    async def list_breaker_configs(
        request: Request, queue: Annotated[str, Query(max_length=200)] = ""
    ) -> JsonObject:
        """AdminService.ListBreakerConfigs (``?queue=``: one queue's; default: all)."""
        message = pb.ListBreakerConfigsRequest(queue=queue)
        return await call(admin().ListBreakerConfigs, message, request)

    @app.get("/v1/breakers", tags=["breakers"], **answers("ListBreakers"))
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

    @app.get("/v1/cluster", tags=["cluster"], **answers("GetClusterInfo"))
    async def cluster(request: Request) -> JsonObject:
        """The cluster's services and dispatch owners."""
        return await call(admin().GetClusterInfo, pb.GetClusterInfoRequest(), request)

    # ---------------------------------------------------------------- who am I
    @app.get("/v1/whoami", tags=["auth"], response_model=WhoAmI, responses=PROBLEM_RESPONSES)
    async def whoami(request: Request) -> WhoAmI:
        """What the caller's token may do on the AdminService, as the api's WhoAmI
        answers: ``admin`` (reads and mutations), ``read-only`` (reads: a read-only
        token, or any on an api under ``CONVEYOR_READ_ONLY``) or ``none`` (a producer or
        worker token), with the token's own role and name. A missing or unknown token is
        a 401 problem, like any route; an api older than WhoAmI a 501 one."""
        me = await admin().WhoAmI(pb.WhoAmIRequest(), metadata=metadata(request), timeout=30.0)
        role = "admin" if me.can_mutate else "read-only" if me.can_read else "none"
        return WhoAmI(
            role=role,
            can_read=me.can_read,
            can_mutate=me.can_mutate,
            token_role=me.role,
            token_name=me.token_name,
            auth_enabled=me.auth_enabled,
            read_only=me.read_only,
        )

    # ---------------------------------------------------------------- history
    @app.get(
        "/v1/queues/{queue}/history",
        tags=["queues"],
        response_model=QueueHistoryBody,
        responses=PROBLEM_RESPONSES,
    )
    async def queue_history(queue: str, request: Request) -> QueueHistoryBody:
        """The queue's samples over the last hour, oldest first, as this REST process
        took them every ``CONVEYOR_SAMPLE_INTERVAL`` seconds (what the dashboard charts):
        completed and archived tasks since the sample before, completions per minute,
        pending and active counts, and the latency (how long the oldest pending task had
        waited). Memory only: empty after a restart, or with sampling off. The caller's
        token must be one that may read the queue's stats (the api answers a
        GetQueueStats first)."""
        await admin().GetQueueStats(
            pb.GetQueueStatsRequest(queue=queue), metadata=metadata(request), timeout=30.0
        )
        return history_body(history, queue)

    # ---------------------------------------------------------------- events
    @app.get(
        "/v1/events",
        tags=["events"],
        responses={
            **PROBLEM_RESPONSES,
            200: {
                "description": "Server-Sent Events: a ': watching' comment once subscribed, "
                "then one 'data:' line of TaskEvent JSON per event, and an 'event: error' "
                "one (code, detail) if the api ends the stream",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
        },
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

    add_dashboard(app, admin, history)
    return app


def history_body(history: QueueHistory, queue: str) -> QueueHistoryBody:
    """``queue``'s points in ``history``, as the history route answers them."""
    return QueueHistoryBody(
        queue=queue,
        interval_seconds=history.interval,
        window_seconds=history.window,
        points=[
            HistoryPoint(
                at=_rfc3339(point.sample.at),
                completed=point.completed,
                failed=point.failed,
                completed_per_minute=point.per_minute,
                pending=point.sample.pending,
                active=point.sample.active,
                latency_seconds=point.sample.latency,
            )
            for point in history.points(queue)
        ],
    )


def _rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def task_pb_action(key: str) -> int:
    """A TaskAction enum value by its name (ValueError if none)."""
    value = int(pb.TaskAction.Value(key))
    if value == 0:
        raise ValueError(key)
    return value


def _sse(event: Message) -> bytes:
    return f"data: {json.dumps(to_json(event))}\n\n".encode()
