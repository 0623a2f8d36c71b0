"""Tasks on the wire: the SDK's specs, options, states and task snapshots as protobuf
messages, and back.

Everything proto-shaped stays in the ``*_wire`` modules and the transport; the public API
only ever sees the SDK's own dataclasses.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta
from typing import Any

from conveyor_protos.construct import constructor
from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from conveyor._errors import CodecError, ConveyorError, InvalidArgument, error_from_status
from conveyor._payload import Codec, decode_value, encode_value
from conveyor._types import (
    EnqueueResult,
    OnFailure,
    TaskInfo,
    TaskOptions,
    TaskSpec,
    TaskState,
)
from conveyor._wire_time import (
    duration_from_wire,
    duration_to_wire,
    timestamp_from_wire,
    timestamp_to_wire,
)

_STATE_FROM_WIRE: dict[int, TaskState] = {
    pb.TASK_STATE_PENDING: TaskState.PENDING,
    pb.TASK_STATE_SCHEDULED: TaskState.SCHEDULED,
    pb.TASK_STATE_AGGREGATING: TaskState.AGGREGATING,
    pb.TASK_STATE_BLOCKED: TaskState.BLOCKED,
    pb.TASK_STATE_HELD: TaskState.HELD,
    pb.TASK_STATE_ACTIVE: TaskState.ACTIVE,
    pb.TASK_STATE_RETRY: TaskState.RETRY,
    pb.TASK_STATE_COMPLETED: TaskState.COMPLETED,
    pb.TASK_STATE_ARCHIVED: TaskState.ARCHIVED,
    pb.TASK_STATE_CANCELED: TaskState.CANCELED,
}
_ON_FAILURE_TO_WIRE: dict[OnFailure, pb.OnFailure] = {
    OnFailure.BLOCK: pb.ON_FAILURE_BLOCK,
    OnFailure.CONTINUE: pb.ON_FAILURE_CONTINUE,
    OnFailure.CASCADE_CANCEL: pb.ON_FAILURE_CASCADE_CANCEL,
}
_ON_FAILURE_FROM_WIRE: dict[int, OnFailure] = {v: k for k, v in _ON_FAILURE_TO_WIRE.items()}


# Most tasks of a program share a handful of option sets (often none at all), and a batch
# of a thousand converts the same one a thousand times each way: both directions keep the
# recent conversions. TaskOptions is frozen and hashable; a cached wire message is only
# ever copied into a NewTask, never changed.
_OPTIONS_CACHE = 1024


def options_to_wire(options: TaskOptions) -> pb.TaskOptions:
    """The wire TaskOptions for ``options`` (unset fields stay unset)."""
    message = pb.TaskOptions()
    message.CopyFrom(_options_to_wire(options))
    return message


@functools.lru_cache(maxsize=_OPTIONS_CACHE)
def _options_to_wire(options: TaskOptions) -> pb.TaskOptions:
    message = pb.TaskOptions(
        depends_on=list(options.depends_on),
        on_failure=_ON_FAILURE_TO_WIRE[options.on_failure],
    )
    if options.max_retry is not None:
        message.max_retry = options.max_retry
    for name in ("timeout", "process_in", "retention", "unique_ttl"):
        delta: timedelta | None = getattr(options, name)
        if delta is not None:
            getattr(message, name).CopyFrom(duration_to_wire(delta))
    for name in ("deadline", "process_at", "expires_at"):
        instant: datetime | None = getattr(options, name)
        if instant is not None:
            getattr(message, name).CopyFrom(timestamp_to_wire(instant))
    for name in ("unique_key", "group", "concurrency_key"):
        text: str | None = getattr(options, name)
        if text is not None:
            setattr(message, name, text)
    return message


def options_from_wire(message: pb.TaskOptions) -> TaskOptions:
    """The SDK TaskOptions for a wire TaskOptions (empty strings read as None)."""
    return _options_from_wire(message.SerializeToString(deterministic=True))


@functools.lru_cache(maxsize=_OPTIONS_CACHE)
def _options_from_wire(data: bytes) -> TaskOptions:
    message = pb.TaskOptions.FromString(data)
    return TaskOptions(
        max_retry=message.max_retry if message.HasField("max_retry") else None,
        timeout=duration_from_wire(message, "timeout"),
        deadline=timestamp_from_wire(message, "deadline"),
        process_at=timestamp_from_wire(message, "process_at"),
        process_in=duration_from_wire(message, "process_in"),
        expires_at=timestamp_from_wire(message, "expires_at"),
        retention=duration_from_wire(message, "retention"),
        unique_key=message.unique_key or None,
        unique_ttl=duration_from_wire(message, "unique_ttl"),
        group=message.group or None,
        depends_on=tuple(message.depends_on),
        on_failure=_ON_FAILURE_FROM_WIRE.get(message.on_failure, OnFailure.BLOCK),
        concurrency_key=message.concurrency_key or None,
    )


def spec_to_wire(spec: TaskSpec, codec: Codec) -> pb.NewTask:
    """The wire NewTask for ``spec``, its payload encoded with ``codec``.

    Raises InvalidArgument when the codec cannot encode the payload.
    """
    return pb.NewTask(**_wire_fields(spec, codec))


def spec_into(
    tasks: RepeatedCompositeFieldContainer[pb.NewTask], spec: TaskSpec, codec: Codec
) -> None:
    """Append the wire NewTask for ``spec`` to ``tasks`` (a request's), as
    :func:`spec_to_wire` makes it: built in place, not built and then copied in.

    Raises InvalidArgument when the codec cannot encode the payload.
    """
    tasks.add(**_wire_fields(spec, codec))


def _wire_fields(spec: TaskSpec, codec: Codec) -> dict[str, Any]:
    """The fields of the wire NewTask for ``spec`` (headers only when it has some: an
    empty map costs as much to pass as the rest)."""
    try:
        payload = encode_value(codec, spec.payload)
    except Exception as exc:
        raise InvalidArgument(f"cannot encode payload of {spec.type!r}: {exc}") from exc
    fields: dict[str, Any] = {
        "id": spec.id or "",
        "queue": spec.queue,
        "type": spec.type,
        "payload": payload,
        "options": _options_to_wire(spec.options),
    }
    if spec.headers:
        fields["headers"] = dict(spec.headers)
    return fields


def _decode(codec: Codec, data: bytes, what: str, task_id: str) -> Any:
    try:
        return decode_value(codec, data)
    except Exception as exc:
        raise CodecError(f"cannot decode the {what} of task {task_id!r}: {exc}") from exc


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class _Instants:
    """Timestamps as aware UTC datetimes (what ``timestamp_from_wire`` returns), the last
    one kept: a task's ``created_at`` and ``updated_at`` are often one instant, and so are
    those of every task of one batch (a commit's now)."""

    __slots__ = ("_key", "_value")

    def __init__(self) -> None:
        self._key = (0, 0)
        self._value = _EPOCH

    def of(self, owner: Message, name: str) -> datetime | None:
        if not owner.HasField(name):
            return None
        value: Timestamp = getattr(owner, name)
        key = (value.seconds, value.nanos)
        if key != self._key:
            # A datetime is immutable: sharing one between snapshots is safe.
            self._value = _EPOCH + timedelta(seconds=key[0], microseconds=key[1] // 1000)
            self._key = key
        return self._value


_instants = _Instants()
#: TaskInfo and EnqueueResult as their __init__ makes them, for less (see conveyor_protos.construct):
#: a batch reads a thousand of each back.
_task_info = constructor(TaskInfo)
_enqueue_result = constructor(EnqueueResult)


def task_from_wire(message: pb.Task, codec: Codec) -> TaskInfo:
    """The TaskInfo for a stored wire Task, decoding payload/progress/result with ``codec``."""
    task_id = message.id
    instant = _instants.of
    headers = message.headers
    progress = message.progress
    result = message.result
    return _task_info(
        id=task_id,
        queue=message.queue,
        type=message.type,
        state=_STATE_FROM_WIRE.get(message.state, TaskState.UNKNOWN),
        payload=_decode(codec, message.payload, "payload", task_id),
        headers=dict(headers) if headers else {},
        options=options_from_wire(message.options),
        max_retry=message.max_retry,
        retried=message.retried,
        # Empty bytes are no value (decode_value's rule), so most tasks decode nothing here.
        progress=_decode(codec, progress, "progress", task_id) if progress else None,
        result=_decode(codec, result, "result", task_id) if result else None,
        last_error=message.last_error or None,
        created_at=instant(message, "created_at"),
        updated_at=instant(message, "updated_at"),
        started_at=instant(message, "started_at"),
        completed_at=instant(message, "completed_at"),
        next_process_at=instant(message, "next_process_at"),
        lease_expires_at=instant(message, "lease_expires_at"),
    )


def item_result_from_wire(message: svc.EnqueueItemResult, codec: Codec) -> EnqueueResult:
    """One EnqueueBatch item: the stored task, or the mapped error for that item."""
    if message.error_code or message.error:
        error = error_from_status(
            message.error_code or "UNKNOWN",
            message.error or message.error_code,
            existing_id=message.existing_id or None,
        )
        return EnqueueResult(task=None, created=False, error=error)
    if not message.HasField("task"):
        error = ConveyorError("the server returned neither a task nor an error", code="INTERNAL")
        return EnqueueResult(task=None, created=False, error=error)
    return _enqueue_result(
        task=task_from_wire(message.task, codec), created=message.created, error=None
    )


def state_from_wire(value: int) -> TaskState:
    """The SDK state of a wire TaskState (UNKNOWN for one this SDK does not know)."""
    return _STATE_FROM_WIRE.get(value, TaskState.UNKNOWN)


def state_to_wire(state: TaskState) -> pb.TaskState:
    """The wire TaskState of an SDK state; InvalidArgument for ``UNKNOWN``."""
    for value, known in _STATE_FROM_WIRE.items():
        if known is state:
            return value  # type: ignore[return-value]
    raise InvalidArgument(f"cannot filter on task state {state!r}")
