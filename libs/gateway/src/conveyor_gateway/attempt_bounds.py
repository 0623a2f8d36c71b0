"""Time bounds of an attempt as the server enforces them: the task's per-attempt
``timeout`` and its absolute ``deadline``.

The SDK cancels a handler itself when either passes and reports FAILURE "timed out". The
server does not count on that: a worker that ignores the bound (a stuck thread, an SDK
that does not implement it) keeps heartbeating and would hold the task for ever. So the
gateway gives every bounded attempt a timer of ``bound + grace``; when it fires before a
Result, the worker is told to Cancel, the lease is no longer extended, and the gateway
fails the attempt itself. The grace leaves the worker's own report time to arrive first.

A deadline also stops retries: an attempt that fails when its retry could only start at
or after the deadline is archived with :data:`DEADLINE_EXCEEDED_ERROR` instead, so a task
past its deadline is never retried for ever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from conveyor_broker.clock import Clock
from conveyor_protos.v1 import task_pb2
from conveyor_runtime import wire

#: last_error prefix of a task archived because its deadline passed.
DEADLINE_EXCEEDED_ERROR = "deadline exceeded"
#: last_error of an attempt the server gave up on at its timeout (no Result came).
SERVER_TIMEOUT_ERROR = "timed out: the worker sent no result within the attempt's timeout"
#: Cancel reasons sent to the worker when the server gives up on an attempt.
TIMEOUT_CANCEL_REASON = "timed out"
DEADLINE_CANCEL_REASON = "deadline exceeded"


@dataclass(frozen=True, slots=True)
class AttemptBound:
    """When the server gives up on an attempt: ``delay`` seconds from now, because of the
    task's deadline (``by_deadline``) or of its per-attempt timeout."""

    delay: float
    by_deadline: bool

    @property
    def cancel_reason(self) -> str:
        """The reason the worker's Cancel frame carries."""
        return DEADLINE_CANCEL_REASON if self.by_deadline else TIMEOUT_CANCEL_REASON


def attempt_bound(
    timeout: timedelta | None,
    deadline: datetime | None,
    now: datetime,
    grace: timedelta,
) -> AttemptBound | None:
    """The server's bound of an attempt starting ``now``: the earlier of ``now + timeout``
    and ``deadline``, plus ``grace``. None when the task sets neither."""
    candidates: list[tuple[float, bool]] = []
    if timeout is not None and timeout > timedelta(0):
        candidates.append((timeout.total_seconds(), False))
    if deadline is not None:
        candidates.append((max(0.0, (deadline - now).total_seconds()), True))
    if not candidates:
        return None
    # On a tie the deadline wins: it is the stronger statement (no retry follows).
    seconds, by_deadline = min(candidates, key=lambda c: (c[0], not c[1]))
    return AttemptBound(seconds + grace.total_seconds(), by_deadline)


def retry_misses_deadline(deadline: datetime | None, now: datetime, delay: timedelta) -> bool:
    """True when a retry due ``delay`` from ``now`` could only start at or past ``deadline``."""
    return deadline is not None and now + delay >= deadline


def deadline_error(error: str) -> str:
    """The last_error of a task archived at its deadline after an attempt failed with
    ``error``."""
    if error.startswith(DEADLINE_EXCEEDED_ERROR):
        return error
    return f"{DEADLINE_EXCEEDED_ERROR} (not retried): {error}" if error else DEADLINE_EXCEEDED_ERROR


def envelope_bounds(env: task_pb2.TaskEnvelope) -> tuple[timedelta | None, datetime | None]:
    """The (per-attempt timeout, deadline) a delivery carries; None where unset."""
    timeout = wire.from_duration(env.timeout) if env.HasField("timeout") else None
    deadline = wire.from_timestamp(env.deadline) if env.HasField("deadline") else None
    return timeout, deadline


class AttemptTimers:
    """One timer per bounded attempt a gateway holds, keyed by lease id.

    ``on_overrun(lease_id, bound)`` runs on the event loop when an attempt outlives its
    bound before it was disarmed (by its Result, a cancel, or the session's end).
    """

    def __init__(
        self,
        *,
        grace: timedelta,
        clock: Clock,
        on_overrun: Callable[[str, AttemptBound], None],
    ) -> None:
        self._grace = grace
        self._clock = clock
        self._on_overrun = on_overrun
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._timers)

    def arm(self, lease_id: str, timeout: timedelta | None, deadline: datetime | None) -> None:
        """Start the timer of an attempt starting now (nothing when it has no bound)."""
        bound = attempt_bound(timeout, deadline, self._clock.now(), self._grace)
        if bound is None:
            return
        self.disarm(lease_id)
        loop = asyncio.get_running_loop()
        self._timers[lease_id] = loop.call_later(bound.delay, self._fire, lease_id, bound)

    def disarm(self, lease_id: str) -> None:
        """Stop the timer of ``lease_id``, if any."""
        timer = self._timers.pop(lease_id, None)
        if timer is not None:
            timer.cancel()

    def clear(self) -> None:
        """Stop every timer."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def _fire(self, lease_id: str, bound: AttemptBound) -> None:
        if self._timers.pop(lease_id, None) is not None:
            self._on_overrun(lease_id, bound)
