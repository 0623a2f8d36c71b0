"""Group commit: many concurrent enqueues or acks share one broker transaction.

Durability stays per task: each caller's future resolves only after the transaction
that holds its item has committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from conveyor_broker import (
    MAX_BATCH,
    AckItem,
    Broker,
    DuplicateTask,
    EnqueueResult,
    InvalidTask,
    NewTask,
)

logger = logging.getLogger(__name__)

#: Called with the results of every commit, in the committing task.
OnCommit = Callable[[Sequence[EnqueueResult]], None]


T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class _Waiting(Generic[T, R]):
    item: T
    future: asyncio.Future[R]


def _settle(future: asyncio.Future[R], result: R | BaseException) -> None:
    # A caller that gave up (its RPC was cancelled) has a done future: nothing to tell.
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


class EnqueueCommitter:
    """Collects enqueues for up to ``window`` seconds or ``max_items`` items, then commits
    them with one ``broker.enqueue_batch``.

    When that batch is refused because of an item (DuplicateTask, InvalidTask), it is split
    in halves committed in order, down to single items, so every caller gets its own
    answer, exactly as if the items had been committed one by one.
    """

    def __init__(
        self,
        broker: Broker,
        *,
        window: float,
        max_items: int,
        on_commit: OnCommit | None = None,
    ) -> None:
        self._broker = broker
        self._window = window
        self._max_items = max(1, min(max_items, MAX_BATCH))
        self._on_commit = on_commit
        self._pending: list[_Waiting[NewTask, EnqueueResult]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._commits: set[asyncio.Task[None]] = set()

    async def enqueue(self, task: NewTask) -> EnqueueResult:
        """Store ``task`` (in a shared commit) and return it once committed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[EnqueueResult] = loop.create_future()
        self._pending.append(_Waiting(task, future))
        if len(self._pending) >= self._max_items:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self._window, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            batch = self._pending[: self._max_items]
            del self._pending[: self._max_items]
            task = asyncio.get_running_loop().create_task(self._commit(batch))
            self._commits.add(task)
            task.add_done_callback(self._commits.discard)

    async def _commit(self, batch: list[_Waiting[NewTask, EnqueueResult]]) -> None:
        try:
            results = await self._broker.enqueue_batch([w.item for w in batch])
        except (DuplicateTask, InvalidTask) as exc:
            if len(batch) == 1:
                _settle(batch[0].future, exc)
                return
            # One item spoiled the batch for everyone. Committing the halves in order
            # gives every caller the answer it would have had alone (an earlier item
            # wins a unique key over a later one), in O(bad items * log n) transactions
            # rather than one per item.
            logger.debug("enqueue.group_commit_split items=%d reason=%s", len(batch), exc)
            middle = len(batch) // 2
            await self._commit(batch[:middle])
            await self._commit(batch[middle:])
            return
        except Exception as exc:
            for waiting in batch:
                _settle(waiting.future, exc)
            return
        self._committed(results)
        for waiting, result in zip(batch, results, strict=True):
            _settle(waiting.future, result)

    def _committed(self, results: Sequence[EnqueueResult]) -> None:
        if self._on_commit is None:
            return
        try:
            self._on_commit(results)
        except Exception:
            logger.exception("enqueue.on_commit_failed")

    async def aclose(self) -> None:
        """Commit whatever is waiting and wait for every commit in progress."""
        self._flush()
        while self._commits:
            await asyncio.gather(*self._commits, return_exceptions=True)


class AckBatcher:
    """Acks that arrive while a commit is in flight are committed together next.

    No timer: the first ack goes out at once, and the ones that pile up behind it share
    the following ``broker.ack_batch``. So a lone ack pays no extra latency and a flood
    costs one transaction per round trip.
    """

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self._pending: list[_Waiting[AckItem, bool]] = []
        self._runner: asyncio.Task[None] | None = None

    async def ack(self, item: AckItem) -> bool:
        """Ack one delivery; False when its lease was lost (nothing changed)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        self._pending.append(_Waiting(item, future))
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run())
        return await future

    async def _run(self) -> None:
        # One yield collects every ack of this loop turn into the first batch.
        await asyncio.sleep(0)
        while self._pending:
            batch = self._pending[:MAX_BATCH]
            del self._pending[:MAX_BATCH]
            try:
                results = await self._broker.ack_batch([w.item for w in batch])
            except Exception as exc:
                for waiting in batch:
                    _settle(waiting.future, exc)
                continue
            for waiting, acked in zip(batch, results, strict=True):
                _settle(waiting.future, acked)

    async def aclose(self) -> None:
        """Wait for the acks in progress."""
        if self._runner is not None:
            await asyncio.gather(self._runner, return_exceptions=True)
