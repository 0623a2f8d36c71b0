"""Lifecycle events on the wire: one event, and the batches NATS carries.

One NATS message on ``<prefix>.events.<queue>.<state>`` carries every event of a run of
same-queue, same-state events (typically all the rows of one broker call): a message per
event would cost each service a NATS publish per task and state. The payload is
protobuf's length-delimited stream: each TaskEvent serialized and prefixed by its size
as a varint (what ``writeDelimitedTo`` writes); one event alone is the same format.
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor_broker.types import TaskEvent, TaskState
from conveyor_protos.v1 import service_pb2
from google.protobuf.message import DecodeError

from conveyor_runtime.wire.tasks import state_from_proto, state_to_proto
from conveyor_runtime.wire.time import from_timestamp, set_timestamp


def event_state_token(state: TaskState | None) -> str:
    """The subject token of an event's state: the state's value, or ``deleted``."""
    return "deleted" if state is None else state.value


def event_to_proto(event: TaskEvent) -> service_pb2.TaskEvent:
    """A lifecycle event on the wire (state UNSPECIFIED: the task was deleted)."""
    pb = service_pb2.TaskEvent(
        task_id=event.task_id,
        queue=event.queue,
        type=event.type,
        state=state_to_proto(event.state),
        previous_state=state_to_proto(event.previous_state),
        error=event.error or "",
    )
    set_timestamp(pb.at, event.at)
    return pb


def event_from_proto(pb: service_pb2.TaskEvent) -> TaskEvent:
    """The broker event of a wire event."""
    return TaskEvent(
        task_id=pb.task_id,
        queue=pb.queue,
        type=pb.type,
        state=state_from_proto(pb.state),
        previous_state=state_from_proto(pb.previous_state),
        at=from_timestamp(pb.at),
        error=pb.error or None,
    )


def encode_events(events: Sequence[TaskEvent]) -> bytes:
    """The payload carrying ``events``, in order (see :func:`decode_events`)."""
    return encode_event_protos([event_to_proto(event) for event in events])


def encode_event_protos(events: Sequence[service_pb2.TaskEvent]) -> bytes:
    """:func:`encode_events` of events already on the wire (a breaker's, say)."""
    out = bytearray()
    for event in events:
        data = event.SerializeToString()
        size = len(data)
        while size >= 0x80:
            out.append((size & 0x7F) | 0x80)
            size >>= 7
        out.append(size)
        out += data
    return bytes(out)


def decode_events(data: bytes) -> list[service_pb2.TaskEvent]:
    """The events of a payload written by :func:`encode_events`. Raises DecodeError when
    the payload is not such a stream."""
    events: list[service_pb2.TaskEvent] = []
    pos, end = 0, len(data)
    while pos < end:
        size = shift = 0
        while True:
            if pos >= end or shift > 28:
                raise DecodeError("truncated or oversized event length")
            byte = data[pos]
            pos += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        if pos + size > end:
            raise DecodeError("event runs past the end of the payload")
        events.append(service_pb2.TaskEvent.FromString(data[pos : pos + size]))
        pos += size
    return events
