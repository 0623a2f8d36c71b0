"""The broker's data model: task states, the new-task request, stored tasks, events."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import StrEnum


class TaskState(StrEnum):
    """Lifecycle states. See the spec's "Task lifecycle"."""

    PENDING = "pending"
    SCHEDULED = "scheduled"
    AGGREGATING = "aggregating"
    BLOCKED = "blocked"
    HELD = "held"
    ACTIVE = "active"
    RETRY = "retry"
    COMPLETED = "completed"
    ARCHIVED = "archived"
    CANCELED = "canceled"


#: States a task waits in before it is leased.
WAITING_STATES: frozenset[TaskState] = frozenset(
    {
        TaskState.PENDING,
        TaskState.SCHEDULED,
        TaskState.AGGREGATING,
        TaskState.BLOCKED,
        TaskState.HELD,
        TaskState.RETRY,
    }
)
#: States a task never leaves (except ARCHIVED, which an admin may revive).
TERMINAL_STATES: frozenset[TaskState] = frozenset(
    {TaskState.COMPLETED, TaskState.ARCHIVED, TaskState.CANCELED}
)
#: States in which a unique-key claim is held.
INCOMPLETE_STATES: frozenset[TaskState] = frozenset(set(TaskState) - TERMINAL_STATES)
#: States Lease picks from (when due).
LEASABLE_STATES: frozenset[TaskState] = frozenset({TaskState.PENDING, TaskState.RETRY})


class OnFailure(StrEnum):
    """What a dependent does when a dependency fails for good."""

    BLOCK = "block"
    CONTINUE = "continue"
    CASCADE_CANCEL = "cascade_cancel"


#: last_error of a task archived by ArchiveExpired.
EXPIRED_ERROR = "task expired before dispatch"
#: last_error of a task archived by an admin cancel while it was running.
CANCELED_WHILE_RUNNING_ERROR = "canceled by an operator while running"
#: last_error of a task archived by an admin ArchiveTask.
ARCHIVED_BY_ADMIN_ERROR = "archived by an operator"
#: last_error of a task whose lease expired (set by ReapExpiredLeases).
LEASE_EXPIRED_ERROR = "lease expired"
#: last_error of a task canceled because a dependency failed (on_failure CASCADE_CANCEL):
#: the format takes the id of that dependency.
DEPENDENCY_FAILED_ERROR = "canceled: dependency {} did not complete"


class DependencyOutcome(StrEnum):
    """How one dependency edge was settled, seen from the task that waits on it."""

    #: The dependency has not ended yet (or its end has not been resolved yet).
    OPEN = "open"
    #: The dependency completed.
    SATISFIED = "satisfied"
    #: The dependency ended without completing: archived, canceled or deleted.
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class NewTask:
    """A task to enqueue. Only ``queue`` and ``type`` are required.

    ``id`` makes enqueue idempotent: enqueuing an id that exists returns the stored task
    unchanged. ``max_retry=None`` takes the broker's default.
    """

    queue: str
    type: str
    payload: bytes = b""
    id: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    max_retry: int | None = None
    timeout: timedelta | None = None
    deadline: datetime | None = None
    process_at: datetime | None = None
    expires_at: datetime | None = None
    retention: timedelta | None = None
    unique_key: str | None = None
    unique_ttl: timedelta | None = None
    group: str | None = None
    depends_on: tuple[str, ...] = ()
    on_failure: OnFailure = OnFailure.BLOCK
    concurrency_key: str | None = None


@dataclass(frozen=True, slots=True)
class Task:
    """A stored task: identity, options, and its mutable execution fields.

    ``lease_id``/``lease_expires_at`` are set only while ACTIVE, and so is ``holder``, who
    holds the lease when the lease named one (see Broker.lease). ``available_at`` is when
    a PENDING/SCHEDULED/RETRY task becomes due. ``completed_at`` is when it reached a
    terminal state. ``unique_until`` is when a TTL-bounded unique claim lapses.
    """

    id: str
    queue: str
    type: str
    payload: bytes
    headers: Mapping[str, str]
    state: TaskState
    max_retry: int
    retried: int
    timeout: timedelta | None
    deadline: datetime | None
    process_at: datetime | None
    expires_at: datetime | None
    retention: timedelta | None
    unique_key: str | None
    unique_until: datetime | None
    group: str | None
    depends_on: tuple[str, ...]
    on_failure: OnFailure
    concurrency_key: str | None
    available_at: datetime
    lease_id: str | None
    lease_expires_at: datetime | None
    progress: bytes | None
    result: bytes | None
    last_error: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    holder: str | None = None


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """The stored task, and whether this call created it (False: the id existed)."""

    task: Task
    created: bool


@dataclass(frozen=True, slots=True)
class AckItem:
    """One completion in an AckBatch."""

    task_id: str
    lease_id: str
    result: bytes | None = None


@dataclass(frozen=True, slots=True)
class LeaseRef:
    """A (task id, lease id) pair naming one delivery."""

    task_id: str
    lease_id: str


@dataclass(frozen=True, slots=True)
class ReapedTask:
    """A task whose lease expired, and where ReapExpiredLeases put it."""

    task_id: str
    queue: str
    state: TaskState


@dataclass(frozen=True, slots=True)
class TaskListParams:
    """Which tasks :meth:`~conveyor_broker.interface.Broker.list_tasks` returns: those of
    ``queue`` in ``state`` (None: any), a page of at most ``limit`` (1..MAX_BATCH) after
    ``cursor`` (the ``next_cursor`` of the previous page; None: from the start).

    ``max_bytes`` (None: no bound) also ends the page before the task that would take
    the page's :func:`listed_size` past it (the first task always comes, whatever its
    size). ``omit_payloads`` leaves every task's ``payload`` empty and its ``progress``
    and ``result`` None, and they count for nothing in the size.
    """

    queue: str | None = None
    state: TaskState | None = None
    limit: int = 100
    cursor: str | None = None
    max_bytes: int | None = None
    omit_payloads: bool = False


#: What :func:`listed_size` counts for a task's fields besides the variable ones (ids,
#: times, counters, its queue and type and keys: bounded and small).
LISTED_OVERHEAD = 512


def listed_size(task: Task, *, omit_payloads: bool = False) -> int:
    """About how many bytes ``task`` takes in a listing: its payload, progress and result
    (unless omitted), its headers and last error (UTF-8), plus :data:`LISTED_OVERHEAD`.

    The sum a ListTasks byte budget (``TaskListParams.max_bytes``) is measured in; every
    broker computes exactly this.
    """
    size = LISTED_OVERHEAD + sum(
        len(key.encode()) + len(value.encode()) for key, value in task.headers.items()
    )
    if task.last_error is not None:
        size += len(task.last_error.encode())
    if not omit_payloads:
        size += len(task.payload) + len(task.progress or b"") + len(task.result or b"")
    return size


def without_payloads(task: Task) -> Task:
    """``task`` as a listing with ``omit_payloads`` shows it: no payload, progress or
    result."""
    return replace(task, payload=b"", progress=None, result=None)


@dataclass(frozen=True, slots=True)
class TerminalPurgeParams:
    """How long :meth:`~conveyor_broker.interface.Broker.purge_terminal` keeps terminal
    rows, and how many it deletes at most (1..MAX_BATCH).

    ``default_retention`` is for COMPLETED tasks without a retention of their own;
    ``archive_retention`` for ARCHIVED and CANCELED ones. Neither may be negative.
    """

    archive_retention: timedelta
    default_retention: timedelta = timedelta(0)
    limit: int = 1000


@dataclass(frozen=True, slots=True)
class LeaseReapParams:
    """How :meth:`~conveyor_broker.interface.Broker.reap_expired_leases` sweeps: at most
    ``limit`` (1..MAX_BATCH) expired leases, each task due again ``retry_delay`` (>= 0)
    later when it has retries left."""

    limit: int = 1000
    retry_delay: timedelta = timedelta(0)


@dataclass(frozen=True, slots=True)
class HolderReleaseParams:
    """How :meth:`~conveyor_broker.interface.Broker.release_dead_holders` sweeps: the
    tasks of holders that have not beaten for ``silence`` (> 0), except the holders named
    in ``alive`` (heard from some other way), at most ``limit`` (1..MAX_BATCH) tasks."""

    silence: timedelta
    alive: frozenset[str] = frozenset()
    limit: int = 1000


@dataclass(frozen=True, slots=True)
class ReleasedTask:
    """A task whose holder was found dead, released by ReleaseDeadHolders (it is PENDING
    now, due at once)."""

    task_id: str
    queue: str
    holder: str


@dataclass(frozen=True, slots=True)
class TaskPage:
    """One page of ListTasks; ``next_cursor`` is None on the last page."""

    tasks: list[Task]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class QueuePage:
    """One page of :meth:`~conveyor_broker.interface.Broker.list_queues`, by name;
    ``next_cursor`` is None on the last page."""

    queues: list[QueueStats]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Per-state task counts of one queue, and its pause flag."""

    queue: str
    paused: bool
    counts: Mapping[TaskState, int]

    def count(self, state: TaskState) -> int:
        """Tasks in ``state`` (0 when none)."""
        return self.counts.get(state, 0)


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    """What a broker is: its driver name and schema version."""

    driver: str
    version: str
    schema_version: int | None = None


@dataclass(frozen=True, slots=True)
class StorageUpkeep:
    """What one :meth:`Broker.upkeep_storage` call found and did.

    ``live_rows``, ``dead_rows`` and ``changed_rows`` (rows written since the planner's
    statistics were last gathered) are the storage's own counters, None where it keeps
    none.
    """

    analyzed: bool = False
    vacuumed: bool = False
    live_rows: int | None = None
    dead_rows: int | None = None
    changed_rows: int | None = None


@dataclass(frozen=True, slots=True)
class TaskEvent:
    """A lifecycle event: task ``task_id`` entered ``state`` at ``at``.

    ``previous_state`` is None when the task was just created, and ``state`` is None when
    the task was deleted.
    """

    task_id: str
    queue: str
    type: str
    state: TaskState | None
    previous_state: TaskState | None
    at: datetime
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Resolution:
    """Dependency work: what a resolution did, or what a change left to resolve.

    ``promoted`` counts, per queue, the tasks that became PENDING (their queues have due
    work: wake them). ``pending`` names terminal tasks whose dependents are not all
    resolved yet (pass them to :meth:`~conveyor_broker.interface.Broker.resolve_dependents`).
    ``canceled`` names the tasks a cascade canceled, and ``edges`` counts the edges
    settled (both for logs and metrics).
    """

    promoted: Mapping[str, int] = field(default_factory=dict)
    pending: tuple[str, ...] = ()
    canceled: tuple[str, ...] = ()
    edges: int = 0

    def __bool__(self) -> bool:
        return bool(self.promoted or self.pending or self.canceled or self.edges)


@dataclass(frozen=True, slots=True)
class DependencyLink:
    """One edge of the dependency graph, seen from a task: the task at its other end and
    how the edge stands. ``queue``, ``type`` and ``state`` are None when that task is no
    longer stored (purged or deleted)."""

    task_id: str
    outcome: DependencyOutcome
    queue: str | None
    type: str | None
    state: TaskState | None


@dataclass(frozen=True, slots=True)
class DependencyPage:
    """One page of :meth:`~conveyor_broker.interface.Broker.list_dependencies`, by the
    other task's id; ``next_cursor`` is None on the last page."""

    links: list[DependencyLink]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class DependencyListParams:
    """Which edges :meth:`~conveyor_broker.interface.Broker.list_dependencies` returns:
    those of ``task_id`` to the tasks it waits for (``dependents=False``) or from the tasks
    that wait for it (``dependents=True``), a page of at most ``limit`` (1..MAX_BATCH)
    after ``cursor`` (the ``next_cursor`` of the previous page)."""

    task_id: str
    dependents: bool = False
    limit: int = 100
    cursor: str | None = None


@dataclass(frozen=True, slots=True)
class WebhookWorkerSpec:
    """A webhook worker registration as an operator writes it (UpsertWebhookWorker).

    ``secrets`` are the signing secrets, newest first. An upsert with no secrets keeps
    the stored ones (secrets are write-only: reads never show them to operators, so an
    edit must not have to repeat them). ``batch_types`` are the task types the endpoint
    takes as whole aggregation groups (one call per due group); an upsert replaces them,
    stored once each in the order given.
    """

    name: str
    url: str
    queues: Mapping[str, int]
    concurrency: int = 10
    timeout: timedelta = timedelta(seconds=30)
    paused: bool = False
    secrets: tuple[str, ...] = ()
    batch_types: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WebhookWorker:
    """A stored webhook worker registration."""

    name: str
    url: str
    queues: Mapping[str, int]
    concurrency: int
    timeout: timedelta
    paused: bool
    secrets: tuple[str, ...]
    created_at: datetime
    updated_at: datetime
    #: The task types the endpoint takes as whole aggregation groups (no duplicates).
    batch_types: tuple[str, ...] = ()


class CronMisfire(StrEnum):
    """What the scheduler does with the slots of a cron entry that it missed (the cluster
    was down past them). A slot counts as missed when the scheduler comes to it more than
    the misfire grace (``CONVEYOR_CRON_MISFIRE_GRACE``) after its time; later slots fire
    as usual."""

    #: One task stands for all the missed slots (it carries the first one's time).
    RUN_ONCE = "run_once"
    #: Missed slots create no task.
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class CronEntrySpec:
    """A cron entry as an operator writes it (UpsertCronEntry).

    ``schedule`` is read by :class:`conveyor_broker.cron.CronSchedule` in ``timezone`` (an
    IANA name). ``task`` is the template of the task each slot creates: its queue, type,
    payload, headers, and relative options (max_retry, timeout, retention, group,
    concurrency key). It has no id, unique key, dependencies or absolute times: each slot
    gets its own id and unique key (see :func:`conveyor_broker.cron.slot_task`).
    """

    name: str
    schedule: str
    task: NewTask
    timezone: str = "UTC"
    paused: bool = False
    misfire: CronMisfire = CronMisfire.RUN_ONCE


@dataclass(frozen=True, slots=True)
class CronEntry:
    """A stored cron entry.

    ``next_run_at`` is the next slot to fire (None while paused); ``last_run_at`` the last
    slot that was fired (None before the first).
    """

    name: str
    schedule: str
    timezone: str
    task: NewTask
    paused: bool
    misfire: CronMisfire
    next_run_at: datetime | None
    last_run_at: datetime | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class CronFired:
    """What :meth:`~conveyor_broker.interface.Broker.fire_cron_entry` did.

    ``applied`` is False when the entry's next run was no longer the one expected (another
    scheduler fired it, an operator changed or paused it, or it is gone): nothing changed.
    ``task`` is the slot's task when one was asked for (``created`` False when it was
    already stored).
    """

    applied: bool
    entry: CronEntry | None = None
    task: EnqueueResult | None = None


def cron_template(task: NewTask) -> NewTask:
    """A cron entry's task template as brokers store and return it: the fields a template
    may hold (queue, type, payload, headers, max_retry, timeout, retention, group,
    concurrency key), its headers a copy of their own."""
    return NewTask(
        queue=task.queue,
        type=task.type,
        payload=bytes(task.payload),
        headers=dict(task.headers),
        max_retry=task.max_retry,
        timeout=task.timeout,
        retention=task.retention,
        group=task.group,
        concurrency_key=task.concurrency_key,
    )


#: What a group no config matches is delivered at: this many members, ...
DEFAULT_GROUP_MAX_SIZE = 100
#: ... or this long after its first member joined, ...
DEFAULT_GROUP_MAX_DELAY = timedelta(seconds=30)
#: ... or this long after its last member joined, whichever comes first.
DEFAULT_GROUP_GRACE_PERIOD = timedelta(seconds=5)


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """When the aggregation groups of ``queue`` whose names match ``pattern`` are due:
    once they hold ``max_size`` members, ``max_delay`` after their first member joined, or
    ``grace_period`` after their last one did, whichever comes first.

    ``pattern`` is a glob over group names (``*`` any text, ``?`` one character; ``*``:
    every group). A group takes the config of its queue with the longest pattern that
    matches it (then the first pattern in code point order); with none, the defaults
    (:data:`DEFAULT_GROUP_MAX_SIZE` and the others).
    """

    queue: str
    pattern: str = "*"
    max_size: int = DEFAULT_GROUP_MAX_SIZE
    max_delay: timedelta = DEFAULT_GROUP_MAX_DELAY
    grace_period: timedelta = DEFAULT_GROUP_GRACE_PERIOD


@dataclass(frozen=True, slots=True)
class RateLimit:
    """At most ``per_second`` tasks of ``queue`` leased per second on average, and at
    most ``burst`` at once after a quiet spell: a token bucket of ``burst`` tokens that
    gains ``per_second`` a second, one spent per leased task (see
    :mod:`conveyor_broker.rates`). The bucket lives in the broker, so every dispatcher
    that owns the queue, one after another or two at once during a failover, spends the
    same tokens."""

    queue: str
    per_second: float
    burst: int


@dataclass(frozen=True, slots=True)
class ConcurrencyLimit:
    """At most ``per_key`` tasks of ``queue`` ACTIVE at once per concurrency key, for the
    keys that match ``pattern`` (a glob: ``*`` any text, ``?`` one character). A key
    takes the limit of its queue's longest matching pattern (then the first in code point
    order); a task with no key, or a key no pattern matches, is not limited.

    The broker enforces it as it leases (see :mod:`conveyor_broker.concurrency`): a task
    whose key is at its limit is HELD instead of leased, and the oldest HELD task of a
    key is PENDING again once an ACTIVE task of that key stops being ACTIVE."""

    queue: str
    per_key: int
    pattern: str = "*"


class BreakerScope(StrEnum):
    """Whom an open circuit breaker stops sending its task type to."""

    #: The worker (stream session or webhook worker) whose attempts failed.
    WORKER = "worker"
    #: Every worker of the queue.
    QUEUE = "queue"


class BreakerStatus(StrEnum):
    """A circuit breaker that is not closed."""

    #: Its type is dispatched to nobody in its scope until ``until``.
    OPEN = "open"
    #: One probe may go (or went, and its chance lapses at ``until``).
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """A circuit breaker per task type of ``queue``, for the types that match ``pattern``
    (a glob: ``*`` any text, ``?`` one character; a type takes its queue's longest
    matching pattern, then the first in code point order): once ``failures`` attempts of
    one type fail on a worker within ``window``, the type is dispatched to nobody in
    ``scope`` for ``cooldown``, then one probe goes: its success closes the breaker, its
    failure opens it again (see :mod:`conveyor_broker.breakers`)."""

    queue: str
    pattern: str = "*"
    failures: int = 5
    window: timedelta = timedelta(seconds=60)
    cooldown: timedelta = timedelta(seconds=30)
    scope: BreakerScope = BreakerScope.WORKER


@dataclass(frozen=True, slots=True)
class Breaker:
    """A circuit breaker of ``queue`` and ``type`` that is not closed, as stored for the
    operator to see (and, queue-wide, for the dispatchers to obey).

    ``gateway`` is the gateway whose breaker it is (WORKER scope; ``worker_id`` its
    worker's id, ``holder`` the process holding the gateway's leases, so the breakers of
    a dead process can be dropped) or "" for a queue-wide one (QUEUE scope). ``until``:
    when an OPEN breaker goes half-open, or when a HALF_OPEN one's probe chance lapses."""

    queue: str
    type: str
    status: BreakerStatus
    opened_at: datetime
    until: datetime
    failures: int
    gateway: str = ""
    worker_id: str = ""
    holder: str = ""

    @property
    def scope(self) -> BreakerScope:
        """QUEUE for a queue-wide breaker, else WORKER."""
        return BreakerScope.WORKER if self.gateway else BreakerScope.QUEUE


@dataclass(frozen=True, slots=True)
class RateGrant:
    """What :meth:`~conveyor_broker.interface.Broker.take_rate_tokens` gave: ``granted``
    tokens (as many as asked when the queue has no limit), and, when that is fewer than
    asked, ``wait``: how long until the bucket holds the next whole token."""

    granted: int
    wait: timedelta | None = None


#: The config of a group that no stored config matches (its queue aside).
DEFAULT_GROUP_CONFIG = GroupConfig(queue="")


class GroupTrigger(StrEnum):
    """Why a group is due."""

    SIZE = "size"
    MAX_DELAY = "max_delay"
    GRACE_PERIOD = "grace_period"


@dataclass(frozen=True, slots=True)
class GroupStats:
    """An aggregation group's waiting members: how many, and when the first and the last
    joined (their ``created_at``)."""

    queue: str
    group: str
    size: int
    oldest_at: datetime
    newest_at: datetime


@dataclass(frozen=True, slots=True)
class DueGroup:
    """A group past one of its config's thresholds, and the first one it passed (size
    first, then the earliest time)."""

    queue: str
    group: str
    size: int
    trigger: GroupTrigger
    max_size: int
