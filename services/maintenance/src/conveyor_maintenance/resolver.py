"""The dependency resolver: a leader-elected maintenance role that settles what the
dependents of ended tasks do, as the ends are announced.

Processes that end tasks (the api's gateways and admin actions, the webhook service, the
reaper) report, after each commit, the ended tasks that others wait for, as ``Resolve``
messages (:class:`conveyor_gateway.ResolvePublisher`). The leader alone subscribes to
them; it keeps a work list of ended task ids and resolves it in batches
(:meth:`conveyor_broker.Broker.resolve_dependents`: at most ``limit`` edges a call), the
ids that arrive while a call is in flight going together in the next. What a call leaves
(an ended task with more dependents than the limit, a task a cascade canceled that has
dependents of its own) goes back on the list, so a cascade runs a level per call, bounded
and resumable. Promotions wake their queues at once.

Everything here is a hint: a Resolve that never arrives, or a leader that dies with work
on its list, only delays the dependents until the reaper's sweep
(:meth:`conveyor_broker.Broker.promote_ready_dependents`) finds the ends it left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

from conveyor_broker.ids import is_ulid
from conveyor_broker.interface import MAX_BATCH, Broker
from conveyor_broker.types import Resolution
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.ownership import LeaseKeeper
from conveyor_runtime.tracing import tracer
from nats.aio.subscription import Subscription

logger = logging.getLogger(__name__)
_tracer = tracer(__name__)

RESOLVER = "resolver"
#: Most ended tasks one resolution call takes. A call's time grows with what it settles
#: (each ended task's flag, each dependent's counters), and an end heard meanwhile waits
#: for it: short calls keep that wait short (a fan-in's last parent promotes its child a
#: call after it completes, not a thousand parents later), and the ends that pile up meanwhile
#: still go together in the next.
CALL_IDS = 100
#: Seconds to wait before trying again after a resolution failed (the database down).
RETRY_FIRST = 0.1
RETRY_MAX = 2.0


class DependencyResolver:
    """The resolver role of one maintenance instance: ``run`` claims the role (through
    ``keeper``), subscribes to ``Resolve`` while it leads and resolves what it hears;
    ``wake`` publishes a Wake for each queue a resolution promoted tasks into."""

    def __init__(
        self,
        broker: Broker,
        bus: Bus,
        *,
        limit: int,
        wake: Callable[[Iterable[str]], Awaitable[None]],
        retry: float,
    ) -> None:
        self._broker = broker
        self._bus = bus
        self._limit = max(1, min(limit, MAX_BATCH))
        self._wake = wake
        self._retry = retry
        self._work: dict[str, None] = {}
        self._ready = asyncio.Event()
        self._sub: Subscription | None = None
        self._leading = False
        self._forwards: set[asyncio.Task[None]] = set()
        #: Resolution calls made and edges settled, for metrics and tests.
        self.calls = 0
        self.edges = 0

    @property
    def leading(self) -> bool:
        """True while this instance resolves (it holds the role and listens)."""
        return self._leading

    @property
    def backlog(self) -> int:
        """Ended tasks on the work list."""
        return len(self._work)

    def heard(self, task_ids: Iterable[str]) -> None:
        """Ended tasks whose dependents wait: resolved here when this instance leads,
        else sent to the leader (a Resolve)."""
        ids = list(task_ids)
        if not ids:
            return
        if self._leading:
            self._work.update(dict.fromkeys(ids))
            self._ready.set()
            return
        task = asyncio.get_running_loop().create_task(self._forward(ids))
        self._forwards.add(task)
        task.add_done_callback(self._forwards.discard)

    async def _forward(self, ids: list[str]) -> None:
        for start in range(0, len(ids), MAX_BATCH):
            try:
                await self._bus.publish(
                    cluster_pb2.Resolve(task_ids=ids[start : start + MAX_BATCH])
                )
            except Exception as exc:
                logger.warning("resolver.forward_failed count=%d error=%r", len(ids), exc)

    def _on_resolve(self, message: cluster_pb2.Resolve) -> None:
        if self._leading:
            # An id that is no ULID names no task, and the broker would refuse the whole
            # call it came in (again at every retry): only a broken sender makes one.
            self._work.update(dict.fromkeys(i for i in message.task_ids if is_ulid(i)))
            self._ready.set()

    async def run(self, keeper: LeaseKeeper) -> None:
        """Lead the role whenever it is free, resolving while leading; until cancelled."""
        try:
            while True:
                if not keeper.holds(RESOLVER):
                    await self._step_down()
                    try:
                        elected = await keeper.claim(RESOLVER)
                    except Exception:
                        logger.exception("maintenance.claim_failed role=%s", RESOLVER)
                        elected = False
                    if not elected:
                        await asyncio.sleep(self._retry)
                        continue
                    logger.info("maintenance.leader_elected role=%s", RESOLVER)
                    if not await self._step_up():
                        await asyncio.sleep(self._retry)
                        continue
                # Wake up now and then to notice a lost role even when nothing is heard.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._retry):
                        await self._ready.wait()
                self._ready.clear()
                if keeper.holds(RESOLVER):
                    await self._drain(keeper)
        finally:
            await self._step_down()
            if self._forwards:
                await asyncio.gather(*self._forwards, return_exceptions=True)

    async def _step_up(self) -> bool:
        try:
            self._sub = await self._bus.subscribe(cluster_pb2.Resolve, self._on_resolve)
        except Exception:
            logger.exception("resolver.subscribe_failed")
            return False
        self._leading = True
        return True

    async def _step_down(self) -> None:
        self._leading = False
        # What was on the list is the sweep's now (the new leader never heard of it).
        self._work.clear()
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection may be gone already
                logger.debug("resolver.unsubscribe_failed error=%r", exc)

    async def _drain(self, keeper: LeaseKeeper) -> None:
        """Resolve the work list until it is empty (or the role is lost)."""
        delay = RETRY_FIRST
        while self._work and keeper.holds(RESOLVER):
            ids = list(self._work)[:CALL_IDS]
            for task_id in ids:
                del self._work[task_id]
            try:
                with _tracer.start_as_current_span("maintenance.resolve"):
                    done = await self._broker.resolve_dependents(ids, self._limit)
            except Exception as exc:
                # Back on the list (ahead of what came meanwhile), and again shortly.
                self._work = {**dict.fromkeys(ids), **self._work}
                logger.warning(
                    "resolver.resolve_failed count=%d error=%r retrying in %.1fs",
                    len(ids),
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                continue
            delay = RETRY_FIRST
            self.calls += 1
            self.edges += done.edges
            await self._report(done)
            self._work.update(dict.fromkeys(done.pending))
            if self._work:
                await asyncio.sleep(0)  # let the Resolves that came meanwhile in

    async def _report(self, done: Resolution) -> None:
        if done.promoted:
            try:
                await self._wake(done.promoted)
            except Exception as exc:
                # The reaper's due-queue sweep wakes them.
                logger.warning("resolver.wake_failed error=%r", exc)
        if done.canceled:
            logger.info(
                "maintenance.cascade_canceled count=%d first=%s",
                len(done.canceled),
                done.canceled[0],
            )
