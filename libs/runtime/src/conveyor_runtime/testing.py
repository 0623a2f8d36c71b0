"""Helpers for tests of services built on the runtime (no pytest dependency)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


async def eventually(
    check: Callable[[], bool | Awaitable[bool]],
    *,
    within: float = 10.0,
    interval: float = 0.02,
) -> None:
    """Return once ``check()`` (sync or async) is true; raise TimeoutError after ``within``
    seconds. For process-level conditions, never for broker time (use a FakeClock)."""
    async with asyncio.timeout(within):
        while True:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            await asyncio.sleep(interval)
