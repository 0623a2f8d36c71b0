"""A producer's request as the broker takes it: the task conversion plus the server's
defaults and strict checks.

Every problem is an ``InvalidTask`` whose message a caller can act on, so the gRPC layer
maps it straight to INVALID_ARGUMENT; an option whose feature is not built yet is a
``NotSupported`` (UNIMPLEMENTED), so no task is stored that could never move.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from conveyor_broker.clock import Clock
from conveyor_broker.errors import InvalidTask, NotSupported
from conveyor_broker.types import NewTask, TaskState
from conveyor_broker.validation import check_new_task
from conveyor_protos.v1 import task_pb2

from conveyor_runtime.wire.tasks import new_task_from_proto, state_from_proto
from conveyor_runtime.wire.time import from_duration


@dataclass(frozen=True, slots=True)
class TaskDefaults:
    """Server-side defaults applied to a new task that leaves them unset."""

    max_retry: int
    retention: timedelta
    max_payload: int
    #: The most bytes one NATS message carries (the connected server's ``max_payload``,
    #: read at each call: a reconnect may reach a server with another limit): a task is
    #: dispatched in one, so a bigger one could never run. None: no such bound.
    max_message: Callable[[], int] | None = None


#: Bytes of a dispatch besides a task's payload, headers, type and queue (ids, times,
#: options, framing), with room to spare.
DISPATCH_OVERHEAD = 2048


def dispatch_size(task: NewTask) -> int:
    """About how many bytes the dispatch of ``task`` takes in a NATS message (a little more,
    never less)."""
    headers = (
        sum(len(k.encode()) + len(v.encode()) + 8 for k, v in task.headers.items())
        if task.headers
        else 0
    )
    text = len(task.type.encode()) + len(task.queue.encode()) + len((task.id or "").encode())
    return len(task.payload) + headers + text + DISPATCH_OVERHEAD


_ON_FAILURE_VALUES = frozenset(task_pb2.OnFailure.values())
#: Serialized options longer than this (a long depends_on) are checked each time, not kept.
_CHECKED_OPTIONS_MAX = 1024


def _check_options(data: bytes) -> bool:
    """Refuse options no task may have whatever its other fields (an unknown on_failure,
    a negative process_in); True when they pass. Raises InvalidTask, or ValueError and
    OverflowError for a time value protobuf cannot convert."""
    opts = task_pb2.TaskOptions.FromString(data)
    if opts.on_failure not in _ON_FAILURE_VALUES:
        raise InvalidTask(f"unknown on_failure value {opts.on_failure}")
    if opts.HasField("process_in") and from_duration(opts.process_in) < timedelta(0):
        raise InvalidTask(f"process_in must be >= 0, got {from_duration(opts.process_in)}")
    return True


#: The tasks of a batch mostly share one option set: checked once (a refusal is not kept).
_checked_options = functools.lru_cache(maxsize=256)(_check_options)


def new_task_from_request(
    msg: task_pb2.NewTask, clock: Clock, defaults: TaskDefaults, *, now: datetime | None = None
) -> NewTask:
    """Validate a producer's NewTask and turn it into the broker's, with defaults applied.

    ``process_in`` becomes ``process_at`` relative to ``now`` (default: ``clock``'s now;
    a batch passes one for all its tasks); unset ``max_retry`` and ``retention`` take the
    server defaults; an empty id stays unset, for the broker to assign (in bulk, with the
    commit). Raises InvalidTask describing the first problem, or NotSupported for an
    option that is not built yet (:func:`check_supported`).
    """
    options = msg.options.SerializeToString()
    if now is None:
        now = clock.now()
    try:
        if len(options) > _CHECKED_OPTIONS_MAX:
            _check_options(options)
        else:
            _checked_options(options)
        task = new_task_from_proto(
            msg, now, max_retry=defaults.max_retry, retention=defaults.retention, options=options
        )
    except InvalidTask:
        raise
    except (ValueError, OverflowError) as exc:
        # Out-of-range timestamps and durations surface as these from protobuf/datetime.
        raise InvalidTask(f"bad time value: {exc}") from None
    check_new_task(task, max_payload=defaults.max_payload)
    if defaults.max_message is not None:
        limit = defaults.max_message()
        if limit and dispatch_size(task) > limit:
            raise InvalidTask(
                f"the task takes about {dispatch_size(task)} bytes with its headers, and "
                f"this cluster's NATS messages carry at most {limit}, so it could never be "
                "dispatched: send less, or raise the nats-server max_payload"
            )
    check_time_bounds(task, now)
    check_supported(task)
    return task


#: Task options the wire carries whose feature this server does not provide yet, and what
#: a task using one would do if it were stored: nothing, ever.
UNSUPPORTED_OPTIONS: tuple[tuple[str, str], ...] = ()


def check_supported(task: NewTask) -> None:
    """Refuse a task that uses an option this server does not act on yet. Raises
    NotSupported naming the option."""
    for name, why in UNSUPPORTED_OPTIONS:
        if getattr(task, name):
            raise NotSupported(f"{name} is not supported by this server yet ({why})")


def check_time_bounds(task: NewTask, now: datetime) -> None:
    """Refuse a ``deadline`` or ``expires_at`` that is already past at ``now``, or that
    comes no later than ``process_at``: such a task could never run. Raises InvalidTask."""
    for name in ("deadline", "expires_at"):
        when: datetime | None = getattr(task, name)
        if when is None:
            continue
        if when <= now:
            raise InvalidTask(
                f"{name} {when.isoformat()} is not in the future (server time {now.isoformat()})"
            )
        if task.process_at is not None and when <= task.process_at:
            raise InvalidTask(
                f"{name} {when.isoformat()} must be after process_at {task.process_at.isoformat()}"
            )


def state_filter(value: int) -> TaskState | None:
    """The state a request filters on: None for UNSPECIFIED; InvalidTask when unknown."""
    if value == task_pb2.TASK_STATE_UNSPECIFIED:
        return None
    state = state_from_proto(value)  # type: ignore[arg-type]
    if state is None:
        raise InvalidTask(f"unknown task state {value}")
    return state
