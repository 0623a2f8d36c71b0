"""The per-endpoint circuit breaker: a pure state machine over caller-supplied time.

- CLOSED: deliveries flow at the registration's full concurrency. ``threshold``
  consecutive transport failures (connection error, timeout, 5xx) open it; any other
  answer resets the count.
- OPEN: capacity 0 for ``cooldown`` seconds; answers of deliveries still in flight are
  ignored. After the cooldown it is HALF_OPEN.
- HALF_OPEN: a single probe slot. Only the probe's answer decides: a transport failure
  opens it again for another cooldown, any other answer closes it (the breaker guards
  the transport: an HTTP 404 or an invalid body proves the endpoint reachable).

Every delivery takes a :class:`Ticket` when it is sent (:meth:`CircuitBreaker.ticket`)
and hands it back with its answer: answers of deliveries sent in an earlier state (a
request still in flight from before the breaker opened, say) change nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(enum.Enum):
    """Where the breaker is."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class Ticket:
    """When a delivery was sent: the breaker's epoch (one per CLOSED/OPEN period) and
    whether it was the probe (sent while HALF_OPEN)."""

    epoch: int
    probe: bool


class CircuitBreaker:
    """One endpoint's breaker. Times are seconds on any monotonic clock."""

    def __init__(self, threshold: int, cooldown: float) -> None:
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold}")
        if cooldown <= 0:
            raise ValueError(f"cooldown must be > 0, got {cooldown}")
        self.threshold = threshold
        self.cooldown = cooldown
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._epoch = 0

    @property
    def failures(self) -> int:
        """Consecutive transport failures counted while closed."""
        return self._failures

    def state(self, now: float) -> BreakerState:
        """The state at ``now`` (an open breaker turns half-open once its cooldown passed)."""
        if self._state is BreakerState.OPEN and now >= self._opened_at + self.cooldown:
            self._state = BreakerState.HALF_OPEN
        return self._state

    def cap(self, now: float) -> int | None:
        """How many synchronous deliveries the breaker allows at ``now``: None (no
        limit), 0 (open) or 1 (the probe)."""
        state = self.state(now)
        if state is BreakerState.CLOSED:
            return None
        return 0 if state is BreakerState.OPEN else 1

    def reopens_at(self) -> float | None:
        """When an open breaker lets its probe through (None unless open)."""
        if self._state is BreakerState.OPEN:
            return self._opened_at + self.cooldown
        return None

    def ticket(self, now: float) -> Ticket:
        """The ticket of a delivery sent at ``now``."""
        state = self.state(now)
        return Ticket(self._epoch, state is BreakerState.HALF_OPEN)

    def _counts(self, state: BreakerState, sent: Ticket | None) -> bool:
        if sent is None:
            return True  # an answer to a delivery sent just now
        if sent.epoch != self._epoch:
            return False
        return sent.probe if state is BreakerState.HALF_OPEN else True

    def record_success(self, now: float, sent: Ticket | None = None) -> None:
        """The endpoint answered (whatever the outcome) a delivery sent with ``sent``
        (None: sent just now)."""
        state = self.state(now)
        if state is BreakerState.OPEN or not self._counts(state, sent):
            return
        if state is BreakerState.HALF_OPEN:
            self._state = BreakerState.CLOSED
            self._epoch += 1
        self._failures = 0

    def record_failure(self, now: float, sent: Ticket | None = None) -> None:
        """A transport failure (a connection error, a timeout or a 5xx) of a delivery
        sent with ``sent`` (None: sent just now)."""
        state = self.state(now)
        if state is BreakerState.OPEN or not self._counts(state, sent):
            return
        if state is BreakerState.HALF_OPEN:
            self._open(now)
            return
        self._failures += 1
        if self._failures >= self.threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = now
        self._failures = 0
        self._epoch += 1
