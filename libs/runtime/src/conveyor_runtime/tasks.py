"""Stopping background tasks for sure.

On Python 3.11 a cancellation can be lost: when it lands just as an awaited
``asyncio.wait_for`` (which nats-py uses for every request) completes, the waiter returns
the result and the CancelledError never reaches the task. A loop whose task lost its
cancellation runs on, and ``task.cancel(); await task`` then waits forever: a service that
never stops on SIGTERM, a test teardown that hangs. :func:`cancel_and_wait` cancels again
until the task has really ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)

#: Seconds between repeated cancellations of a task that is still running.
RECANCEL_EVERY = 0.5


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object] | None]) -> None:
    """Cancel every task (None entries are skipped) and return once all have ended, cancelling
    again any that is still running after RECANCEL_EVERY seconds. A task's own exception is
    logged, not raised: the caller is stopping, and one failed task must not keep it from
    stopping the others."""
    given = [task for task in tasks if task is not None]
    pending = {task for task in given if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_EVERY)
        for task in pending:
            logger.warning("task.cancel_lost task=%s cancelling_again=true", task.get_name())
    for task in given:
        if not task.cancelled() and task.exception() is not None:
            logger.error("task.failed task=%s", task.get_name(), exc_info=task.exception())
