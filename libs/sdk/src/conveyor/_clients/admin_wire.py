"""AdminService on the wire for the admin clients: the requests they send and what
their responses become. Proto types stay in here; the clients and their callers only see
SDK types."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta

from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb
from google.protobuf.duration_pb2 import Duration

from conveyor._clients.admin_types import (
    BatchActionResult,
    Breaker,
    BreakerConfig,
    BreakerScope,
    BreakerState,
    ClusterInfo,
    ClusterNode,
    ConcurrencyLimit,
    CronEntry,
    CronMisfire,
    CronSpec,
    DependencyOutcome,
    DependencyPage,
    GroupConfig,
    GroupStats,
    QueueInfo,
    RateLimit,
    TaskDependency,
    TaskEvent,
    TaskPage,
    WebhookGateway,
    WebhookWorker,
    WhoAmI,
    WorkerSession,
)
from conveyor._clients.task_wire import (
    options_from_wire,
    spec_to_wire,
    state_from_wire,
    state_to_wire,
    task_from_wire,
)
from conveyor._errors import (
    BreakerConfigNotFound,
    CodecError,
    ConcurrencyLimitNotFound,
    ConveyorError,
    CronEntryNotFound,
    GroupConfigNotFound,
    InvalidArgument,
    RateLimitNotFound,
    WebhookWorkerNotFound,
)
from conveyor._payload import Codec, decode_value
from conveyor._types import DurationLike, TaskInfo, TaskSpec, TaskState, to_timedelta
from conveyor._wire_time import duration_to_wire, timestamp_from_wire, timestamp_to_wire

ADMIN_SERVICE = "/conveyor.v1.AdminService/"

#: A task state, as the enum or its value (``"archived"``).
StateLike = TaskState | str

# The batch actions, by the names the clients use.
CANCEL = svc.TASK_ACTION_CANCEL
RUN_NOW = svc.TASK_ACTION_RUN_NOW
DELETE = svc.TASK_ACTION_DELETE
ARCHIVE = svc.TASK_ACTION_ARCHIVE
REVIVE = svc.TASK_ACTION_REVIVE
RESCHEDULE = svc.TASK_ACTION_RESCHEDULE


# ------------------------------------------------------------------ conversions


def state_filter(value: StateLike | None) -> pb.TaskState:
    """The wire state to filter on (UNSPECIFIED, no filter, for None); InvalidArgument for
    a state this SDK does not know."""
    if value is None:
        return pb.TASK_STATE_UNSPECIFIED
    try:
        state = TaskState(value)
    except ValueError:
        raise InvalidArgument(f"unknown task state {value!r}") from None
    return state_to_wire(state)


def _instant(name: str, value: datetime) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument(f"{name} must be a timezone-aware datetime, got {value!r}")
    return value


def _selector(
    ids: Iterable[str] | None, queue: str | None, state: StateLike | None
) -> svc.TaskSelector:
    if isinstance(ids, str):
        raise InvalidArgument("ids must be a collection of task ids, not one string")
    if ids is not None:
        if queue is not None or state is not None:
            raise InvalidArgument("select tasks by ids, or by queue (and state), not both")
        return svc.TaskSelector(ids=list(ids))
    if queue is None:
        raise InvalidArgument("select tasks by ids, or by queue (and optionally state)")
    return svc.TaskSelector(queue=queue, state=state_filter(state))


def _check_limit(limit: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise InvalidArgument(f"limit must be an int in 1..1000, got {limit!r}")


def list_request(
    queue: str | None,
    state: StateLike | None,
    limit: int,
    cursor: str | None,
    *,
    with_payloads: bool = True,
) -> svc.ListTasksRequest:
    """A ListTasks request, checked."""
    _check_limit(limit)
    return svc.ListTasksRequest(
        queue=queue or "",
        state=state_filter(state),
        limit=limit,
        cursor=cursor or "",
        omit_payloads=not with_payloads,
    )


def dependencies_request(
    id: str, dependents: bool, limit: int, cursor: str | None
) -> svc.ListTaskDependenciesRequest:
    """A ListTaskDependencies request, checked."""
    _check_limit(limit)
    return svc.ListTaskDependenciesRequest(
        id=id, dependents=dependents, limit=limit, cursor=cursor or ""
    )


_OUTCOMES = {
    svc.DEPENDENCY_OUTCOME_OPEN: DependencyOutcome.OPEN,
    svc.DEPENDENCY_OUTCOME_SATISFIED: DependencyOutcome.SATISFIED,
    svc.DEPENDENCY_OUTCOME_FAILED: DependencyOutcome.FAILED,
}


def dependency_page(response: svc.ListTaskDependenciesResponse) -> DependencyPage:
    """The SDK view of a page of dependency edges."""
    return DependencyPage(
        dependencies=[
            TaskDependency(
                task_id=edge.task_id,
                outcome=_OUTCOMES.get(edge.outcome, DependencyOutcome.UNKNOWN),
                queue=edge.queue or None,
                type=edge.type or None,
                state=state_from_wire(edge.state) if edge.state else None,
            )
            for edge in response.dependencies
        ],
        next_cursor=response.next_cursor or None,
    )


def queues_request(limit: int, cursor: str | None) -> svc.ListQueuesRequest:
    """A ListQueues request, checked."""
    _check_limit(limit)
    return svc.ListQueuesRequest(limit=limit, cursor=cursor or "")


def watch_request(queues: Iterable[str], states: Iterable[StateLike]) -> svc.WatchEventsRequest:
    """A WatchEvents request (one name is taken as a list of one)."""
    if isinstance(queues, str):
        queues = [queues]
    if isinstance(states, str):
        states = [states]
    return svc.WatchEventsRequest(
        queues=list(queues),
        states=[state_filter(s) for s in states],
    )


def queue_info(message: svc.QueueStats) -> QueueInfo:
    """The SDK view of a queue's stats (states this SDK does not know count as UNKNOWN)
    with its breakers that are not closed."""
    counts: dict[TaskState, int] = {}
    for name, n in message.counts.items():
        try:
            counts[TaskState(name)] = n
        except ValueError:
            counts[TaskState.UNKNOWN] = counts.get(TaskState.UNKNOWN, 0) + n
    return QueueInfo(
        name=message.queue,
        paused=message.paused,
        counts=counts,
        breakers=[breaker_from_wire(b) for b in message.breakers],
    )


def event_from_wire(message: svc.TaskEvent) -> TaskEvent:
    """The SDK view of a lifecycle event (UNSPECIFIED states read as None), or of a
    circuit breaker event (``breaker`` set)."""
    state = state_from_wire(message.state) if message.state else None
    previous = state_from_wire(message.previous_state) if message.previous_state else None
    return TaskEvent(
        task_id=message.task_id,
        queue=message.queue,
        type=message.type,
        state=state,
        previous_state=previous,
        at=message.at.ToDatetime(tzinfo=UTC),
        error=message.error or None,
        breaker=breaker_from_wire(message.breaker) if message.HasField("breaker") else None,
    )


def batch_request(
    action: svc.TaskAction,
    ids: Iterable[str] | None,
    queue: str | None,
    state: StateLike | None,
    process_at: datetime | None = None,
) -> svc.BatchTaskActionRequest:
    """A BatchTaskAction request selecting by ids, or by queue and state."""
    request = svc.BatchTaskActionRequest(
        action=action,
        selector=_selector(ids, queue, state),
    )
    if process_at is not None:
        request.process_at.CopyFrom(timestamp_to_wire(_instant("process_at", process_at)))
    return request


def batch_result(response: svc.BatchTaskActionResponse) -> BatchActionResult:
    """The SDK view of a batch action's outcome."""
    return BatchActionResult(affected=response.affected, failures=dict(response.failures))


def reschedule_request(id: str, process_at: datetime) -> svc.RescheduleTaskRequest:
    """A RescheduleTask request (``process_at`` must be timezone-aware)."""
    request = svc.RescheduleTaskRequest(id=id)
    request.process_at.CopyFrom(timestamp_to_wire(_instant("process_at", process_at)))
    return request


def response_type(method: str) -> type[svc.GetTaskResponse] | type[svc.TaskActionResponse]:
    """The response message of a single-task AdminService method."""
    return svc.GetTaskResponse if method == "GetTask" else svc.TaskActionResponse


# ------------------------------------------------------------- webhook workers


def _webhook_queues(queues: Mapping[str, int] | Iterable[str]) -> dict[str, int]:
    if isinstance(queues, str):
        queues = [queues]
    weights = dict(queues) if isinstance(queues, Mapping) else dict.fromkeys(queues, 1)
    for name, weight in weights.items():
        if not isinstance(name, str):
            raise InvalidArgument(f"queue names are strings, got {name!r}")
        if isinstance(weight, bool) or not isinstance(weight, int):
            raise InvalidArgument(f"weight of queue {name!r} must be an int, got {weight!r}")
    return weights


def webhook_request(
    name: str,
    url: str,
    queues: Mapping[str, int] | Iterable[str],
    *,
    concurrency: int,
    timeout: DurationLike,
    paused: bool,
    secrets: Iterable[str],
    batch_types: Iterable[str] = (),
) -> svc.UpsertWebhookWorkerRequest:
    """An UpsertWebhookWorker request. The SDK checks types; the server checks values
    (and answers InvalidArgument naming the problem)."""
    if isinstance(secrets, str):
        raise InvalidArgument("secrets must be a collection of strings, not one string")
    if isinstance(batch_types, str):
        raise InvalidArgument("batch_types must be a collection of strings, not one string")
    type_list = list(batch_types)
    if not all(isinstance(batch_type, str) for batch_type in type_list):
        raise InvalidArgument("batch_types must be strings")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise InvalidArgument(f"concurrency must be an int >= 1, got {concurrency!r}")
    delta = to_timedelta("timeout", timeout)
    if delta is None or delta <= timedelta(0):
        raise InvalidArgument(f"timeout must be > 0, got {timeout!r}")
    secret_list = list(secrets)
    if not all(isinstance(secret, str) for secret in secret_list):
        raise InvalidArgument("secrets must be strings")
    try:
        worker = svc.WebhookWorker(
            name=name,
            url=url,
            queues=_webhook_queues(queues),
            concurrency=concurrency,
            timeout=duration_to_wire(delta),
            paused=bool(paused),
            secrets=secret_list,
            batch_types=type_list,
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"invalid webhook worker: {exc}") from None
    return svc.UpsertWebhookWorkerRequest(worker=worker)


def webhook_from_wire(message: svc.WebhookWorker) -> WebhookWorker:
    """The SDK view of a registration (the wire never carries its secrets)."""
    return WebhookWorker(
        name=message.name,
        url=message.url,
        queues=dict(message.queues),
        concurrency=message.concurrency,
        timeout=message.timeout.ToTimedelta(),
        paused=message.paused,
        created_at=timestamp_from_wire(message, "created_at"),
        updated_at=timestamp_from_wire(message, "updated_at"),
        batch_types=tuple(message.batch_types),
    )


def with_webhook_name(exc: ConveyorError, name: str) -> ConveyorError:
    """``exc``, as a WebhookWorkerNotFound naming ``name`` when the server said NOT_FOUND."""
    if exc.code == "NOT_FOUND":
        return WebhookWorkerNotFound(exc.message, code=exc.code, name=name)
    return exc


# ------------------------------------------------------------------ cron entries

_MISFIRE_TO_WIRE = {
    CronMisfire.RUN_ONCE: svc.CRON_MISFIRE_RUN_ONCE,
    CronMisfire.SKIP: svc.CRON_MISFIRE_SKIP,
}
_MISFIRE_FROM_WIRE = {value: key for key, value in _MISFIRE_TO_WIRE.items()}


def cron_request(entry: CronSpec, codec: Codec) -> svc.UpsertCronEntryRequest:
    """An UpsertCronEntry request. The SDK checks types; the server checks values."""
    if not isinstance(entry, CronSpec):
        raise InvalidArgument(f"expected a CronSpec (see conveyor.cron), got {entry!r}")
    if not isinstance(entry.task, TaskSpec):
        raise InvalidArgument("a cron entry's task must be a TaskSpec")
    try:
        message = svc.CronEntry(
            name=entry.name,
            spec=entry.schedule,
            timezone=entry.timezone,
            task=spec_to_wire(entry.task, codec),
            paused=bool(entry.paused),
            misfire=_MISFIRE_TO_WIRE[CronMisfire(entry.misfire)],
        )
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"invalid cron entry: {exc}") from None
    return svc.UpsertCronEntryRequest(entry=message)


def cron_from_wire(message: svc.CronEntry, codec: Codec) -> CronEntry:
    """The SDK view of a stored cron entry (its task's payload decoded with ``codec``)."""
    template = message.task
    try:
        payload = decode_value(codec, template.payload) if template.payload else None
    except Exception as exc:
        raise CodecError(
            f"cannot decode the payload of cron entry {message.name!r}: {exc}"
        ) from exc
    task = TaskSpec(
        type=template.type,
        payload=payload,
        queue=template.queue,
        headers=dict(template.headers),
        options=options_from_wire(template.options),
    )
    return CronEntry(
        name=message.name,
        schedule=message.spec,
        timezone=message.timezone,
        task=task,
        paused=message.paused,
        misfire=_MISFIRE_FROM_WIRE.get(message.misfire, CronMisfire.RUN_ONCE),
        next_run_at=timestamp_from_wire(message, "next_run_at"),
        last_run_at=timestamp_from_wire(message, "last_run_at"),
        created_at=timestamp_from_wire(message, "created_at"),
        updated_at=timestamp_from_wire(message, "updated_at"),
    )


def with_cron_name(exc: ConveyorError, name: str) -> ConveyorError:
    """``exc``, as a CronEntryNotFound naming ``name`` when the server said NOT_FOUND."""
    if exc.code == "NOT_FOUND":
        return CronEntryNotFound(exc.message, code=exc.code, name=name)
    return exc


_UNSET_AT = datetime(1970, 1, 1, tzinfo=UTC)


def with_group_config(exc: ConveyorError, queue: str, pattern: str) -> ConveyorError:
    """``exc``, as a GroupConfigNotFound naming ``queue`` and ``pattern`` when the server
    said NOT_FOUND."""
    if exc.code == "NOT_FOUND":
        return GroupConfigNotFound(exc.message, code=exc.code, queue=queue, pattern=pattern)
    return exc


def with_rate_limit(exc: ConveyorError, queue: str) -> ConveyorError:
    """``exc``, as a RateLimitNotFound naming ``queue`` when the server said NOT_FOUND."""
    if exc.code == "NOT_FOUND":
        return RateLimitNotFound(exc.message, code=exc.code, queue=queue)
    return exc


def rate_limit_request(queue: str, per_second: float, burst: int | None) -> svc.SetRateLimitRequest:
    """A SetRateLimit request; burst None takes the server default (one second's worth).
    InvalidArgument for a rate or burst that is not a number of the right kind."""
    if isinstance(per_second, bool) or not isinstance(per_second, int | float):
        raise InvalidArgument(f"per_second must be a number, got {per_second!r}")
    if burst is not None and (
        isinstance(burst, bool) or not isinstance(burst, int) or not 0 < burst < 2**31
    ):
        raise InvalidArgument(f"burst must be a positive int, got {burst!r}")
    return svc.SetRateLimitRequest(
        limit=svc.RateLimit(queue=queue, per_second=float(per_second), burst=burst or 0)
    )


def rate_limit_from_wire(limit: svc.RateLimit) -> RateLimit:
    """A stored rate limit."""
    return RateLimit(queue=limit.queue, per_second=limit.per_second, burst=limit.burst)


def with_concurrency_limit(exc: ConveyorError, queue: str, pattern: str) -> ConveyorError:
    """``exc``, as a ConcurrencyLimitNotFound naming ``queue`` and ``pattern`` when the
    server said NOT_FOUND."""
    if exc.code == "NOT_FOUND":
        return ConcurrencyLimitNotFound(exc.message, code=exc.code, queue=queue, pattern=pattern)
    return exc


def concurrency_limit_request(
    queue: str, per_key: int, pattern: str
) -> svc.SetConcurrencyLimitRequest:
    """A SetConcurrencyLimit request. InvalidArgument for a limit that is not an int."""
    if isinstance(per_key, bool) or not isinstance(per_key, int) or not 0 < per_key < 2**31:
        raise InvalidArgument(f"per_key must be a positive int, got {per_key!r}")
    return svc.SetConcurrencyLimitRequest(
        limit=svc.ConcurrencyLimit(queue=queue, per_key=per_key, pattern=pattern)
    )


def concurrency_limit_from_wire(limit: svc.ConcurrencyLimit) -> ConcurrencyLimit:
    """A stored concurrency limit."""
    return ConcurrencyLimit(queue=limit.queue, per_key=limit.per_key, pattern=limit.pattern)


# ------------------------------------------------------------- circuit breakers

_SCOPE_TO_WIRE = {
    BreakerScope.WORKER: svc.BREAKER_SCOPE_WORKER,
    BreakerScope.QUEUE: svc.BREAKER_SCOPE_QUEUE,
}
_SCOPE_FROM_WIRE = {value: key for key, value in _SCOPE_TO_WIRE.items()}


def breaker_scope(value: BreakerScope | str) -> BreakerScope:
    """``value`` as a BreakerScope; InvalidArgument for anything else."""
    try:
        return BreakerScope(value)
    except ValueError:
        raise InvalidArgument(f"scope must be 'worker' or 'queue', got {value!r}") from None


def _breaker_duration(name: str, value: DurationLike) -> Duration:
    try:
        delta = to_timedelta(name, value)
        if delta is None:
            raise InvalidArgument(f"{name} is required: a timedelta or seconds")
        return duration_to_wire(delta)
    except InvalidArgument:
        raise
    except (OverflowError, ValueError):  # inf, nan, beyond what a Duration holds
        raise InvalidArgument(f"{name} is out of range, got {value!r}") from None


def breaker_config_request(
    queue: str,
    failures: int,
    window: DurationLike,
    cooldown: DurationLike,
    pattern: str,
    scope: BreakerScope | str,
) -> svc.SetBreakerConfigRequest:
    """A SetBreakerConfig request. The SDK checks types (InvalidArgument for failures
    that are not an int, durations that are not a timedelta or seconds, an unknown
    scope); the server checks the values and answers InvalidArgument naming the
    problem."""
    if isinstance(failures, bool) or not isinstance(failures, int) or not 0 < failures < 2**31:
        raise InvalidArgument(f"failures must be a positive int, got {failures!r}")
    config = svc.BreakerConfig(
        queue=queue, pattern=pattern, failures=failures, scope=_SCOPE_TO_WIRE[breaker_scope(scope)]
    )
    config.window.CopyFrom(_breaker_duration("window", window))
    config.cooldown.CopyFrom(_breaker_duration("cooldown", cooldown))
    return svc.SetBreakerConfigRequest(config=config)


def breaker_config_from_wire(config: svc.BreakerConfig) -> BreakerConfig:
    """A stored breaker config."""
    return BreakerConfig(
        queue=config.queue,
        pattern=config.pattern,
        failures=config.failures,
        window=config.window.ToTimedelta(),
        cooldown=config.cooldown.ToTimedelta(),
        scope=_SCOPE_FROM_WIRE.get(config.scope, BreakerScope.WORKER),
    )


def breaker_from_wire(breaker: svc.Breaker) -> Breaker:
    """A breaker that is not closed (a state this SDK does not know reads UNKNOWN)."""
    try:
        state = BreakerState(breaker.state)
    except ValueError:
        state = BreakerState.UNKNOWN
    scope = _SCOPE_FROM_WIRE.get(
        breaker.scope, BreakerScope.WORKER if breaker.gateway else BreakerScope.QUEUE
    )
    return Breaker(
        queue=breaker.queue,
        type=breaker.type,
        scope=scope,
        state=state,
        opened_at=timestamp_from_wire(breaker, "opened_at"),
        until=timestamp_from_wire(breaker, "until"),
        failures=breaker.failures,
        gateway=breaker.gateway or None,
        worker_id=breaker.worker_id or None,
    )


def with_breaker_config(exc: ConveyorError, queue: str, pattern: str) -> ConveyorError:
    """``exc``, as a BreakerConfigNotFound naming ``queue`` and ``pattern`` when the
    server said NOT_FOUND."""
    if exc.code == "NOT_FOUND":
        return BreakerConfigNotFound(exc.message, code=exc.code, queue=queue, pattern=pattern)
    return exc


def group_config_request(
    queue: str,
    pattern: str,
    max_size: int | None,
    max_delay: timedelta | None,
    grace_period: timedelta | None,
) -> svc.SetGroupConfigRequest:
    """A SetGroupConfig request; what is None takes the server default."""
    if max_size is not None and (
        isinstance(max_size, bool) or not isinstance(max_size, int) or not 0 < max_size < 2**31
    ):
        raise InvalidArgument(f"max_size must be a positive int, got {max_size!r}")
    config = svc.GroupConfig(queue=queue, pattern=pattern, max_size=max_size or 0)
    if max_delay is not None:
        config.max_delay.CopyFrom(duration_to_wire(max_delay))
    if grace_period is not None:
        config.grace_period.CopyFrom(duration_to_wire(grace_period))
    return svc.SetGroupConfigRequest(config=config)


def group_stats_request(queue: str | None, limit: int) -> svc.GetGroupStatsRequest:
    """A GetGroupStats request; InvalidArgument for a limit outside 1..1000."""
    _check_limit(limit)
    return svc.GetGroupStatsRequest(queue=queue or "", limit=limit)


def group_config_from_wire(config: svc.GroupConfig) -> GroupConfig:
    """A stored group config."""
    return GroupConfig(
        queue=config.queue,
        pattern=config.pattern,
        max_size=config.max_size,
        max_delay=config.max_delay.ToTimedelta(),
        grace_period=config.grace_period.ToTimedelta(),
    )


def group_stats_from_wire(stats: svc.GroupStats) -> GroupStats:
    """A group's waiting members."""
    return GroupStats(
        queue=stats.queue,
        group=stats.group,
        size=stats.size,
        oldest_at=timestamp_from_wire(stats, "oldest_at") or _UNSET_AT,
        newest_at=timestamp_from_wire(stats, "newest_at") or _UNSET_AT,
    )


class AdminBase:
    """What both admin clients share: turning responses into the SDK's types."""

    _codec: Codec
    _service = ADMIN_SERVICE

    def _task(
        self,
        response: svc.GetTaskResponse | svc.TaskActionResponse | svc.TriggerCronEntryResponse,
    ) -> TaskInfo:
        if not response.HasField("task"):
            raise ConveyorError("the server response carries no task", code="INTERNAL")
        return task_from_wire(response.task, self._codec)

    def _page(self, response: svc.ListTasksResponse) -> TaskPage:
        tasks = [task_from_wire(task, self._codec) for task in response.tasks]
        return TaskPage(tasks=tasks, next_cursor=response.next_cursor or None)


def whoami_from_wire(message: svc.WhoAmIResponse) -> WhoAmI:
    """The SDK view of WhoAmI's answer."""
    return WhoAmI(
        role=message.role,
        token_name=message.token_name or None,
        auth_enabled=message.auth_enabled,
        read_only=message.read_only,
        can_read=message.can_read,
        can_mutate=message.can_mutate,
    )


# ------------------------------------------------------------------ the cluster view


def _session(message: svc.WorkerSessionInfo) -> WorkerSession:
    return WorkerSession(
        session_id=message.session_id,
        worker_id=message.worker_id,
        node=message.node,
        queues=dict(message.queues),
        concurrency=message.concurrency,
        in_flight=message.in_flight,
        labels=dict(message.labels),
        connected_at=timestamp_from_wire(message, "connected_at"),
    )


def _webhook_gateway(message: svc.WebhookGatewayInfo) -> WebhookGateway:
    return WebhookGateway(
        worker=message.worker,
        node=message.node,
        queues=dict(message.queues),
        concurrency=message.concurrency,
        in_flight=message.in_flight,
        breaker=message.breaker,
        paused=message.paused,
    )


def cluster_from_wire(message: svc.GetClusterInfoResponse) -> ClusterInfo:
    """The SDK view of GetClusterInfo's answer."""
    return ClusterInfo(
        server_version=message.server_version,
        broker=message.broker,
        answered_by=message.answered_by,
        nodes=[
            ClusterNode(
                instance=node.instance,
                kind=node.kind,
                version=node.version,
                host=node.host,
                pid=node.pid,
                started_at=timestamp_from_wire(node, "started_at"),
                sessions=[_session(s) for s in node.sessions],
                owned_queues=list(node.owned_queues),
                leader_roles=list(node.leader_roles),
                webhook_gateways=[_webhook_gateway(g) for g in node.webhook_gateways],
            )
            for node in message.nodes
        ],
        sessions=[_session(s) for s in message.sessions],
        queue_owners=dict(message.queue_owners),
        leaders=dict(message.leaders),
        webhook_gateways=[_webhook_gateway(g) for g in message.webhook_gateways],
    )
