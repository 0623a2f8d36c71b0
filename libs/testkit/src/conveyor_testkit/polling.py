"""Waiting for a condition in a test: poll it until it holds, never sleep for time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]],
    *,
    within: float = 10.0,
    interval: float = 0.01,
    message: str = "condition",
) -> None:
    """Return once ``condition()`` (sync or async) is true; TimeoutError naming ``message``
    after ``within`` seconds, an async check that hangs included. For process-level
    conditions, never for broker time (use a FakeClock)."""
    scope = asyncio.timeout(within)
    try:
        async with scope:
            while True:
                outcome = condition()
                if inspect.isawaitable(outcome):
                    outcome = await outcome
                if outcome:
                    return
                await asyncio.sleep(interval)  # polling interval, not a wait for time to pass
    except TimeoutError:
        if not scope.expired():
            raise  # the condition's own TimeoutError
        raise _not_met(message, within) from None


def wait_until_blocking(
    condition: Callable[[], bool],
    *,
    within: float = 10.0,
    interval: float = 0.01,
    message: str = "condition",
) -> None:
    """Blocking twin of :func:`wait_until`, for tests without an event loop: return once
    ``condition()`` is true; TimeoutError naming ``message`` after ``within`` seconds. A
    check that hangs cannot be interrupted here, so keep each check short."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() >= deadline:
            raise _not_met(message, within)
        time.sleep(interval)  # polling interval, not a wait for time to pass


def _not_met(message: str, within: float) -> TimeoutError:
    return TimeoutError(f"{message} not met within {within}s")
