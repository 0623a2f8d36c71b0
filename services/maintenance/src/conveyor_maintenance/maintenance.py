"""Maintenance: the scheduler, the reaper, the dependency resolver and storage upkeep,
each a leader-elected cluster singleton.

Every instance runs every role loop; only the holder of a role's key in the leaders
bucket runs its passes, the others try to claim the key every ``leader_ttl / 2``. A pass
that fails is logged and the next tick tries again: the sweeps are backstops, so a
skipped one only delays work.

- scheduler, every ``promote_tick`` and at once on a promote hint (which the api sends
  when a scheduled task it stored falls due): SCHEDULED tasks that are due become
  PENDING, and their queues are woken.
- reaper, every ``reap_tick``: expired leases go back to RETRY (their queues are woken),
  pre-dispatch TTLs are enforced, old terminal rows are purged, ended tasks whose
  dependents were left unresolved for ``resolve_sweep_age`` are resolved (a lost
  Resolve, a resolver that died mid-cascade), and every queue with due work is woken,
  which repairs any wake that was lost on the way.
- resolver, as ``Resolve`` messages arrive: the dependents of ended tasks are promoted,
  canceled or left blocked, and promoted queues woken (see
  :mod:`conveyor_maintenance.resolver`).
- storage, every ``storage_tick`` (unless ``storage_upkeep`` is off): the broker's
  storage upkeep (for Postgres, an ANALYZE or VACUUM of the task table when a burst has
  left its statistics or indexes behind). Its own role and loop, so a long VACUUM never
  holds up the reaper.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from conveyor_broker.clock import Clock, SystemClock
from conveyor_broker.interface import MAX_BATCH, Broker
from conveyor_broker.types import (
    LeaseReapParams,
    Resolution,
    StorageUpkeep,
    TaskState,
    TerminalPurgeParams,
)
from conveyor_broker.validation import QUEUE_RE
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.cluster_key import ClusterAuth
from conveyor_runtime.ownership import LeaseKeeper, open_lease_bucket
from conveyor_runtime.settings import MaintenanceSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.tasks import cancel_and_wait
from conveyor_runtime.tracing import tracer
from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from conveyor_maintenance.resolver import DependencyResolver

logger = logging.getLogger(__name__)
_tracer = tracer(__name__)

SCHEDULER = "scheduler"
REAPER = "reaper"
STORAGE = "storage"
#: Most promote rounds in one scheduler pass (each takes up to sweep_limit tasks).
MAX_PROMOTE_ROUNDS = 10
#: Least seconds between the end of one scheduler pass and a pass a promote hint asks for.
HINT_GAP = 0.05
#: Most resolution calls in one reaper pass (each settles up to sweep_limit edges).
MAX_RESOLVE_ROUNDS = 10


@dataclass(frozen=True, slots=True)
class ReaperReport:
    """What one reaper pass did."""

    reaped: int = 0
    archived: int = 0
    purged: int = 0
    #: Dependency edges the sweep settled (ends the resolver had not resolved).
    resolved: int = 0
    woken: frozenset[str] = field(default_factory=frozenset)
    failed_steps: tuple[str, ...] = ()


class Maintenance:
    """The scheduler, reaper and storage roles of one maintenance instance."""

    def __init__(
        self,
        settings: MaintenanceSettings,
        broker: Broker,
        nc: NatsClient,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        self.instance_id = settings.instance_id
        self.subjects = Subjects(settings.subject_prefix)
        self.bus = Bus(nc, self.subjects, ClusterAuth.from_settings(settings))
        self._broker = broker
        self._nc = nc
        # The broker takes "now" from this clock; tick timers are process-local.
        self.clock = clock or SystemClock()
        # Brokers take at most MAX_BATCH rows per sweep call.
        self._limit = min(settings.sweep_limit, MAX_BATCH)
        self._keeper: LeaseKeeper | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._promote_hint = asyncio.Event()
        self._hint_sub: Subscription | None = None
        self.passes: dict[str, int] = {SCHEDULER: 0, REAPER: 0, STORAGE: 0}
        self.resolver = DependencyResolver(
            broker,
            self.bus,
            limit=self._limit,
            wake=self.wake,
            retry=settings.leader_ttl / 2,
        )
        self._background: set[asyncio.Task[None]] = set()

    # -------------------------------------------------------------- lifecycle

    def leads(self, role: str) -> bool:
        """True while this instance holds ``role`` (scheduler, reaper, resolver or
        storage)."""
        return self._keeper is not None and self._keeper.holds(role)

    async def start(self) -> None:
        """Open the leaders bucket and start the role loops."""
        if self._keeper is not None:
            return
        kv = await open_lease_bucket(
            self._nc, self.subjects.leaders_bucket, self.settings.leader_ttl
        )
        self._keeper = LeaseKeeper(kv, self.instance_id, self.settings.leader_ttl, self._on_lost)
        await self._keeper.start()
        self._hint_sub = await self.bus.subscribe_promote(self._promote_hint.set)
        # The ends this process makes (reaped leases, expired tasks) go to the resolver.
        self._broker.set_dependency_sink(self._on_dependency_work)
        self._loops = [
            asyncio.create_task(
                self._lead(
                    SCHEDULER,
                    self.settings.promote_tick,
                    self.scheduler_pass,
                    hint=self._promote_hint,
                ),
                name="maintenance-scheduler",
            ),
            asyncio.create_task(
                self._lead(REAPER, self.settings.reap_tick, self.reaper_pass),
                name="maintenance-reaper",
            ),
            asyncio.create_task(self.resolver.run(self._keeper), name="maintenance-resolver"),
        ]
        if self.settings.storage_upkeep:
            self._loops.append(
                asyncio.create_task(
                    self._lead(STORAGE, self.settings.storage_tick, self.storage_pass),
                    name="maintenance-storage",
                )
            )
        logger.info("maintenance.started instance=%s", self.instance_id)

    async def stop(self) -> None:
        """Stop the loops and give up any role held, so another instance takes over now."""
        if self._hint_sub is not None:
            with contextlib.suppress(Exception):
                await self._hint_sub.unsubscribe()
            self._hint_sub = None
        await cancel_and_wait(self._loops)
        self._loops = []
        if self._broker.dependency_sink == self._on_dependency_work:
            self._broker.set_dependency_sink(None)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._keeper is not None:
            await self._keeper.stop(release=True)
            self._keeper = None
        logger.info("maintenance.stopped instance=%s", self.instance_id)

    def _on_dependency_work(self, resolution: Resolution) -> None:
        # Called by the broker after a commit: take note, never wait.
        self.resolver.heard(resolution.pending)
        if resolution.promoted:
            task = asyncio.get_running_loop().create_task(self.wake(resolution.promoted))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _on_lost(self, role: str) -> None:
        logger.warning("maintenance.leadership_lost role=%s instance=%s", role, self.instance_id)

    async def _lead(
        self,
        role: str,
        tick: float,
        run_pass: Callable[[], Awaitable[object]],
        *,
        hint: asyncio.Event | None = None,
    ) -> None:
        """Run ``role``'s passes every ``tick`` while leading it (and at once when
        ``hint`` is set), claiming it meanwhile whenever it is free."""
        retry = self.settings.leader_ttl / 2
        while True:
            keeper = self._keeper
            if keeper is None:
                return
            if not keeper.holds(role):
                try:
                    elected = await keeper.claim(role)
                except Exception:
                    logger.exception("maintenance.claim_failed role=%s", role)
                    elected = False
                if not elected:
                    if hint is not None:
                        hint.clear()  # the leader acts on it, not us
                    await asyncio.sleep(retry)
                    continue
                logger.info(
                    "maintenance.leader_elected role=%s instance=%s", role, self.instance_id
                )
            try:
                with _tracer.start_as_current_span(f"maintenance.{role}"):
                    await run_pass()
                self.passes[role] += 1
            except Exception:
                logger.exception("maintenance.pass_failed role=%s", role)
            await _rest(tick, hint)

    # ---------------------------------------------------------------- passes

    async def wake(self, queues: Iterable[str]) -> None:
        """Publish a Wake for each queue. A stored name that is not a valid queue name (one
        stored before names were matched whole, like "0\\n") is skipped and logged: it is
        no subject token, and publishing it would spoil the wakes of every queue after
        it."""
        for queue in queues:
            if not QUEUE_RE.fullmatch(queue):
                logger.warning("maintenance.invalid_queue_name_skipped queue=%r", queue)
                continue
            await self.bus.publish(cluster_pb2.Wake(queue=queue))

    async def scheduler_pass(self) -> dict[str, int]:
        """Promote due SCHEDULED tasks and wake their queues; tasks promoted per queue."""
        limit = self._limit
        total: dict[str, int] = {}
        for _ in range(MAX_PROMOTE_ROUNDS):
            promoted = await self._broker.promote_scheduled(limit=limit)
            for queue, n in promoted.items():
                total[queue] = total.get(queue, 0) + n
            await self.wake(promoted)
            if sum(promoted.values()) < limit:
                break
        if total:
            logger.info("maintenance.promoted tasks=%d queues=%d", sum(total.values()), len(total))
        return total

    async def storage_pass(self) -> StorageUpkeep:
        """The broker's storage upkeep (see Broker.upkeep_storage)."""
        done = await self._broker.upkeep_storage()
        if done.analyzed or done.vacuumed:
            logger.info(
                "maintenance.storage analyzed=%s vacuumed=%s live=%s dead=%s changed=%s",
                done.analyzed,
                done.vacuumed,
                done.live_rows,
                done.dead_rows,
                done.changed_rows,
            )
        return done

    async def reaper_pass(self) -> ReaperReport:
        """Reap expired leases, archive expired tasks, purge old rows, wake due queues.

        Each step runs even when an earlier one failed; failures are logged and named in
        the report.
        """
        limit = self._limit
        failed: list[str] = []
        to_wake: set[str] = set()
        reaped = archived = purged = resolved = 0

        async def step(name: str, call: Callable[[], Awaitable[None]]) -> None:
            try:
                await call()
            except Exception:
                failed.append(name)
                logger.exception("maintenance.step_failed step=%s", name)

        async def reap() -> None:
            nonlocal reaped
            tasks = await self._broker.reap_expired_leases(LeaseReapParams(limit=limit))
            reaped = len(tasks)
            to_wake.update(t.queue for t in tasks if t.state == TaskState.RETRY)

        async def archive_expired() -> None:
            nonlocal archived
            archived = len(await self._broker.archive_expired(limit=limit))

        async def purge() -> None:
            nonlocal purged
            purged = await self._broker.purge_terminal(
                TerminalPurgeParams(
                    archive_retention=timedelta(seconds=self.settings.archive_retention),
                    default_retention=timedelta(seconds=self.settings.default_retention),
                    limit=limit,
                )
            )

        async def resolve_missed() -> None:
            # Ends the resolver left (a lost Resolve, a leader that died mid-cascade):
            # found from an index, settled a bounded number of edges at a time.
            nonlocal resolved
            done = await self._broker.promote_ready_dependents(
                limit, min_age=timedelta(seconds=self.settings.resolve_sweep_age)
            )
            for _ in range(MAX_RESOLVE_ROUNDS):
                resolved += done.edges
                to_wake.update(done.promoted)
                if not done.pending:
                    return
                done = await self._broker.resolve_dependents(done.pending[:MAX_BATCH], limit)
            # More than a pass's share: the resolver (or the next pass) goes on with it.
            self.resolver.heard(done.pending)

        async def sweep_pending() -> None:
            # Which queues have due work, a page of names at a time: the broker finds them
            # without counting their tasks, so a pass costs the same with a million due.
            after: str | None = None
            while True:
                page = await self._broker.due_queues(after=after, limit=limit)
                to_wake.update(page)
                if len(page) < limit:
                    return
                after = page[-1]

        await step("reap", reap)
        await step("archive_expired", archive_expired)
        await step("resolve_missed", resolve_missed)
        await step("purge", purge)
        await step("pending_sweep", sweep_pending)
        await step("wake", lambda: self.wake(sorted(to_wake)))
        report = ReaperReport(
            reaped=reaped,
            archived=archived,
            purged=purged,
            resolved=resolved,
            woken=frozenset(to_wake),
            failed_steps=tuple(failed),
        )
        if reaped or archived or purged or resolved:
            logger.info(
                "maintenance.reaped reaped=%d archived=%d purged=%d resolved=%d woken=%d",
                reaped,
                archived,
                purged,
                resolved,
                len(to_wake),
            )
        return report


async def _rest(tick: float, hint: asyncio.Event | None) -> None:
    """Wait ``tick`` seconds, or less when ``hint`` is set (which it clears), but at least
    HINT_GAP: a stream of hints (an api process sends up to one per 10 ms) must not turn
    into a stream of passes."""
    if hint is None:
        await asyncio.sleep(tick)
        return
    loop = asyncio.get_running_loop()
    began = loop.time()
    # asyncio.timeout, not wait_for: on Python 3.11 a cancellation that lands as
    # wait_for times out can come out as its TimeoutError, and be swallowed here.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(tick):
            await hint.wait()
    waited = loop.time() - began
    if waited < HINT_GAP:
        await asyncio.sleep(HINT_GAP - waited)
    hint.clear()
