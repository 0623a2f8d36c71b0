"""What the admin clients return: pages of tasks, queue statistics, batch outcomes,
lifecycle events, dependency edges and webhook worker registrations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from conveyor._types import TaskInfo, TaskState


@dataclass(frozen=True, slots=True)
class TaskPage:
    """One page of :meth:`AsyncAdminClient.list_tasks`, tasks ordered by id.

    Pass ``next_cursor`` back as ``cursor`` for the next page; it is None on the last.
    """

    tasks: Sequence[TaskInfo]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """A queue's pause flag and how many of its tasks are in each state."""

    name: str
    paused: bool
    counts: Mapping[TaskState, int]

    def count(self, state: TaskState) -> int:
        """Tasks in ``state`` (0 when none)."""
        return self.counts.get(state, 0)

    @property
    def total(self) -> int:
        """Tasks of the queue in any state."""
        return sum(self.counts.values())


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
    """

    task_id: str
    queue: str
    type: str
    state: TaskState | None
    previous_state: TaskState | None
    at: datetime
    error: str | None = None

    @property
    def deleted(self) -> bool:
        """True when the event reports the task's deletion."""
        return self.state is None


@dataclass(frozen=True, slots=True)
class WebhookWorker:
    """A webhook worker registration: the server POSTs tasks of ``queues`` (name ->
    weight) to ``url``, at most ``concurrency`` at once, each answered within ``timeout``.

    Its signing secrets are write-only: the server never returns them, so they are not
    here. ``paused`` registrations get no deliveries. Timestamps are timezone-aware (UTC).
    """

    name: str
    url: str
    queues: Mapping[str, int]
    concurrency: int
    timeout: timedelta
    paused: bool
    created_at: datetime | None
    updated_at: datetime | None
