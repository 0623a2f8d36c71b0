"""Retry backoff: exponential with full jitter, capped."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True, slots=True)
class Backoff:
    """``base * factor**retried``, capped at ``cap``, with a random jitter fraction removed.

    ``jitter=0.0`` makes it deterministic (used by tests).
    """

    base: timedelta = timedelta(seconds=1)
    factor: float = 2.0
    cap: timedelta = timedelta(hours=1)
    jitter: float = 0.5

    def delay(self, retried: int, rng: random.Random | None = None) -> timedelta:
        """The delay before retry number ``retried + 1`` (``retried`` starts at 0)."""
        if retried < 0:
            raise ValueError("retried must be >= 0")
        seconds = self.base.total_seconds() * (self.factor ** min(retried, 64))
        seconds = min(seconds, self.cap.total_seconds())
        if self.jitter:
            r = (rng or random).random()
            seconds *= 1.0 - self.jitter * r
        return timedelta(seconds=seconds)
