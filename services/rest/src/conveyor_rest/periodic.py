"""A round of work repeated in the background: the REST process's health beat and its
queue sampler."""

from __future__ import annotations

import asyncio
import contextlib
import logging

logger = logging.getLogger(__name__)


class Periodic:
    """Runs :meth:`round` now, then every ``interval`` seconds (from the start of one round
    to the start of the next), in a background task between :meth:`start` and
    :meth:`stop`. A round that raises is logged and the next one runs as usual."""

    #: The background task's name, and the name a crashed round is logged under.
    name = "conveyor-rest-periodic"

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    async def round(self) -> None:
        """One round of the work."""
        raise NotImplementedError

    def start(self) -> None:
        """Run a round now, then every ``interval`` seconds, until :meth:`stop`."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Stop (a round under way is abandoned)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.round()
            except Exception:  # the loop outlives any one bad round
                logger.exception("rest.round_crashed name=%s", self.name)
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))
