"""What the admin clients return: pages of tasks, queue statistics, batch outcomes,
lifecycle events, dependency edges, webhook worker registrations, cron entries, limits
and circuit breakers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from conveyor._errors import InvalidArgument
from conveyor._types import DurationLike, TaskInfo, TaskSpec, TaskState, spec


@dataclass(frozen=True, slots=True)
class TaskPage:
    """One page of :meth:`AsyncAdminClient.list_tasks`, tasks ordered by id.

    Pass ``next_cursor`` back as ``cursor`` for the next page; it is None on the last.
    """

    tasks: Sequence[TaskInfo]
    next_cursor: str | None


class BreakerScope(StrEnum):
    """Whom an open circuit breaker stops sending its task type to."""

    #: The worker (stream session or webhook worker) whose attempts failed; the other
    #: workers go on getting the type.
    WORKER = "worker"
    #: Every worker of the queue.
    QUEUE = "queue"


class BreakerState(StrEnum):
    """Where a circuit breaker stands (a listed one is never closed)."""

    #: Its type goes to nobody in its scope until ``until``.
    OPEN = "open"
    #: One probe may go (or went): its success closes the breaker, its failure opens it
    #: again.
    HALF_OPEN = "half_open"
    #: It closed: only in a breaker event (:attr:`TaskEvent.breaker`), never in a listing.
    CLOSED = "closed"
    #: A state this SDK does not know (a newer server).
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """A circuit breaker per task type of ``queue``, for the types that match
    ``pattern`` (a glob: ``*`` any text, ``?`` one character; a type takes its queue's
    longest matching pattern, and a type no pattern matches has no breaker).

    Once ``failures`` attempts of one type fail on a worker within ``window``, the type
    is dispatched to nobody in ``scope`` (that worker, or every worker of the queue) for
    ``cooldown``; then the breaker is half-open and lets one probe through: its success
    closes the breaker, its failure opens it again for another ``cooldown``.
    """

    queue: str
    pattern: str
    failures: int
    window: timedelta
    cooldown: timedelta
    scope: BreakerScope = BreakerScope.WORKER


@dataclass(frozen=True, slots=True)
class Breaker:
    """A circuit breaker of ``queue`` and task ``type``: one that is not closed (open or
    half-open) in a listing or queue stats; in a breaker event (:attr:`TaskEvent.breaker`)
    it may be one that just closed.

    ``scope`` WORKER: the breaker of one worker, ``worker_id`` (on gateway
    ``gateway``); QUEUE: a queue-wide one, and both are None. ``until`` is when an OPEN
    breaker goes half-open, or when a HALF_OPEN one's probe chance lapses (another probe
    may go then); ``failures`` are the failed attempts that opened it. Timestamps are
    timezone-aware (UTC).
    """

    queue: str
    type: str
    scope: BreakerScope
    state: BreakerState
    opened_at: datetime | None
    until: datetime | None
    failures: int
    gateway: str | None = None
    worker_id: str | None = None


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """A queue's pause flag, how many of its tasks are in each state, and its circuit
    breakers that are not closed (``breakers``: open or half-open, of every worker)."""

    name: str
    paused: bool
    counts: Mapping[TaskState, int]
    breakers: Sequence[Breaker] = ()

    def count(self, state: TaskState) -> int:
        """Tasks in ``state`` (0 when none)."""
        return self.counts.get(state, 0)

    @property
    def total(self) -> int:
        """Tasks of the queue in any state."""
        return sum(self.counts.values())


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """When the aggregation groups of ``queue`` whose names match ``pattern`` are
    delivered: once they hold ``max_size`` members, ``max_delay`` after their first member
    joined, or ``grace_period`` after their last one did, whichever comes first.

    ``pattern`` is a glob over group names (``*`` any text, ``?`` one character); a group
    takes its queue's config with the longest matching pattern, or the server defaults.
    """

    queue: str
    pattern: str
    max_size: int
    max_delay: timedelta
    grace_period: timedelta


@dataclass(frozen=True, slots=True)
class RateLimit:
    """At most ``per_second`` tasks of ``queue`` started a second on average, and at most
    ``burst`` at once after a quiet spell: a token bucket, stored by the server and
    enforced by the queue's dispatcher (which leases no more tasks than it holds tokens),
    so it holds across every worker and every change of dispatcher."""

    queue: str
    per_second: float
    burst: int


@dataclass(frozen=True, slots=True)
class ConcurrencyLimit:
    """At most ``per_key`` tasks of ``queue`` running at once per concurrency key, for
    the keys that match ``pattern`` (``*`` any text, ``?`` one character; a key takes its
    queue's longest matching pattern). Enforced by the server as it leases, across every
    worker and dispatcher: a due task whose key is at its limit waits HELD, out of the way
    of other keys' tasks, until a task of its key stops running."""

    queue: str
    per_key: int
    pattern: str = "*"


@dataclass(frozen=True, slots=True)
class GroupStats:
    """An aggregation group's waiting members: how many, and when the first and the last
    joined."""

    queue: str
    group: str
    size: int
    oldest_at: datetime
    newest_at: datetime


@dataclass(frozen=True, slots=True)
class QueuePage:
    """One page of :meth:`AsyncAdminClient.list_queues`, queues by name.

    Pass ``next_cursor`` back as ``cursor`` for the next page; it is None on the last.
    """

    queues: Sequence[QueueInfo]
    next_cursor: str | None


class DependencyOutcome(StrEnum):
    """How a dependency edge stands, seen from the task that waits on it."""

    #: The dependency has not ended yet (or its end has not been resolved yet).
    OPEN = "open"
    #: The dependency completed.
    SATISFIED = "satisfied"
    #: The dependency ended without completing: archived, canceled or deleted.
    FAILED = "failed"
    #: An outcome this SDK does not know (a newer server).
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class TaskDependency:
    """One edge of the dependency graph, seen from the task asked about: the task at the
    other end (``task_id``) and how the edge stands. ``queue``, ``type`` and ``state``
    describe that task as stored now; they are None when it is gone (purged or
    deleted)."""

    task_id: str
    outcome: DependencyOutcome
    queue: str | None
    type: str | None
    state: TaskState | None


@dataclass(frozen=True, slots=True)
class DependencyPage:
    """One page of :meth:`AsyncAdminClient.list_dependencies`, by the other task's id.

    Pass ``next_cursor`` back as ``cursor`` for the next page; it is None on the last.
    """

    dependencies: Sequence[TaskDependency]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class BatchActionResult:
    """The outcome of a batch action: how many tasks it changed, and why the others
    (task id -> reason) could not be acted on."""

    affected: int
    failures: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class TaskEvent:
    """A lifecycle event: task ``task_id`` entered ``state`` at ``at``.

    ``previous_state`` is None when the task was just created; ``state`` is None when it
    was deleted. ``error`` is the task's last error when it entered ``RETRY`` or
    ``ARCHIVED``.

    A circuit breaker event is about no task: ``breaker`` is set (the breaker of
    ``queue`` and ``type`` opened, went half-open or closed: its ``state``),
    ``task_id`` is empty and ``state`` None.
    """

    task_id: str
    queue: str
    type: str
    state: TaskState | None
    previous_state: TaskState | None
    at: datetime
    error: str | None = None
    breaker: Breaker | None = None

    @property
    def deleted(self) -> bool:
        """True when the event reports the task's deletion."""
        return self.state is None and self.breaker is None


@dataclass(frozen=True, slots=True)
class WebhookWorker:
    """A webhook worker registration: the server POSTs tasks of ``queues`` (name ->
    weight) to ``url``, at most ``concurrency`` at once, each answered within ``timeout``.

    Its signing secrets are write-only: the server never returns them, so they are not
    here. ``paused`` registrations get no deliveries. ``batch_types`` are the task types
    the endpoint takes as whole aggregation groups (one call carries every member of a
    due group). Timestamps are timezone-aware (UTC).
    """

    name: str
    url: str
    queues: Mapping[str, int]
    concurrency: int
    timeout: timedelta
    paused: bool
    created_at: datetime | None
    updated_at: datetime | None
    batch_types: tuple[str, ...] = ()


class CronMisfire(StrEnum):
    """What the server does with the slots of a cron entry that it missed (the cluster
    was down past them)."""

    #: One task stands for all the missed slots.
    RUN_ONCE = "run_once"
    #: Missed slots create no task.
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class CronSpec:
    """A cron entry as an application declares it (see :func:`conveyor.cron`): on every
    slot of ``schedule`` (read in ``timezone``) the server enqueues ``task``, once."""

    name: str
    schedule: str
    task: TaskSpec
    timezone: str = "UTC"
    misfire: CronMisfire = CronMisfire.RUN_ONCE
    paused: bool = False


@dataclass(frozen=True, slots=True)
class CronEntry:
    """A cron entry stored on the server.

    ``schedule`` is five cron fields, six with seconds first, an alias (``@daily``...) or
    ``@every <duration>``, read in the IANA ``timezone``. On every slot the server
    enqueues ``task`` once (its id and unique key derived from the entry and the slot;
    the headers ``conveyor-cron`` and ``conveyor-cron-slot`` name them). ``next_run_at``
    is the next slot (None while paused), ``last_run_at`` the last one fired. Timestamps
    are timezone-aware (UTC).
    """

    name: str
    schedule: str
    timezone: str
    task: TaskSpec
    paused: bool
    misfire: CronMisfire
    next_run_at: datetime | None
    last_run_at: datetime | None
    created_at: datetime | None
    updated_at: datetime | None

    def spec(self) -> CronSpec:
        """This entry as a declaration (to apply elsewhere, say)."""
        return CronSpec(
            name=self.name,
            schedule=self.schedule,
            task=self.task,
            timezone=self.timezone,
            misfire=self.misfire,
            paused=self.paused,
        )


def cron(
    name: str,
    schedule: str,
    type: str,
    payload: Any = None,
    *,
    queue: str = "default",
    timezone: str = "UTC",
    misfire: CronMisfire | str = CronMisfire.RUN_ONCE,
    paused: bool = False,
    headers: Mapping[str, str] | None = None,
    max_retry: int | None = None,
    timeout: DurationLike | None = None,
    retention: DurationLike | None = None,
) -> CronSpec:
    """Declare a cron entry: on every slot of ``schedule`` the server enqueues a task of
    ``type`` with ``payload`` on ``queue``.

    ``schedule`` is five cron fields (``"0 3 * * *"``), six with seconds first
    (``"*/10 * * * * *"``), an alias (``@yearly``, ``@monthly``, ``@weekly``, ``@daily``,
    ``@hourly``) or ``@every <duration>`` (``"@every 90s"``); it is read in the IANA
    ``timezone``. ``misfire`` says what to do with slots missed while the cluster was
    down: ``"run_once"`` (one task for them) or ``"skip"``. The task options are the ones
    that make sense for a recurring task (each slot's task gets its own id and unique
    key). Apply declarations with ``admin.apply_cron_entries([...])``.
    """
    policy = misfire_policy(misfire)
    for label, text in (("name", name), ("schedule", schedule), ("timezone", timezone)):
        if not isinstance(text, str):
            raise InvalidArgument(f"{label} must be a string, got {text!r}")
    task = spec(
        type,
        payload,
        queue=queue,
        headers=headers,
        max_retry=max_retry,
        timeout=timeout,
        retention=retention,
    )
    return CronSpec(
        name=name,
        schedule=schedule,
        task=task,
        timezone=timezone,
        misfire=policy,
        paused=bool(paused),
    )


def misfire_policy(value: CronMisfire | str) -> CronMisfire:
    """``value`` as a CronMisfire; InvalidArgument for anything else."""
    try:
        return CronMisfire(value)
    except ValueError:
        raise InvalidArgument(f"misfire must be 'run_once' or 'skip', got {value!r}") from None


# ------------------------------------------------------------------ the cluster view


@dataclass(frozen=True, slots=True)
class WorkerSession:
    """A worker connected to an api node (one gRPC stream)."""

    session_id: str
    worker_id: str
    #: The api instance the worker is connected to.
    node: str
    queues: Mapping[str, int]
    concurrency: int
    in_flight: int
    labels: Mapping[str, str]
    connected_at: datetime | None


@dataclass(frozen=True, slots=True)
class WebhookGateway:
    """A webhook worker's gateway: the webhook service instance delivering its tasks."""

    worker: str
    node: str
    queues: Mapping[str, int]
    concurrency: int
    in_flight: int
    #: The endpoint's circuit breaker: ``"closed"``, ``"open"`` or ``"half_open"``.
    breaker: str
    paused: bool


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One service process, as it describes itself."""

    instance: str
    #: ``"api"``, ``"dispatcher"``, ``"maintenance"`` or ``"webhook"``.
    kind: str
    version: str
    host: str
    pid: int
    started_at: datetime | None
    sessions: Sequence[WorkerSession]
    #: A dispatcher's queues.
    owned_queues: Sequence[str]
    #: The singleton roles a maintenance or webhook instance leads.
    leader_roles: Sequence[str]
    webhook_gateways: Sequence[WebhookGateway]


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """What :meth:`AsyncAdminClient.cluster_info` returns: every service process that
    answered the api within its window (a dead or cut-off one is absent), and the
    cluster-wide views gathered from them."""

    server_version: str
    broker: str
    #: The api instance that answered the call.
    answered_by: str
    nodes: Sequence[ClusterNode]
    #: Every api node's worker sessions.
    sessions: Sequence[WorkerSession]
    #: Queue -> the dispatcher instance that owns it.
    queue_owners: Mapping[str, str]
    #: Leader role (``reaper``, ``scheduler``, ``resolver``, ``storage``,
    #: ``webhook-manager``) -> the instance leading it.
    leaders: Mapping[str, str]
    webhook_gateways: Sequence[WebhookGateway]

    def of_kind(self, kind: str) -> list[ClusterNode]:
        """The nodes of one kind (``"api"``, ``"dispatcher"``, ...)."""
        return [node for node in self.nodes if node.kind == kind]


@dataclass(frozen=True, slots=True)
class WhoAmI:
    """What :meth:`AsyncAdminClient.whoami` returns: who the api takes the caller for (by
    its token) and what the caller may do on the AdminService.

    Any token the api accepts may ask, whatever its role."""

    #: The token's role as configured: ``admin``, ``producer``, ``worker`` (or
    #: ``worker=<queue>+<queue>...``), ``read-only``; ``admin`` when auth is off.
    role: str
    #: The token's name (never its secret); None when auth is off.
    token_name: str | None
    #: False when the api runs without tokens (everyone may do everything).
    auth_enabled: bool
    #: True when the api refuses every AdminService mutation (``CONVEYOR_READ_ONLY``).
    read_only: bool
    #: May list and inspect (tasks, queues, stats, events...).
    can_read: bool
    #: May change things (pause, cancel, upsert...).
    can_mutate: bool
