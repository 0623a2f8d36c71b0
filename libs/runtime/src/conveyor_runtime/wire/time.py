"""Times on the wire: ``google.protobuf`` Timestamp and Duration.

An unset message field means None (callers check ``HasField``). Every datetime that comes
out of here is timezone-aware UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NAIVE_EPOCH = datetime(1970, 1, 1)


def _seconds_nanos(value: datetime) -> tuple[int, int]:
    # Timestamp.FromDatetime goes through utctimetuple() and calendar.timegm: several
    # microseconds a call, and the hot path converts a few per task. Integer arithmetic on
    # the difference from the epoch gives the same fields (a naive value counts as UTC).
    delta = value - (_NAIVE_EPOCH if value.tzinfo is None else _EPOCH)
    return delta.days * 86400 + delta.seconds, delta.microseconds * 1000


def set_timestamp(field: Timestamp, value: datetime) -> None:
    """Set a Timestamp field (a message's sub-message) to ``value``."""
    field.seconds, field.nanos = _seconds_nanos(value)


def timestamp(value: datetime) -> Timestamp:
    """A Timestamp for an aware datetime."""
    seconds, nanos = _seconds_nanos(value)
    return Timestamp(seconds=seconds, nanos=nanos)


def duration(value: timedelta) -> Duration:
    """A Duration for a timedelta."""
    d = Duration()
    d.FromTimedelta(value)
    return d


def from_timestamp(ts: Timestamp) -> datetime:
    """An aware UTC datetime for a Timestamp."""
    return ts.ToDatetime(tzinfo=UTC)


def from_duration(d: Duration) -> timedelta:
    """A timedelta for a Duration."""
    return d.ToTimedelta()
