"""Liveness for container health checks: a file touched while the process can do its job.

A service started with ``--health-file PATH`` rewrites PATH every ``interval`` seconds
while it is healthy; ``conveyor health --file PATH`` fails when the file is older than a
few intervals. Healthy means: connected to NATS, its broker answers, and none of the
:class:`Health` signals it keeps reports a problem. A signal is a :class:`Streak` of
failures of one thing the service depends on (its ownership or leaders bucket, say):
the service is unhealthy once that thing has failed for longer than the streak's limit
(a few lease TTLs) without one success in between, so a blip never flips the check but
a service that can no longer claim or keep anything (a NATS without JetStream, a
bucket it is not allowed to use) does not go on looking healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from conveyor_broker.interface import Broker
from nats.aio.client import Client as NatsClient

logger = logging.getLogger(__name__)

INTERVAL = 2.0
#: While unhealthy, the reasons are logged when it starts and again this often.
LOG_EVERY = 30.0

Now = Callable[[], float]


class Streak:
    """Failures of one dependency since its last success.

    :meth:`succeeded` and :meth:`failed` record each outcome; :meth:`problem` says what is
    wrong once failures have gone on for ``limit`` seconds. Without any call for ``limit``
    seconds there is no evidence either way, and the streak reports nothing.
    """

    def __init__(self, name: str, limit: float, now: Now = time.monotonic) -> None:
        if limit <= 0:
            raise ValueError("limit must be > 0")
        self.name = name
        self.limit = limit
        self._now = now
        #: When the current run of failures started (None: the last outcome was a success).
        self.failing_since: float | None = None
        self._last_failure = 0.0
        self._last_error = ""

    def succeeded(self) -> None:
        """An outcome that shows the dependency works (an answer, even a refusal)."""
        self.failing_since = None

    def failed(self, error: BaseException | str) -> None:
        """An outcome that shows it does not (no answer, or no way to use it)."""
        now = self._now()
        if self.failing_since is None:
            self.failing_since = now
        self._last_failure = now
        self._last_error = error if isinstance(error, str) else repr(error)

    def problem(self) -> str | None:
        """What is wrong, when failures have lasted ``limit`` seconds and are still
        happening; else None."""
        if self.failing_since is None:
            return None
        now = self._now()
        if now - self.failing_since < self.limit or now - self._last_failure >= self.limit:
            return None
        return f"{self.name} failing for {now - self.failing_since:.0f}s ({self._last_error})"


class Health:
    """The signals one process keeps about its ability to do its job."""

    def __init__(self, now: Now = time.monotonic) -> None:
        self._now = now
        self._streaks: list[Streak] = []

    def streak(self, name: str, limit: float) -> Streak:
        """A new signal named ``name``: a problem after ``limit`` seconds of failures."""
        streak = Streak(name, limit, self._now)
        self._streaks.append(streak)
        return streak

    def problems(self) -> list[str]:
        """What is wrong right now (empty: healthy as far as the signals go)."""
        return [p for s in self._streaks if (p := s.problem()) is not None]


class Answers(Protocol):
    """What the beat asks to answer: a broker (its ``info()``), or a probe of a
    process's own database (the build-event services)."""

    async def info(self) -> object: ...


class PoolProbe:
    """:class:`Answers` for a process that speaks SQL of its own (the build-event
    services): its connection pool answers ``SELECT 1``."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    async def info(self) -> object:
        return await self._pool.fetchval("SELECT 1")


async def beat(
    path: str,
    nc: NatsClient | None,
    broker: Broker | Answers,
    interval: float = INTERVAL,
    health: Health | None = None,
) -> None:
    """Touch ``path`` every ``interval`` seconds while NATS is connected (``nc`` None: a
    process not on NATS), the broker answers and ``health`` reports no problem; log why
    not otherwise."""
    target = Path(path)
    #: When the reasons were last logged (None: healthy at the last beat).
    logged: float | None = None
    while True:
        reasons: list[str] = []
        try:
            await asyncio.wait_for(broker.info(), timeout=interval)
        except Exception as exc:
            reasons.append(f"broker not answering ({exc!r})")
        if nc is not None and not nc.is_connected:
            reasons.append("NATS disconnected")
        if health is not None:
            reasons += health.problems()
        if not reasons:
            tmp = target.with_suffix(target.suffix + ".tmp")
            tmp.write_text(f"{time.time():.3f}\n")
            os.replace(tmp, target)
            if logged is not None:
                logger.info("health.healthy path=%s", path)
            logged = None
        else:
            now = time.monotonic()
            if logged is None or now - logged >= LOG_EVERY:
                logger.warning("health.unhealthy path=%s reasons=%s", path, "; ".join(reasons))
                logged = now
        await asyncio.sleep(interval)  # the beat's period


def is_fresh(path: str, max_age: float) -> bool:
    """True when ``path`` was touched within ``max_age`` seconds."""
    with contextlib.suppress(OSError):
        return time.time() - Path(path).stat().st_mtime <= max_age
    return False
