"""Coalesced NATS hints: wakes per queue, Done credit refills per gateway, and Resolve for
the ends of tasks that others wait for.

All are hints (losing one delays work, never loses it), so bursts collapse into as few
messages as possible: at most one Wake per queue is pending at a time, completions of one
loop turn add up into one Done per queue, and the ends of one loop turn into one Resolve.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import heapq
import logging
import math
from collections import Counter
from datetime import datetime

from conveyor_broker import Broker, DependencySink, Resolution, Task, TaskState
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus

logger = logging.getLogger(__name__)


class _Coalescer(abc.ABC):
    """Runs ``_drain`` soon after the first ``_schedule`` and again while work piles up."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    def _schedule(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        # A new task first runs on the loop's next turn, so every caller of the turn that
        # scheduled it has joined by then; publishing at once keeps the wake ahead of the
        # work that resumes with the commit (answering the producer, say).
        while self._has_pending():
            try:
                await self._drain()
            except Exception:
                logger.exception("hints.publish_failed")

    @abc.abstractmethod
    def _has_pending(self) -> bool: ...

    @abc.abstractmethod
    async def _drain(self) -> None: ...

    async def aclose(self) -> None:
        """Publish what is pending, then stop."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class WakePublisher(_Coalescer):
    """Publishes ``Wake`` and promote hints on the ``bus``, at most one pending per queue.

    ``wake_later`` wakes a queue when work in it becomes due (a retry after its backoff),
    so the retry starts on time instead of at the reaper's next due-queue sweep; likewise
    ``promote_later`` sends the scheduler a promote hint when a scheduled task falls due,
    so it starts on time instead of at the scheduler's next tick. Those timers live in
    this process only: if it dies, the sweeps still find the work.
    """

    #: The target of a later promote hint in the timer table (no queue has this name).
    PROMOTE = ""

    #: Later wakes are rounded up to this many seconds, so a burst of retries due at
    #: about the same time shares one timer and one Wake.
    LATER_TICK = 0.01
    #: Most distinct (queue, tick) later wakes held; past it they are dropped (the
    #: reaper's sweep wakes those queues).
    MAX_LATER = 10_000
    #: Most promote hints held (their own share of MAX_LATER, so a stream of delayed tasks
    #: cannot crowd out retries' wakes); past it the scheduler's own tick finds them.
    MAX_LATER_PROMOTES = 1_000
    #: Later wakes further ahead than this many seconds are not held: the reaper's sweep
    #: wakes those queues at most a reap tick late, which is nothing next to the delay,
    #: and long backoffs would otherwise fill the table the short ones need.
    LATER_HORIZON = 300.0

    def __init__(self, bus: Bus) -> None:
        super().__init__()
        self._bus = bus
        self._pending: set[str] = set()
        self._promote = False
        # Later wakes: a heap of (tick, queue or PROMOTE), the same pairs as a set, and
        # one loop timer for the earliest.
        self._later: list[tuple[int, str]] = []
        self._later_keys: set[tuple[int, str]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_tick: int | None = None
        self._later_promotes = 0

    def wake(self, queue: str) -> None:
        """Ask for a Wake of ``queue``; a no-op when one is already pending."""
        if queue not in self._pending:
            self._pending.add(queue)
            self._schedule()

    def wake_later(self, queue: str, delay: float) -> None:
        """Ask for a Wake of ``queue`` in ``delay`` seconds (at once when <= 0)."""
        self._later_hint(queue, delay)

    def promote(self) -> None:
        """Send the scheduler a promote hint; a no-op when one is already pending."""
        if not self._promote:
            self._promote = True
            self._schedule()

    def promote_later(self, delay: float) -> None:
        """Send the scheduler a promote hint in ``delay`` seconds (at once when <= 0)."""
        self._later_hint(self.PROMOTE, delay)

    def when_due(self, task: Task, now: datetime) -> None:
        """Hint whoever acts when ``task`` becomes due: its queue's dispatcher for a
        PENDING task (now) or a RETRY (when its retry is due), the scheduler for a
        SCHEDULED one (when it is due). Nothing for tasks in any other state."""
        if task.state is TaskState.PENDING:
            self.wake(task.queue)
        elif task.state is TaskState.RETRY:
            self.wake_later(task.queue, (task.available_at - now).total_seconds())
        elif task.state is TaskState.SCHEDULED:
            self.promote_later((task.available_at - now).total_seconds())

    def _now_hint(self, target: str) -> None:
        if target == self.PROMOTE:
            self.promote()
        else:
            self.wake(target)

    def _later_hint(self, target: str, delay: float) -> None:
        if delay <= 0:
            self._now_hint(target)
            return
        if delay > self.LATER_HORIZON:
            return
        loop = asyncio.get_running_loop()
        tick = math.ceil((loop.time() + delay) / self.LATER_TICK)
        key = (tick, target)
        if key in self._later_keys:
            return
        promote = target == self.PROMOTE
        full = len(self._later_keys) >= self.MAX_LATER or (
            promote and self._later_promotes >= self.MAX_LATER_PROMOTES
        )
        if full:
            logger.debug("hints.later_hint_dropped target=%r", target)
            return
        self._later_keys.add(key)
        self._later_promotes += promote
        heapq.heappush(self._later, key)
        self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._later:
            return
        first = self._later[0][0]
        if self._timer is not None and self._timer_tick is not None:
            if self._timer_tick <= first:
                return
            self._timer.cancel()
        self._timer_tick = first
        self._timer = loop.call_at(first * self.LATER_TICK, self._fire)

    def _fire(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = self._timer_tick = None
        now = loop.time()
        while self._later and self._later[0][0] * self.LATER_TICK <= now:
            key = heapq.heappop(self._later)
            self._later_keys.discard(key)
            self._later_promotes -= key[1] == self.PROMOTE
            self._now_hint(key[1])
        self._arm(loop)

    async def aclose(self) -> None:
        """Drop the later wakes, publish what is pending, then stop."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_tick = None
        self._later.clear()
        self._later_keys.clear()
        self._later_promotes = 0
        await super().aclose()

    @property
    def later_pending(self) -> int:
        """Later wakes and promote hints not yet due."""
        return len(self._later)

    def _has_pending(self) -> bool:
        return bool(self._pending) or self._promote

    async def _drain(self) -> None:
        queues = sorted(self._pending)
        self._pending.clear()
        promote, self._promote = self._promote, False
        publish = self._bus.publish
        for queue in queues:
            await publish(cluster_pb2.Wake(queue=queue))
        if promote:
            await self._bus.publish_promote()


class DonePublisher(_Coalescer):
    """Publishes ``Done{gateway, queue, n, returned}`` on the ``bus``, summed per queue,
    with the running total of slots given back on that queue (which the gateway also puts
    in its dispatch replies and registrations, so the dispatcher can tell which Dones a
    reply already accounts for)."""

    def __init__(self, bus: Bus, gateway: str) -> None:
        super().__init__()
        self._bus = bus
        self._gateway = gateway
        self._pending: Counter[str] = Counter()
        self._returned: Counter[str] = Counter()

    def done(self, queue: str, n: int = 1) -> None:
        """Report ``n`` freed slots on ``queue``."""
        if n > 0:
            self._pending[queue] += n
            self._returned[queue] += n
            self._schedule()

    def returned(self, queue: str) -> int:
        """Slots given back on ``queue`` so far (published or about to be)."""
        return self._returned[queue]

    def _has_pending(self) -> bool:
        return bool(self._pending)

    async def _drain(self) -> None:
        # The totals as of this snapshot, so each Done's n and total agree.
        pending = {queue: (n, self._returned[queue]) for queue, n in self._pending.items()}
        self._pending.clear()
        publish, gateway = self._bus.publish, self._gateway
        for queue, (n, returned) in sorted(pending.items()):
            await publish(cluster_pb2.Done(gateway=gateway, queue=queue, n=n, returned=returned))


class ResolvePublisher(_Coalescer):
    """A process's dependency sink (:meth:`conveyor_broker.Broker.set_dependency_sink`):
    the ends of tasks that others wait for go to the resolver as ``Resolve`` messages on
    the ``bus`` (the ids of one loop turn together, at most :attr:`MAX_IDS` to a message),
    and queues a resolution promoted tasks into are woken through ``wakes``.

    Nothing here waits: the broker calls it right after its commit, and it only takes
    note. A Resolve that is lost (this process dies first, NATS drops it) delays the
    dependents until the maintenance sweep finds the end, never more.
    """

    #: Most task ids in one Resolve (26 bytes each: about 27 KiB).
    MAX_IDS = 1000

    def __init__(self, bus: Bus, wakes: WakePublisher) -> None:
        super().__init__()
        self._bus = bus
        self._wakes = wakes
        self._pending: dict[str, None] = {}
        self._previous: dict[int, DependencySink | None] = {}
        #: Task ids published so far (for metrics and tests).
        self.published = 0

    def __call__(self, resolution: Resolution) -> None:
        for queue in resolution.promoted:
            self._wakes.wake(queue)
        if resolution.pending:
            self._pending.update(dict.fromkeys(resolution.pending))
            self._schedule()

    def attach(self, broker: Broker) -> None:
        """Become ``broker``'s dependency sink (several services of one process may share
        a broker: :meth:`detach` puts back the sink that was there before)."""
        self._previous[id(broker)] = broker.dependency_sink
        broker.set_dependency_sink(self)

    def detach(self, broker: Broker) -> None:
        """Stop being ``broker``'s dependency sink, if it still is."""
        previous = self._previous.pop(id(broker), None)
        if broker.dependency_sink is self:
            broker.set_dependency_sink(previous)

    def _has_pending(self) -> bool:
        return bool(self._pending)

    async def _drain(self) -> None:
        ids = list(self._pending)
        self._pending.clear()
        for start in range(0, len(ids), self.MAX_IDS):
            chunk = ids[start : start + self.MAX_IDS]
            await self._bus.publish(cluster_pb2.Resolve(task_ids=chunk))
            self.published += len(chunk)
