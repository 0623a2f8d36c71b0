"""Injectable clocks. Brokers take "now" from a Clock, never from the system or database."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    """Something that tells the current time as an aware UTC datetime."""

    def now(self) -> datetime: ...


class SystemClock:
    """The wall clock, in UTC."""

    def now(self) -> datetime:
        return datetime.now(UTC)


class FakeClock:
    """A clock that only moves when told to. For tests: no sleeps."""

    def __init__(self, start: datetime | None = None) -> None:
        start = start or datetime(2030, 1, 1, tzinfo=UTC)
        if start.tzinfo is None:
            raise ValueError("FakeClock needs an aware datetime")
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, delta: timedelta) -> datetime:
        """Move the clock forward by ``delta`` and return the new time."""
        if delta < timedelta(0):
            raise ValueError("time only moves forward")
        with self._lock:
            self._now += delta
            return self._now

    def set(self, when: datetime) -> None:
        """Jump to ``when`` (which must not be in the past)."""
        with self._lock:
            if when < self._now:
                raise ValueError("time only moves forward")
            self._now = when
