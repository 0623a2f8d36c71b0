"""cancel_and_wait stops a task even when a cancellation gets lost on the way."""

from __future__ import annotations

import asyncio
import logging

import pytest
from conveyor_runtime.tasks import cancel_and_wait


async def test_a_task_that_loses_its_cancellation_is_cancelled_again() -> None:
    ran = asyncio.Event()
    rounds = 0

    async def stubborn() -> None:
        # What a lost cancellation looks like from the task's side: the first
        # CancelledError never ends the loop.
        nonlocal rounds
        while True:
            ran.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                rounds += 1
                if rounds == 1:
                    continue
                raise

    task = asyncio.create_task(stubborn())
    await ran.wait()
    await asyncio.wait_for(cancel_and_wait([task, None]), timeout=10)
    assert task.cancelled()
    assert rounds == 2


async def test_a_failed_task_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def broken() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(broken(), name="broken")
    await asyncio.sleep(0)  # let it fail before it is cancelled
    with caplog.at_level(logging.ERROR, logger="conveyor_runtime.tasks"):
        await cancel_and_wait([failed])
    assert "task.failed task=broken" in caplog.text
