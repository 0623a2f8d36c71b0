"""Group commit: many concurrent enqueues or acks share one broker transaction.

Durability stays per task: each caller's future resolves only after the transaction
that holds its item has committed.

Neither batcher holds a lone item back. The first item goes to the broker at once; items
that arrive while a commit is in flight gather behind it and go together when it ends (an
enqueue also goes after ``window`` seconds, so a slow commit cannot hold the others up
for long). At light load every item pays one commit and nothing more; under load each
round trip carries everything that arrived during the previous one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
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
from conveyor_runtime import metrics

logger = logging.getLogger(__name__)

#: Called with the results of every commit, in the committing task.
OnCommit = Callable[[Sequence[EnqueueResult]], None]
#: One item's outcome: its result, or the error that kept it from being committed (its
#: own, such as DuplicateTask, or its commit's, such as the broker being down).
EnqueueOutcome = EnqueueResult | Exception


T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class _Group(Generic[T, R]):
    """The items of one caller, answered together once their commit is over."""

    items: list[T]
    future: asyncio.Future[list[R]]


def _settle(future: asyncio.Future[R], result: R | BaseException) -> None:
    # A caller that gave up (its RPC was cancelled) has a done future: nothing to tell.
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _take(pending: deque[_Group[T, R]], limit: int) -> list[_Group[T, R]]:
    """Whole groups from the front of ``pending``, at most ``limit`` items (at least one
    group: callers never queue a group bigger than the limit)."""
    taken = [pending.popleft()]
    size = len(taken[0].items)
    while pending and size + len(pending[0].items) <= limit:
        group = pending.popleft()
        taken.append(group)
        size += len(group.items)
    return taken


def _chunks(items: Sequence[T], size: int) -> list[list[T]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


class EnqueueCommitter:
    """Commits enqueues with ``broker.enqueue_batch``, up to ``max_items`` to a transaction.

    When a batch is refused because of an item (DuplicateTask, InvalidTask), it is split
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
        self._pending: deque[_Group[NewTask, EnqueueOutcome]] = deque()
        self._queued = 0
        self._timer: asyncio.TimerHandle | None = None
        self._commits: set[asyncio.Task[None]] = set()
        self._flush_soon = False

    @property
    def queued(self) -> int:
        """Items waiting for a commit to start."""
        return self._queued

    async def enqueue(self, task: NewTask) -> EnqueueResult:
        """Store ``task`` (in a shared commit) and return it once committed."""
        [outcome] = await self.enqueue_many([task])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def enqueue_many(self, tasks: Sequence[NewTask]) -> list[EnqueueOutcome]:
        """Store ``tasks`` (each on its own, in shared commits) and return, per task, its
        result or the error that kept it out."""
        if not tasks:
            return []
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[list[EnqueueOutcome]]] = []
        for chunk in _chunks(tasks, self._max_items):
            future: asyncio.Future[list[EnqueueOutcome]] = loop.create_future()
            self._pending.append(_Group(chunk, future))
            self._queued += len(chunk)
            futures.append(future)
        if not self._commits or self._queued >= self._max_items:
            # Nothing in flight: go now (after this loop turn, which lets callers of the
            # same turn join). A full batch goes now too, beside the one in flight.
            if not self._flush_soon:
                self._flush_soon = True
                loop.call_soon(self._flush)
        elif self._timer is None:
            self._timer = loop.call_later(self._window, self._flush)
        outcomes: list[EnqueueOutcome] = []
        for future in futures:
            outcomes += await future
        return outcomes

    def _flush(self) -> None:
        self._flush_soon = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        loop = asyncio.get_running_loop()
        while self._pending:
            groups = _take(self._pending, self._max_items)
            self._queued -= sum(len(g.items) for g in groups)
            task = loop.create_task(self._commit_groups(groups))
            self._commits.add(task)
            task.add_done_callback(self._committed_one)

    def _committed_one(self, task: asyncio.Task[None]) -> None:
        self._commits.discard(task)
        # What gathered behind the commit goes now.
        if self._pending and not self._flush_soon:
            self._flush()

    async def _commit_groups(self, groups: list[_Group[NewTask, EnqueueOutcome]]) -> None:
        outcomes = await self._commit([item for group in groups for item in group.items])
        start = 0
        for group in groups:
            end = start + len(group.items)
            _settle(group.future, outcomes[start:end])
            start = end

    async def _commit(self, items: list[NewTask]) -> list[EnqueueOutcome]:
        try:
            results = await self._broker.enqueue_batch(items)
        except (DuplicateTask, InvalidTask) as exc:
            if len(items) == 1:
                return [exc]
            # One item spoiled the batch for everyone. Committing the halves in order
            # gives every caller the answer it would have had alone (an earlier item
            # wins a unique key over a later one), in O(bad items * log n) transactions
            # rather than one per item.
            logger.debug("enqueue.group_commit_split items=%d reason=%s", len(items), exc)
            middle = len(items) // 2
            return [*await self._commit(items[:middle]), *await self._commit(items[middle:])]
        except Exception as exc:
            return [exc] * len(items)
        metrics.record_enqueued(results)
        self._committed(results)
        return list(results)

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
        self._pending: deque[_Group[AckItem, bool]] = deque()
        self._runner: asyncio.Task[None] | None = None

    async def ack(self, item: AckItem) -> bool:
        """Ack one delivery; False when its lease was lost (nothing changed)."""
        [acked] = await self.ack_many([item])
        return acked

    async def ack_many(self, items: Sequence[AckItem]) -> list[bool]:
        """Ack deliveries; per item, False when its lease was lost (nothing changed)."""
        if not items:
            return []
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[list[bool]]] = []
        for chunk in _chunks(items, MAX_BATCH):
            future: asyncio.Future[list[bool]] = loop.create_future()
            self._pending.append(_Group(chunk, future))
            futures.append(future)
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run())
        acked: list[bool] = []
        for future in futures:
            acked += await future
        return acked

    async def _run(self) -> None:
        # One yield collects every ack of this loop turn into the first batch.
        await asyncio.sleep(0)
        while self._pending:
            groups = _take(self._pending, MAX_BATCH)
            try:
                results = await self._broker.ack_batch(
                    [item for group in groups for item in group.items]
                )
            except Exception as exc:
                for group in groups:
                    _settle(group.future, exc)
                continue
            start = 0
            for group in groups:
                end = start + len(group.items)
                _settle(group.future, results[start:end])
                start = end

    async def aclose(self) -> None:
        """Wait for the acks in progress."""
        if self._runner is not None:
            await asyncio.gather(self._runner, return_exceptions=True)
