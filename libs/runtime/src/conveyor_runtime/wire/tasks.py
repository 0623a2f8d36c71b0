"""Tasks on the wire: states, options, envelopes, stored tasks and producers' new tasks.

The broker's side of each conversion is its data model (``conveyor_broker.types``); the
checks and server defaults an api applies to a producer's request are in
:mod:`conveyor_runtime.wire.requests`.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, fields
from datetime import datetime, timedelta

from conveyor_broker.errors import InvalidTask
from conveyor_broker.types import NewTask, OnFailure, Task, TaskState
from conveyor_protos.construct import constructor
from conveyor_protos.v1 import task_pb2

from conveyor_runtime.wire.time import from_duration, from_timestamp, set_timestamp

_STATE_TO_PROTO: dict[TaskState, task_pb2.TaskState] = {
    TaskState.PENDING: task_pb2.TASK_STATE_PENDING,
    TaskState.SCHEDULED: task_pb2.TASK_STATE_SCHEDULED,
    TaskState.AGGREGATING: task_pb2.TASK_STATE_AGGREGATING,
    TaskState.BLOCKED: task_pb2.TASK_STATE_BLOCKED,
    TaskState.HELD: task_pb2.TASK_STATE_HELD,
    TaskState.ACTIVE: task_pb2.TASK_STATE_ACTIVE,
    TaskState.RETRY: task_pb2.TASK_STATE_RETRY,
    TaskState.COMPLETED: task_pb2.TASK_STATE_COMPLETED,
    TaskState.ARCHIVED: task_pb2.TASK_STATE_ARCHIVED,
    TaskState.CANCELED: task_pb2.TASK_STATE_CANCELED,
}
_STATE_FROM_PROTO = {v: k for k, v in _STATE_TO_PROTO.items()}

_ON_FAILURE_TO_PROTO: dict[OnFailure, task_pb2.OnFailure] = {
    OnFailure.BLOCK: task_pb2.ON_FAILURE_BLOCK,
    OnFailure.CONTINUE: task_pb2.ON_FAILURE_CONTINUE,
    OnFailure.CASCADE_CANCEL: task_pb2.ON_FAILURE_CASCADE_CANCEL,
}
_ON_FAILURE_FROM_PROTO = {v: k for k, v in _ON_FAILURE_TO_PROTO.items()}


# ------------------------------------------------------------------ states


def state_to_proto(state: TaskState | None) -> task_pb2.TaskState:
    """The proto enum value of ``state`` (UNSPECIFIED for None, i.e. deleted)."""
    return task_pb2.TASK_STATE_UNSPECIFIED if state is None else _STATE_TO_PROTO[state]


def state_from_proto(value: task_pb2.TaskState) -> TaskState | None:
    """The broker state of a proto enum value (None for UNSPECIFIED or unknown)."""
    return _STATE_FROM_PROTO.get(value)


def on_failure_to_proto(value: OnFailure) -> task_pb2.OnFailure:
    """The proto enum value of an OnFailure policy."""
    return _ON_FAILURE_TO_PROTO[value]


def on_failure_from_proto(value: task_pb2.OnFailure) -> OnFailure:
    """The OnFailure policy of a proto enum value (UNSPECIFIED means BLOCK)."""
    return _ON_FAILURE_FROM_PROTO.get(value, OnFailure.BLOCK)


# ------------------------------------------------------------------ tasks


def task_to_envelope(task: Task, *, attempt: int | None = None) -> task_pb2.TaskEnvelope:
    """The delivery of a leased task to a worker.

    ``attempt`` defaults to ``task.retried + 1`` (1 for the first attempt).
    """
    env = task_pb2.TaskEnvelope(
        id=task.id,
        queue=task.queue,
        type=task.type,
        payload=task.payload,
        headers=dict(task.headers),
        lease_id=task.lease_id or "",
        attempt=task.retried + 1 if attempt is None else attempt,
        max_retry=task.max_retry,
        group=task.group or "",
        concurrency_key=task.concurrency_key or "",
    )
    if task.timeout is not None:
        env.timeout.FromTimedelta(task.timeout)
    if task.deadline is not None:
        set_timestamp(env.deadline, task.deadline)
    if task.lease_expires_at is not None:
        set_timestamp(env.lease_expires_at, task.lease_expires_at)
    set_timestamp(env.enqueued_at, task.created_at)
    return env


def _options_to_proto(task: Task) -> task_pb2.TaskOptions:
    options = task_pb2.TaskOptions(
        max_retry=task.max_retry,
        unique_key=task.unique_key or "",
        group=task.group or "",
        depends_on=list(task.depends_on),
        on_failure=on_failure_to_proto(task.on_failure),
        concurrency_key=task.concurrency_key or "",
    )
    if task.timeout is not None:
        options.timeout.FromTimedelta(task.timeout)
    if task.deadline is not None:
        set_timestamp(options.deadline, task.deadline)
    if task.process_at is not None:
        set_timestamp(options.process_at, task.process_at)
    if task.expires_at is not None:
        set_timestamp(options.expires_at, task.expires_at)
    if task.retention is not None:
        options.retention.FromTimedelta(task.retention)
    if task.unique_until is not None:
        # The claim was taken at enqueue, so its TTL is measured from created_at.
        options.unique_ttl.FromTimedelta(task.unique_until - task.created_at)
    return options


def task_to_proto(task: Task) -> task_pb2.Task:
    """A stored task as read back over the API."""
    pb = task_pb2.Task(
        id=task.id,
        queue=task.queue,
        type=task.type,
        payload=task.payload,
        headers=dict(task.headers),
        options=_options_to_proto(task),
        state=state_to_proto(task.state),
        max_retry=task.max_retry,
        retried=task.retried,
        progress=task.progress or b"",
        result=task.result or b"",
        last_error=task.last_error or "",
    )
    set_timestamp(pb.created_at, task.created_at)
    set_timestamp(pb.updated_at, task.updated_at)
    if task.started_at is not None:
        set_timestamp(pb.started_at, task.started_at)
    if task.completed_at is not None:
        set_timestamp(pb.completed_at, task.completed_at)
    if task.state in (TaskState.SCHEDULED, TaskState.RETRY):
        set_timestamp(pb.next_process_at, task.available_at)
    if task.lease_expires_at is not None:
        set_timestamp(pb.lease_expires_at, task.lease_expires_at)
    return pb


#: What a task's proto holds besides these (its identity and content) comes from the rest
#: of its fields: ``_SHARED`` reads them, as the key of a template for the tasks of a
#: batch that share them.
_OWN_FIELDS = ("id", "queue", "type", "payload", "headers")
_SHARED = operator.attrgetter(*(f.name for f in fields(Task) if f.name not in _OWN_FIELDS))


class TaskProtos:
    """Writes stored tasks into proto messages in place (the items of a response), each
    from a template of what it shares with the others: ``task_to_proto``'s message,
    for a fraction of its cost when the tasks of a batch share their options, state and
    times (an EnqueueBatch's: one commit's now). At most ``templates`` are kept; past
    that, a task is converted on its own.
    """

    __slots__ = ("_limit", "_templates")

    def __init__(self, templates: int = 64) -> None:
        self._templates: dict[tuple[object, ...], bytes] = {}
        self._limit = templates

    def write(self, pb: task_pb2.Task, task: Task) -> None:
        """Fill the empty message ``pb`` with ``task``, as ``task_to_proto`` would."""
        key = _SHARED(task)
        try:
            template = self._templates.get(key)
        except TypeError:  # an unhashable value (a bytearray result, say): no template
            pb.MergeFrom(task_to_proto(task))
            return
        if template is None:
            if len(self._templates) >= self._limit:
                pb.MergeFrom(task_to_proto(task))
                return
            whole = task_to_proto(task)
            for name in _OWN_FIELDS:
                whole.ClearField(name)
            # Kept serialized: merging from bytes is cheaper than from a message.
            template = self._templates[key] = whole.SerializeToString()
        pb.MergeFromString(template)
        pb.id = task.id
        pb.queue = task.queue
        pb.type = task.type
        pb.payload = task.payload
        if task.headers:
            pb.headers.update(task.headers)


@dataclass(frozen=True, slots=True)
class _Options:
    """A wire TaskOptions as new_task_from_proto reads it, server defaults applied;
    ``process_in`` still relative (the task's ``process_at`` is now + it)."""

    max_retry: int | None
    timeout: timedelta | None
    deadline: datetime | None
    process_at: datetime | None
    process_in: timedelta | None
    expires_at: datetime | None
    retention: timedelta | None
    unique_key: str | None
    unique_ttl: timedelta | None
    group: str | None
    depends_on: tuple[str, ...]
    on_failure: OnFailure
    concurrency_key: str | None


#: Serialized options longer than this (a long depends_on) are read each time, not kept.
_CACHED_OPTIONS_MAX = 1024


def _options_from_wire(data: bytes, max_retry: int | None, retention: timedelta | None) -> _Options:
    if len(data) > _CACHED_OPTIONS_MAX:
        return _read_options(data, max_retry, retention)
    return _cached_options(data, max_retry, retention)


def _read_options(data: bytes, max_retry: int | None, retention: timedelta | None) -> _Options:
    opts = task_pb2.TaskOptions.FromString(data)
    has = opts.HasField
    if has("process_at") and has("process_in"):
        raise InvalidTask("process_at and process_in are exclusive")
    return _Options(
        max_retry=opts.max_retry if has("max_retry") else max_retry,
        timeout=from_duration(opts.timeout) if has("timeout") else None,
        deadline=from_timestamp(opts.deadline) if has("deadline") else None,
        process_at=from_timestamp(opts.process_at) if has("process_at") else None,
        process_in=from_duration(opts.process_in) if has("process_in") else None,
        expires_at=from_timestamp(opts.expires_at) if has("expires_at") else None,
        retention=from_duration(opts.retention) if has("retention") else retention,
        unique_key=opts.unique_key or None,
        unique_ttl=from_duration(opts.unique_ttl) if has("unique_ttl") else None,
        group=opts.group or None,
        depends_on=tuple(opts.depends_on),
        on_failure=on_failure_from_proto(opts.on_failure),
        concurrency_key=opts.concurrency_key or None,
    )


#: Keyed by the serialized message: the tasks of a batch mostly share one option set (often
#: none at all), so a batch of a thousand reads its options once. A message that raises is
#: not kept (lru_cache keeps results only).
_cached_options = functools.lru_cache(maxsize=256)(_read_options)

#: NewTask as its __init__ makes it, for less (see conveyor_protos.construct).
_new_task = constructor(NewTask)


def new_task_from_proto(
    pb: task_pb2.NewTask,
    now: datetime,
    *,
    max_retry: int | None = None,
    retention: timedelta | None = None,
    options: bytes | None = None,
) -> NewTask:
    """A producer's task as the broker takes it. ``process_in`` is resolved against ``now``;
    ``max_retry`` and ``retention`` are the values to use when the message leaves them unset.
    ``options`` is ``pb.options`` serialized, when the caller has it already.

    Raises InvalidTask when both ``process_at`` and ``process_in`` are set; everything else
    is checked by the broker.
    """
    if options is None:
        options = pb.options.SerializeToString()
    opts = _options_from_wire(options, max_retry, retention)
    process_at = opts.process_at if opts.process_in is None else now + opts.process_in
    headers = pb.headers
    return _new_task(
        queue=pb.queue,
        type=pb.type,
        payload=pb.payload,
        id=pb.id or None,
        headers=dict(headers) if headers else {},
        max_retry=opts.max_retry,
        timeout=opts.timeout,
        deadline=opts.deadline,
        process_at=process_at,
        expires_at=opts.expires_at,
        retention=opts.retention,
        unique_key=opts.unique_key,
        unique_ttl=opts.unique_ttl,
        group=opts.group,
        depends_on=opts.depends_on,
        on_failure=opts.on_failure,
        concurrency_key=opts.concurrency_key,
    )


def new_task_to_proto(task: NewTask) -> task_pb2.NewTask:
    """The wire form of a task to enqueue."""
    opts = task_pb2.TaskOptions(
        unique_key=task.unique_key or "",
        group=task.group or "",
        depends_on=list(task.depends_on),
        on_failure=on_failure_to_proto(task.on_failure),
        concurrency_key=task.concurrency_key or "",
    )
    if task.max_retry is not None:
        opts.max_retry = task.max_retry
    if task.timeout is not None:
        opts.timeout.FromTimedelta(task.timeout)
    if task.deadline is not None:
        set_timestamp(opts.deadline, task.deadline)
    if task.process_at is not None:
        set_timestamp(opts.process_at, task.process_at)
    if task.expires_at is not None:
        set_timestamp(opts.expires_at, task.expires_at)
    if task.retention is not None:
        opts.retention.FromTimedelta(task.retention)
    if task.unique_ttl is not None:
        opts.unique_ttl.FromTimedelta(task.unique_ttl)
    return task_pb2.NewTask(
        id=task.id or "",
        queue=task.queue,
        type=task.type,
        payload=task.payload,
        headers=dict(task.headers),
        options=opts,
    )
