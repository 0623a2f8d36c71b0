"""Durations and instants on the wire: protobuf Duration and Timestamp fields as
``timedelta`` and timezone-aware ``datetime`` values, and back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp


def duration_to_wire(value: timedelta) -> Duration:
    """A protobuf Duration for ``value``."""
    message = Duration()
    message.FromTimedelta(value)
    return message


def timestamp_to_wire(value: datetime) -> Timestamp:
    """A protobuf Timestamp for the aware datetime ``value``."""
    message = Timestamp()
    message.FromDatetime(value)
    return message


def duration_from_wire(owner: Message, name: str) -> timedelta | None:
    """Field ``name`` of ``owner`` as a timedelta, or None when unset."""
    if not owner.HasField(name):
        return None
    value: Duration = getattr(owner, name)
    return value.ToTimedelta()


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def timestamp_from_wire(owner: Message, name: str) -> datetime | None:
    """Field ``name`` of ``owner`` as an aware UTC datetime, or None when unset."""
    if not owner.HasField(name):
        return None
    value: Timestamp = getattr(owner, name)
    # What ToDatetime(tzinfo=UTC) returns, for a fraction of its cost: every delivery and
    # every task read back converts a few of these.
    return _EPOCH + timedelta(seconds=value.seconds, microseconds=value.nanos // 1000)
