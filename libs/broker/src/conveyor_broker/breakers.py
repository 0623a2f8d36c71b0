"""Circuit breakers per task type: which config applies to a type, and the breaker of one
(queue, type) on one worker, as a state machine on an injected clock.

The rules, the same wherever a breaker runs (a stream gateway, a webhook gateway):

* a type takes the config of its queue's longest matching pattern (then the first in
  code point order: the rule of :func:`conveyor_broker.groups.config_for`); a type no
  pattern matches has no breaker;
* CLOSED: every failed attempt is counted; once ``failures`` of them fall within
  ``window`` the breaker OPENS (successes do not reset the count: a handler failing one
  call in three still trips a breaker of 3 in a minute at enough traffic);
* OPEN: the type is dispatched to nobody in the scope until ``cooldown`` has passed;
* HALF_OPEN: one probe goes; its success CLOSES the breaker (the count starts again),
  its failure OPENS it again for another ``cooldown``. Outcomes of attempts that were
  already running when it opened change nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from datetime import datetime, timedelta

from conveyor_broker.groups import pattern_regex
from conveyor_broker.types import BreakerConfig, BreakerStatus


def config_for(task_type: str, configs: Iterable[BreakerConfig]) -> BreakerConfig | None:
    """The breaker config of ``task_type`` among its queue's ``configs``; None: none."""
    matching = [c for c in configs if pattern_regex(c.pattern).fullmatch(task_type)]
    if not matching:
        return None
    return min(matching, key=lambda c: (-len(c.pattern), c.pattern))


class BreakerMachine:
    """The breaker of one (queue, type) on one worker under ``config``.

    :attr:`status` is None while closed. The caller asks :meth:`allows` before it hands
    a task of the type over, calls :meth:`probe_sent` when the one it let through in
    HALF_OPEN went, and reports each attempt's end with :meth:`failed` or
    :meth:`succeeded` (``probe``: it was the probe). Each of those returns True when the
    status changed, so the caller can announce it.
    """

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self.status: BreakerStatus | None = None
        #: When it opened (last), and when it goes half-open or the probe's chance lapses.
        self.opened_at: datetime | None = None
        self.until: datetime | None = None
        #: The failures that opened it.
        self.tripped_by = 0
        #: True while the half-open breaker's probe is out.
        self.probing = False
        self._failures: deque[datetime] = deque()

    def _open(self, now: datetime, failures: int) -> None:
        self.status = BreakerStatus.OPEN
        self.opened_at = now
        self.until = now + self.config.cooldown
        self.tripped_by = failures
        self.probing = False
        self._failures.clear()

    def tick(self, now: datetime) -> bool:
        """Move an OPEN breaker whose cool-down is over to HALF_OPEN, and let a probe
        whose chance lapsed (``until`` passed while it was out: the worker died or the
        lease was lost) give way to another. True when the status changed."""
        if self.status is BreakerStatus.OPEN and self.until is not None and now >= self.until:
            self.status = BreakerStatus.HALF_OPEN
            self.probing = False
            return True
        if (
            self.status is BreakerStatus.HALF_OPEN
            and self.probing
            and self.until is not None
            and now >= self.until
        ):
            self.probing = False
        return False

    def allows(self, now: datetime) -> bool:
        """True when a task of the type may be handed over now: closed, or half-open with
        no probe out (that task is then the probe: call :meth:`probe_sent`)."""
        self.tick(now)
        if self.status is None:
            return True
        return self.status is BreakerStatus.HALF_OPEN and not self.probing

    def probe_sent(self, now: datetime, lapse: timedelta) -> None:
        """The half-open breaker's probe went; if no outcome comes within ``lapse``, another
        may go."""
        if self.status is BreakerStatus.HALF_OPEN:
            self.probing = True
            self.until = now + lapse

    def failed(self, now: datetime, *, probe: bool = False) -> bool:
        """An attempt of the type failed. True when the breaker opened."""
        if self.status is BreakerStatus.HALF_OPEN and probe:
            self._open(now, 1)
            return True
        if self.status is not None:
            return False  # an attempt that was running when it opened
        window = self.config.window
        failures = self._failures
        failures.append(now)
        while failures and now - failures[0] > window:
            failures.popleft()
        if len(failures) >= self.config.failures:
            self._open(now, len(failures))
            return True
        return False

    def succeeded(self, now: datetime, *, probe: bool = False) -> bool:
        """An attempt of the type succeeded. True when the breaker closed (its probe)."""
        if self.status is BreakerStatus.HALF_OPEN and probe:
            self.status = None
            self.opened_at = self.until = None
            self.probing = False
            self._failures.clear()
            return True
        return False
