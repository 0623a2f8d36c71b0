"""Tasks on the wire: the SDK's specs, options, states and task snapshots as protobuf
messages, and back.

Everything proto-shaped stays in the ``*_wire`` modules and the transport; the public API
only ever sees the SDK's own dataclasses.
"""

from __future__ import annotations

import functools
from datetime import datetime, timedelta
from typing import Any

from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb

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
    try:
        payload = encode_value(codec, spec.payload)
    except Exception as exc:
        raise InvalidArgument(f"cannot encode payload of {spec.type!r}: {exc}") from exc
    return pb.NewTask(
        id=spec.id or "",
        queue=spec.queue,
        type=spec.type,
        payload=payload,
        headers=dict(spec.headers),
        options=_options_to_wire(spec.options),
    )


def _decode(codec: Codec, data: bytes, what: str, task_id: str) -> Any:
    try:
        return decode_value(codec, data)
    except Exception as exc:
        raise CodecError(f"cannot decode the {what} of task {task_id!r}: {exc}") from exc


def task_from_wire(message: pb.Task, codec: Codec) -> TaskInfo:
    """The TaskInfo for a stored wire Task, decoding payload/progress/result with ``codec``."""
    return TaskInfo(
        id=message.id,
        queue=message.queue,
        type=message.type,
        state=_STATE_FROM_WIRE.get(message.state, TaskState.UNKNOWN),
        payload=_decode(codec, message.payload, "payload", message.id),
        headers=dict(message.headers),
        options=options_from_wire(message.options),
        max_retry=message.max_retry,
        retried=message.retried,
        progress=_decode(codec, message.progress, "progress", message.id),
        result=_decode(codec, message.result, "result", message.id),
        last_error=message.last_error or None,
        created_at=timestamp_from_wire(message, "created_at"),
        updated_at=timestamp_from_wire(message, "updated_at"),
        started_at=timestamp_from_wire(message, "started_at"),
        completed_at=timestamp_from_wire(message, "completed_at"),
        next_process_at=timestamp_from_wire(message, "next_process_at"),
        lease_expires_at=timestamp_from_wire(message, "lease_expires_at"),
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
    return EnqueueResult(task=task_from_wire(message.task, codec), created=message.created)


def state_from_wire(value: int) -> TaskState:
    """The SDK state of a wire TaskState (UNKNOWN for one this SDK does not know)."""
    return _STATE_FROM_WIRE.get(value, TaskState.UNKNOWN)


def state_to_wire(state: TaskState) -> pb.TaskState:
    """The wire TaskState of an SDK state; InvalidArgument for ``UNKNOWN``."""
    for value, known in _STATE_FROM_WIRE.items():
        if known is state:
            return value  # type: ignore[return-value]
    raise InvalidArgument(f"cannot filter on task state {state!r}")
