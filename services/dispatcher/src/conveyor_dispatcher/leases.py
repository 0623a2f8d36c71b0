"""LeaseBatcher: the leases one dispatcher's queues ask for at the same moment, as one
round trip.

With many queues sharing the workers, each queue's cycle leases a task or two at a time,
and a statement apiece costs the broker and the dispatcher more than the tasks do. Like
the api's AckBatcher, there is no timer: the first lease goes out at once, and the ones
asked for while it runs go together next (``Broker.lease_many``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from conveyor_broker.errors import LeaseLost
from conveyor_broker.interface import MAX_BATCH, Broker
from conveyor_broker.types import Task

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Ask:
    queue: str
    limit: int
    ttl: timedelta
    holders: tuple[str, ...]
    future: asyncio.Future[list[Task]] = field(repr=False)


class LeaseBatcher:
    """Leases for any number of queues, joined into ``lease_many`` calls."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self._pending: list[_Ask] = []
        self._runner: asyncio.Task[None] | None = None
        #: Round trips made, and leases they carried (for tests and logs).
        self.rounds = 0
        self.asks = 0

    async def lease(
        self, queue: str, limit: int, ttl: timedelta, holders: Sequence[str] = ()
    ) -> list[Task]:
        """What ``broker.lease(queue, limit, ttl, holders=holders)`` would return, perhaps
        leased together with other queues' tasks. A broker error is raised to every caller
        of the round."""
        loop = asyncio.get_running_loop()
        ask = _Ask(queue, limit, ttl, tuple(holders), loop.create_future())
        self._pending.append(ask)
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run())
        return await ask.future

    async def _run(self) -> None:
        await asyncio.sleep(0)  # every lease asked for in this loop turn joins the first
        while self._pending:
            round_ = self._take()
            self.rounds += 1
            self.asks += len(round_)
            try:
                if len(round_) == 1:
                    ask = round_[0]
                    results = [
                        await self._broker.lease(ask.queue, ask.limit, ask.ttl, holders=ask.holders)
                    ]
                else:
                    wants = [(ask.queue, ask.limit) for ask in round_]
                    results = await self._broker.lease_many(
                        wants, round_[0].ttl, holders=[ask.holders for ask in round_]
                    )
            except Exception as exc:
                for ask in round_:
                    if not ask.future.done():
                        ask.future.set_exception(exc)
                continue
            for ask, tasks in zip(round_, results, strict=True):
                if not ask.future.done():
                    ask.future.set_result(tasks)
                elif tasks:
                    await self._give_back(tasks)  # its caller is gone

    def _take(self) -> list[_Ask]:
        """The next round: asks of distinct queues with the first one's TTL, MAX_BATCH
        tasks at most; the others wait for the round after."""
        round_: list[_Ask] = []
        rest: list[_Ask] = []
        queues: set[str] = set()
        total = 0
        ttl = self._pending[0].ttl
        for ask in self._pending:
            if ask.future.done():
                continue  # canceled before it went out
            fits = total + ask.limit <= MAX_BATCH and ask.ttl == ttl
            if fits and ask.queue not in queues:
                round_.append(ask)
                queues.add(ask.queue)
                total += ask.limit
            else:
                rest.append(ask)
        self._pending = rest
        return round_

    async def _give_back(self, tasks: Sequence[Task]) -> None:
        for task in tasks:
            try:
                await self._broker.release(task.id, task.lease_id or "")
            except LeaseLost:
                pass
            except Exception as exc:
                # Its lease expires and the reaper puts it back.
                logger.warning("dispatcher.release_failed task_id=%s error=%r", task.id, exc)

    async def aclose(self) -> None:
        """Wait for the round trip in flight."""
        if self._runner is not None:
            await asyncio.gather(self._runner, return_exceptions=True)
