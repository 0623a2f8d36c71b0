"""The SDK's public data model: task states, options, specs and task snapshots."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from types import MappingProxyType
from typing import Any, TypeAlias

from conveyor._errors import ConveyorError, InvalidArgument
from conveyor._limits import MAX_KEY_LEN, MAX_TYPE_LEN, check_text, is_queue_name

#: A duration given as a ``timedelta`` or as seconds.
DurationLike: TypeAlias = timedelta | float | int

#: EnqueueBatch and EnqueueTx accept at most this many tasks.
MAX_BATCH = 1000


class TaskState(StrEnum):
    """Where a task is in its lifecycle.

    Waiting: ``PENDING``, ``SCHEDULED``, ``AGGREGATING``, ``BLOCKED``, ``HELD`` (due, its
    concurrency key at its limit), ``RETRY``. Running:
    ``ACTIVE``. Terminal: ``COMPLETED``, ``ARCHIVED``, ``CANCELED``. ``UNKNOWN`` stands for a
    state this SDK version does not know (a newer server).
    """

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
    UNKNOWN = "unknown"

    @property
    def is_terminal(self) -> bool:
        """True for states a task never leaves on its own (completed, archived, canceled)."""
        return self in (TaskState.COMPLETED, TaskState.ARCHIVED, TaskState.CANCELED)


class OnFailure(StrEnum):
    """What a dependent task does when one of its dependencies fails for good."""

    BLOCK = "block"
    CONTINUE = "continue"
    CASCADE_CANCEL = "cascade_cancel"


def to_timedelta(name: str, value: DurationLike | None) -> timedelta | None:
    """``value`` (timedelta or seconds) as a timedelta; ``InvalidArgument`` for other types."""
    if value is None or isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{name} must be a timedelta or seconds, got {value!r}")
    return timedelta(seconds=value)


def _check_duration(name: str, value: timedelta | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not isinstance(value, timedelta):
        raise InvalidArgument(f"{name} must be a timedelta, got {value!r}")
    if value < timedelta(0) or (value == timedelta(0) and not allow_zero):
        raise InvalidArgument(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _check_instant(name: str, value: datetime | None) -> None:
    if value is None:
        return
    if not isinstance(value, datetime):
        raise InvalidArgument(f"{name} must be a datetime, got {value!r}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument(f"{name} must be timezone-aware")


def _check_key(name: str, value: str | None) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not 0 < len(value) <= MAX_KEY_LEN:
        raise InvalidArgument(f"{name} must be a string of 1-{MAX_KEY_LEN} characters")
    check_text(name, value)


@dataclass(frozen=True, slots=True)
class TaskOptions:
    """How a task is run: retries, time bounds, scheduling, uniqueness, grouping.

    Every field is optional. ``max_retry`` counts retries after the first attempt (``None``:
    the server default). ``timeout`` bounds each attempt, ``deadline`` the whole task.
    ``process_at`` / ``process_in`` delay the first attempt (at most one of them).
    ``expires_at`` archives a task still waiting at that instant. ``retention`` is how long
    a completed task is kept. ``unique_key`` allows one incomplete task per queue and key,
    for at most ``unique_ttl``. ``group`` aggregates tasks into batches. ``depends_on``
    names tasks that must complete first, and ``on_failure`` what happens if one fails.
    ``concurrency_key`` limits how many tasks sharing it run at once on the queue.
    """

    max_retry: int | None = None
    timeout: timedelta | None = None
    deadline: datetime | None = None
    process_at: datetime | None = None
    process_in: timedelta | None = None
    expires_at: datetime | None = None
    retention: timedelta | None = None
    unique_key: str | None = None
    unique_ttl: timedelta | None = None
    group: str | None = None
    depends_on: tuple[str, ...] = ()
    on_failure: OnFailure = OnFailure.BLOCK
    concurrency_key: str | None = None

    def __post_init__(self) -> None:
        if self.max_retry is not None and (
            isinstance(self.max_retry, bool) or not isinstance(self.max_retry, int)
        ):
            raise InvalidArgument(f"max_retry must be an int, got {self.max_retry!r}")
        if self.max_retry is not None and self.max_retry < 0:
            raise InvalidArgument(f"max_retry must be >= 0, got {self.max_retry}")
        _check_duration("timeout", self.timeout)
        _check_duration("process_in", self.process_in, allow_zero=True)
        _check_duration("retention", self.retention, allow_zero=True)
        _check_duration("unique_ttl", self.unique_ttl)
        for name in ("deadline", "process_at", "expires_at"):
            _check_instant(name, getattr(self, name))
        if self.process_at is not None and self.process_in is not None:
            raise InvalidArgument("process_at and process_in are exclusive")
        for name in ("unique_key", "group", "concurrency_key"):
            _check_key(name, getattr(self, name))
        if self.unique_ttl is not None and self.unique_key is None:
            raise InvalidArgument("unique_ttl needs a unique_key")
        if not isinstance(self.depends_on, tuple) or not all(
            isinstance(dep, str) and dep for dep in self.depends_on
        ):
            raise InvalidArgument("depends_on must be a tuple of task ids")
        if not isinstance(self.on_failure, OnFailure):
            raise InvalidArgument(f"on_failure must be an OnFailure, got {self.on_failure!r}")


_PLAIN_MAPPINGS = (MappingProxyType, dict)


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """A task to enqueue: its type, payload (encoded by the client's codec), queue, options.

    Build one with :func:`spec` (or ``client.spec(...)``), which takes the options as
    keyword arguments. ``id`` makes enqueue idempotent: enqueuing an id that exists returns
    the stored task. ``headers`` are free-form string pairs passed to the handler.
    """

    type: str
    payload: Any = None
    queue: str = "default"
    id: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    options: TaskOptions = field(default_factory=TaskOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.type, str) or not 0 < len(self.type) <= MAX_TYPE_LEN:
            raise InvalidArgument(f"task type must be a string of 1-{MAX_TYPE_LEN} characters")
        check_text("task type", self.type)
        if not is_queue_name(self.queue):
            raise InvalidArgument(
                f"invalid queue name {self.queue!r}: 1-128 ASCII letters, digits, '_' or '-', "
                "starting with a letter or digit"
            )
        if self.id is not None and (not isinstance(self.id, str) or not self.id):
            raise InvalidArgument("id must be a non-empty string (a ULID) or None")
        headers = self.headers
        # The exact types first: an ABC's isinstance costs more than the rest of the checks.
        if type(headers) not in _PLAIN_MAPPINGS and not isinstance(headers, Mapping):
            raise InvalidArgument("headers must map non-empty strings to strings")
        if headers:  # most tasks carry none: no generator to start
            if not all(isinstance(k, str) and k and isinstance(v, str) for k, v in headers.items()):
                raise InvalidArgument("headers must map non-empty strings to strings")
            for key, value in headers.items():
                check_text("a header key", key)
                check_text(f"header {key!r}", value)
        if not isinstance(self.options, TaskOptions):
            raise InvalidArgument("options must be a TaskOptions")


_NO_OPTIONS = TaskOptions()
#: The headers of a spec that has none: one read-only view shared by all of them (nothing
#: can change it, and a batch of a thousand specs then makes no thousand empty views).
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


def spec(
    type: str,
    payload: Any = None,
    *,
    queue: str = "default",
    id: str | None = None,
    headers: Mapping[str, str] | None = None,
    max_retry: int | None = None,
    timeout: DurationLike | None = None,
    deadline: datetime | None = None,
    process_at: datetime | None = None,
    process_in: DurationLike | None = None,
    expires_at: datetime | None = None,
    retention: DurationLike | None = None,
    unique_key: str | None = None,
    unique_ttl: DurationLike | None = None,
    group: str | None = None,
    depends_on: Iterable[str] = (),
    on_failure: OnFailure | str = OnFailure.BLOCK,
    concurrency_key: str | None = None,
) -> TaskSpec:
    """Build a validated :class:`TaskSpec`; durations are timedeltas or seconds.

    Raises :class:`InvalidArgument` describing the first problem found. See
    :class:`TaskOptions` for what each option means.
    """
    if isinstance(depends_on, str):
        raise InvalidArgument("depends_on must be a collection of task ids, not one string")
    if (
        max_retry is None
        and timeout is None
        and deadline is None
        and process_at is None
        and process_in is None
        and expires_at is None
        and retention is None
        and unique_key is None
        and unique_ttl is None
        and group is None
        and depends_on == ()
        and on_failure is OnFailure.BLOCK
        and concurrency_key is None
    ):
        # No option given (the usual case): share one already-checked TaskOptions.
        return TaskSpec(
            type=type,
            payload=payload,
            queue=queue,
            id=id,
            headers=MappingProxyType(dict(headers)) if headers else _NO_HEADERS,
            options=_NO_OPTIONS,
        )
    try:
        failure_mode = OnFailure(on_failure)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in OnFailure)
        raise InvalidArgument(f"on_failure must be one of {choices}, got {on_failure!r}") from None
    options = TaskOptions(
        max_retry=max_retry,
        timeout=to_timedelta("timeout", timeout),
        deadline=deadline,
        process_at=process_at,
        process_in=to_timedelta("process_in", process_in),
        expires_at=expires_at,
        retention=to_timedelta("retention", retention),
        unique_key=unique_key,
        unique_ttl=to_timedelta("unique_ttl", unique_ttl),
        group=group,
        depends_on=tuple(depends_on),
        on_failure=failure_mode,
        concurrency_key=concurrency_key,
    )
    return TaskSpec(
        type=type,
        payload=payload,
        queue=queue,
        id=id,
        headers=MappingProxyType(dict(headers)) if headers else _NO_HEADERS,
        options=options,
    )


@dataclass(frozen=True, slots=True)
class TaskInfo:
    """A snapshot of a stored task, as the server returned it.

    ``payload``, ``progress`` and ``result`` are decoded with the client's codec (``None``
    when absent). ``max_retry`` is the effective value and ``retried`` how many retries have
    happened. Timestamps are timezone-aware (UTC); ``started_at`` is when the current or
    last attempt started, ``completed_at`` when the task reached a terminal state,
    ``next_process_at`` when a scheduled or retrying task becomes due.
    """

    id: str
    queue: str
    type: str
    state: TaskState
    payload: Any
    headers: Mapping[str, str]
    options: TaskOptions
    max_retry: int
    retried: int
    progress: Any
    result: Any
    last_error: str | None
    created_at: datetime | None
    updated_at: datetime | None
    started_at: datetime | None
    completed_at: datetime | None
    next_process_at: datetime | None
    lease_expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """The outcome of one item of ``enqueue_batch``: the task, or the error for that item.

    ``created`` is False when a task with the same id already existed (and ``task`` is
    that stored task).
    """

    task: TaskInfo | None
    created: bool = False
    error: ConveyorError | None = None

    @property
    def ok(self) -> bool:
        """True when the item was stored (or already existed)."""
        return self.error is None
