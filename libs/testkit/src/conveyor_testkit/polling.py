"""Waiting for a condition in a test: poll it until it holds, never sleep for time."""

from __future__ import annotations

import asyncio
import inspect
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
        raise TimeoutError(f"{message} not met within {within}s") from None
