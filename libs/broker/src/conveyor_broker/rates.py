"""Token buckets: the arithmetic of a queue's rate limit, shared by both brokers.

A bucket holds up to ``burst`` tokens and gains ``per_second`` of them every second (a
fraction at a time); a task leased from the queue spends one. Its state is two numbers,
the tokens it held at ``refilled_at``, so the tokens now follow from the clock alone
(:func:`refilled`): nothing ticks. Time never runs backwards for a bucket: a caller whose
clock is behind the last one's (another process) refills nothing and leaves
``refilled_at`` where it was, so clocks that disagree by a little never mint tokens.

The Postgres broker runs the same arithmetic in SQL (``queries/rates.py``), in the very
statement that takes the tokens, under the row's lock; the memory broker calls these.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from conveyor_broker.types import RateGrant, RateLimit


def refilled(limit: RateLimit, tokens: float, refilled_at: datetime, now: datetime) -> float:
    """The tokens a bucket holding ``tokens`` at ``refilled_at`` holds at ``now``."""
    elapsed = max(0.0, (now - refilled_at).total_seconds())
    return min(float(limit.burst), tokens + limit.per_second * elapsed)


def take(limit: RateLimit, tokens: float, want: int) -> tuple[RateGrant, float]:
    """Spend up to ``want`` whole tokens of the ``tokens`` a bucket holds now: the grant
    and the tokens left. When it grants fewer than ``want``, the grant says how long until
    the next whole token."""
    # A hair over the float so that a bucket refilled to exactly a whole token (in
    # binary, 0.99999...) grants it.
    granted = max(0, min(want, math.floor(tokens + 1e-9)))
    left = tokens - granted
    wait = None
    if granted < want:
        # left < 1 here: the time until it reaches 1 (at least a microsecond, so that a
        # caller that waits that long finds a token rather than a float's rounding).
        seconds = max(0.0, 1.0 - left) / limit.per_second
        wait = max(timedelta(microseconds=1), timedelta(seconds=seconds))
    return RateGrant(granted, wait), left


def default_burst(per_second: float) -> int:
    """The burst of a limit that sets none: one second's worth, at least 1 (and 1 for a
    rate that is no number: the limit's check refuses it)."""
    if not math.isfinite(per_second):
        return 1
    return max(1, math.ceil(per_second))
