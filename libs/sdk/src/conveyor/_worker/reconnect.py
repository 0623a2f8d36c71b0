"""How long a worker waits before reconnecting after its stream broke."""

from __future__ import annotations

import random
from dataclasses import dataclass

from conveyor._errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class ReconnectBackoff:
    """Exponential backoff with jitter between reconnect attempts.

    Attempt ``n`` (0 for the first retry) waits ``initial * multiplier**n`` seconds, capped
    at ``maximum``, less a random fraction of up to ``jitter`` of it (so a fleet of
    workers does not reconnect in lockstep). The attempt counter resets once a session
    is welcomed.
    """

    initial: float = 0.1
    maximum: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise InvalidArgument("need 0 < initial <= maximum")
        if self.multiplier < 1:
            raise InvalidArgument("multiplier must be >= 1")
        if not 0 <= self.jitter < 1:
            raise InvalidArgument("jitter must be in [0, 1)")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before reconnect attempt ``attempt`` (counting from 0)."""
        if attempt < 0:
            raise ValueError("attempt must be >= 0")
        seconds = min(self.initial * self.multiplier ** min(attempt, 64), self.maximum)
        if self.jitter:
            seconds *= 1.0 - self.jitter * (rng or random).random()
        return seconds
