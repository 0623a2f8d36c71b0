"""Maintenance: the scheduler, the reaper, the dependency resolver and storage upkeep,
each a leader-elected cluster singleton.

Every instance runs every role loop; only the holder of a role's key in the leaders
bucket runs its passes, the others try to claim the key every ``leader_ttl / 2``. A pass
that fails is logged and the next tick tries again: the sweeps are backstops, so a
skipped one only delays work.

- scheduler, every ``promote_tick`` and at once on a promote hint (which the api sends
  when a scheduled task it stored falls due): SCHEDULED tasks that are due become
  PENDING, and their queues are woken; then every cron entry whose next run has come
  fires (see :meth:`Maintenance.cron_pass`).
- reaper, every ``reap_tick``: the tasks held by dead api processes are released (a
  *holder* silent for ``holder_silence`` both in the broker and on NATS: see
  :mod:`conveyor_gateway.liveness`), expired leases go back to RETRY (their queues are
  woken), pre-dispatch TTLs are enforced, old terminal rows are purged, ended tasks whose
  dependents were left unresolved for ``resolve_sweep_age`` are resolved (a lost
  Resolve, a resolver that died mid-cascade), and every queue with due work that some
  gateway serves is woken, which repairs any wake that was lost on the way. Which queues
  are served it learns from the gateways' registrations, as the dispatchers do
  (:class:`~conveyor_runtime.demand.Demand`): a queue nobody serves needs no wake (its
  work can go nowhere), and asking the broker about the served queues only keeps a
  pass's cost to the queues in use, however many others hold work. Every instance
  listens to the holders' NATS beats (the leader's successor knows who is alive), and an
  instance that has listened for less than ``holder_silence`` judges nobody. The same
  sweep gives the metrics each served queue's oldest due age (the broker's probe returns
  the due time it found), and every ``depth_tick`` the leader counts the served queues'
  tasks by state for the depth gauges; a leader that loses the role drops both.
- resolver, as ``Resolve`` messages arrive: the dependents of ended tasks are promoted,
  canceled or left blocked, and promoted queues woken (see
  :mod:`conveyor_maintenance.resolver`).
- groups, every ``group_tick``: the aggregation groups past their config's size, max
  delay or grace period (:meth:`~conveyor_broker.interface.Broker.due_groups`) are
  handed to their queues' dispatchers in one ``GroupsDue`` per queue; the owner leases
  each group whole and offers it to a worker as one batch. A hint: a group still due at
  the next pass is sent again.
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
from datetime import datetime, timedelta

from conveyor_broker.clock import Clock, SystemClock
from conveyor_broker.cron import CronSchedule, plan_fire, slot_text
from conveyor_broker.errors import InvalidTask
from conveyor_broker.interface import MAX_BATCH, Broker
from conveyor_broker.types import (
    CronEntry,
    CronFired,
    HolderReleaseParams,
    LeaseReapParams,
    Resolution,
    StorageUpkeep,
    TaskState,
    TerminalPurgeParams,
)
from conveyor_broker.validation import QUEUE_RE
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime import metrics
from conveyor_runtime.bus import Bus
from conveyor_runtime.cluster_key import ClusterAuth
from conveyor_runtime.cluster_view import NodeCard
from conveyor_runtime.demand import REGISTER_TICKS_TO_EXPIRE, Demand
from conveyor_runtime.health import Health
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
GROUPS = "groups"
#: Most promote rounds in one scheduler pass (each takes up to sweep_limit tasks).
MAX_PROMOTE_ROUNDS = 10
#: Least seconds between the end of one scheduler pass and a pass a promote hint asks for.
HINT_GAP = 0.05
#: Most resolution calls in one reaper pass (each settles up to sweep_limit edges).
MAX_RESOLVE_ROUNDS = 10

#: Most rounds of due cron entries in one scheduler pass: an entry some slots behind
#: fires one slot per round.
MAX_CRON_ROUNDS = 100


@dataclass(frozen=True, slots=True)
class CronReport:
    """What one cron pass did: tasks created, missed slots handled (per the entries'
    misfire policies), fires lost to another scheduler, and the queues woken."""

    fired: int = 0
    misfired: int = 0
    raced: int = 0
    woken: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True, slots=True)
class ReaperReport:
    """What one reaper pass did."""

    reaped: int = 0
    #: Tasks released because their holder (an api process) died.
    released: int = 0
    archived: int = 0
    purged: int = 0
    #: Dependency edges the sweep settled (ends the resolver had not resolved).
    resolved: int = 0
    woken: frozenset[str] = field(default_factory=frozenset)
    #: Queues some gateway served, the ones whose due work the pass looked for.
    served: int = 0
    failed_steps: tuple[str, ...] = ()


class Maintenance:
    """The scheduler, reaper and storage roles of one maintenance instance."""

    def __init__(
        self,
        settings: MaintenanceSettings,
        broker: Broker,
        nc: NatsClient,
        clock: Clock | None = None,
        *,
        health: Health | None = None,
    ) -> None:
        """``health``: the process's signals (the leaders bucket reports to them)."""
        self.settings = settings
        self._health = health
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
        self._register_sub: Subscription | None = None
        #: The queues some gateway serves, from the registrations every instance hears
        #: (a standby too: it may lead the reaper next).
        self.demand = Demand(settings.register_tick * REGISTER_TICKS_TO_EXPIRE)
        self._beat_sub: Subscription | None = None
        #: Holder -> when its last NATS beat arrived (loop time); since when we listen.
        self._heard: dict[str, float] = {}
        self._listening_since: float | None = None
        self.passes: dict[str, int] = {SCHEDULER: 0, REAPER: 0, STORAGE: 0, GROUPS: 0}
        #: When the reaper leader last refreshed the queue depth gauges (loop time).
        self._depth_at = float("-inf")
        #: The queue labels whose depth and oldest due gauges this instance set.
        self._depth_labels: set[str] = set()
        self._due_labels: set[str] = set()
        self.resolver = DependencyResolver(
            broker,
            self.bus,
            limit=self._limit,
            wake=self.wake,
            retry=settings.leader_ttl / 2,
        )
        self._background: set[asyncio.Task[None]] = set()
        #: This instance in the cluster view: the roles it leads.
        self.card = NodeCard(
            self.bus, kind="maintenance", instance=settings.instance_id, fill=self._describe
        )

    # -------------------------------------------------------------- lifecycle

    def _describe(self, node: service_pb2.ClusterNode) -> None:
        if self._keeper is not None:
            node.leader_roles.extend(sorted(self._keeper.held))

    def leads(self, role: str) -> bool:
        """True while this instance holds ``role`` (scheduler, reaper, resolver or
        storage)."""
        return self._keeper is not None and self._keeper.holds(role)

    async def start(self) -> None:
        """Open the leaders bucket and start the role loops."""
        if self._keeper is not None:
            return
        kv = await open_lease_bucket(
            self._nc,
            self.subjects.leaders_bucket,
            self.settings.leader_ttl,
            replicas=self.settings.nats_replicas,
            health=self._health,
        )
        self._keeper = LeaseKeeper(kv, self.instance_id, self.settings.leader_ttl, self._on_lost)
        await self._keeper.start()
        self._hint_sub = await self.bus.subscribe_promote(self._promote_hint.set)
        self._register_sub = await self.bus.subscribe(cluster_pb2.Register, self._on_register)
        self._beat_sub = await self.bus.subscribe(cluster_pb2.HolderBeat, self._on_holder_beat)
        await self.card.start()
        await self._nc.flush()
        self._listening_since = self._now()
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
            asyncio.create_task(
                self._lead(GROUPS, self.settings.group_tick, self.group_pass),
                name="maintenance-groups",
            ),
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
        await self.card.stop()
        for sub in (self._hint_sub, self._register_sub, self._beat_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._hint_sub = self._register_sub = self._beat_sub = None
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

    def _on_register(self, reg: cluster_pb2.Register) -> None:
        # Only names that can be asked about (a sealed message carries a valid one anyway).
        if reg.gateway and QUEUE_RE.fullmatch(reg.queue):
            now = asyncio.get_running_loop().time()
            self.demand.heard(reg.queue, reg.gateway, closing=reg.closing, now=now)

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _on_holder_beat(self, beat: cluster_pb2.HolderBeat) -> None:
        if beat.holder:
            self._heard[beat.holder] = self._now()

    def alive_holders(self) -> frozenset[str] | None:
        """The holders heard on NATS within ``holder_silence`` (the others are forgotten
        here); None while this instance has listened for less than that, when silence
        proves nothing."""
        silence = self.settings.holder_silence
        now = self._now()
        if self._listening_since is None or now - self._listening_since < silence:
            return None
        for holder, at in list(self._heard.items()):
            if now - at >= silence:
                del self._heard[holder]
        return frozenset(self._heard)

    def _on_dependency_work(self, resolution: Resolution) -> None:
        # Called by the broker after a commit: take note, never wait.
        self.resolver.heard(resolution.pending)
        if resolution.promoted:
            task = asyncio.get_running_loop().create_task(self.wake(resolution.promoted))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _on_lost(self, role: str) -> None:
        metrics.LEADERSHIP.labels(role, "lost").inc()
        logger.warning("maintenance.leadership_lost role=%s instance=%s", role, self.instance_id)
        if role == REAPER:
            self.drop_queue_gauges()

    def drop_queue_gauges(self) -> None:
        """Drop the queue depth and oldest due gauges this instance set: they are the new
        reaper leader's to report (stale ones here would stand beside its fresh ones)."""
        for label in self._due_labels:
            with contextlib.suppress(KeyError):
                metrics.QUEUE_OLDEST_DUE.remove(label)
        self._due_labels = set()
        self._depth_labels = set()
        metrics.QUEUE_DEPTH.clear()
        self._depth_at = float("-inf")

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
                metrics.LEADERSHIP.labels(role, "won").inc()
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
        try:
            await self.cron_pass()
        except Exception:
            # The promotions above are done; the next pass fires what is due.
            logger.exception("maintenance.cron_failed")
        return total

    async def cron_pass(self) -> CronReport:
        """Fire every cron entry whose next run has come, and wake the queues that got a
        task.

        Each fire is the broker's compare-and-set of the entry's next run together with
        the slot's task (:meth:`Broker.fire_cron_entry`): a scheduler that lost the race
        (a former leader still running a pass) changes nothing, and a slot's task id
        is derived from the entry and the slot, so no slot ever runs twice. A slot at
        most ``cron_misfire_grace`` late fires as usual, one slot per round, so a
        scheduler a few slots behind catches up slot by slot; a later one was missed and
        the entry's misfire policy applies (one task for the missed slots, or none).
        """
        grace = timedelta(seconds=self.settings.cron_misfire_grace)
        limit = min(self._limit, 100)
        fired = misfired = raced = 0
        to_wake: set[str] = set()
        for _ in range(MAX_CRON_ROUNDS):
            due = await self._broker.list_due_cron_entries(limit=limit)
            for entry in due:
                result, missed = await self._fire(entry, grace)
                if not result.applied:
                    raced += 1
                    continue
                misfired += missed
                if result.task is not None and result.task.created:
                    fired += 1
                    to_wake.add(result.task.task.queue)
            if not due:
                break
        await self.wake(sorted(to_wake))
        if fired or misfired or raced:
            logger.info("maintenance.cron fired=%d misfired=%d raced=%d", fired, misfired, raced)
        return CronReport(fired, misfired, raced, frozenset(to_wake))

    async def _fire(self, entry: CronEntry, grace: timedelta) -> tuple[CronFired, bool]:
        """Fire ``entry``'s due slot; the broker's answer, and whether slots were missed."""
        expected = entry.next_run_at
        assert expected is not None  # a due entry has a next run
        now = self.clock.now()
        try:
            schedule = CronSchedule.parse(entry.schedule, entry.timezone)
        except InvalidTask:
            # Stored by a release that read it differently: stop it rather than retry
            # every tick. An operator's upsert sets it going again.
            logger.error(
                "cron.schedule_unreadable entry=%s schedule=%r", entry.name, entry.schedule
            )
            return await self._broker.fire_cron_entry(entry.name, expected, None, None), False
        plan = plan_fire(schedule, expected, now, entry.misfire, grace)
        if plan.missed:
            logger.warning(
                "cron.misfired entry=%s policy=%s first_missed=%s resumes=%s",
                entry.name,
                entry.misfire.value,
                slot_text(expected),
                "never" if plan.next_run_at is None else slot_text(plan.next_run_at),
            )
        if plan.next_run_at is None:
            logger.warning("cron.never_fires_again entry=%s", entry.name)
        try:
            result = await self._broker.fire_cron_entry(
                entry.name, expected, plan.next_run_at, plan.slot
            )
        except InvalidTask as exc:
            # The template makes no valid task any more (the payload limit was lowered):
            # the slot is lost, the schedule goes on.
            logger.error("cron.slot_refused entry=%s error=%s", entry.name, exc)
            result = await self._broker.fire_cron_entry(
                entry.name, expected, plan.next_run_at, None
            )
        return result, plan.missed

    async def group_pass(self) -> dict[str, int]:
        """Hand every due aggregation group to its queue's dispatcher (a ``GroupsDue`` per
        queue); the due groups per queue."""
        due = await self._broker.due_groups(self._limit)
        by_queue: dict[str, list[cluster_pb2.DueGroupHint]] = {}
        for group in due:
            by_queue.setdefault(group.queue, []).append(
                cluster_pb2.DueGroupHint(
                    group=group.group, size=group.size, max_size=group.max_size
                )
            )
        for queue, hints in by_queue.items():
            if not QUEUE_RE.fullmatch(queue):
                logger.warning("maintenance.invalid_queue_name_skipped queue=%r", queue)
                continue
            await self.bus.publish(cluster_pb2.GroupsDue(queue=queue, groups=hints))
        return {queue: len(hints) for queue, hints in by_queue.items()}

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
        """Reap expired leases, archive expired tasks, purge old rows, wake the served
        queues that have due work.

        Each step runs even when an earlier one failed; failures are logged and named in
        the report.
        """
        limit = self._limit
        failed: list[str] = []
        to_wake: set[str] = set()
        reaped = released = archived = purged = resolved = 0
        now = asyncio.get_running_loop().time()
        self.demand.expire(now)
        served = self.demand.queues(now)

        async def step(name: str, call: Callable[[], Awaitable[None]]) -> None:
            try:
                await call()
            except Exception:
                failed.append(name)
                logger.exception("maintenance.step_failed step=%s", name)

        async def release_dead_holders() -> None:
            nonlocal released
            alive = self.alive_holders()
            if alive is None:
                return
            tasks = await self._broker.release_dead_holders(
                HolderReleaseParams(
                    silence=timedelta(seconds=self.settings.holder_silence),
                    alive=alive,
                    limit=limit,
                )
            )
            released = len(tasks)
            to_wake.update(t.queue for t in tasks)
            for holder in sorted({t.holder for t in tasks}):
                logger.warning(
                    "maintenance.holder_dead holder=%s released=%d",
                    holder,
                    sum(1 for t in tasks if t.holder == holder),
                )

        async def reap() -> None:
            nonlocal reaped
            tasks = await self._broker.reap_expired_leases(LeaseReapParams(limit=limit))
            reaped = len(tasks)
            metrics.LEASES_EXPIRED.inc(reaped)
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
            # Which served queues have due work, a page of names at a time: one index
            # probe per name, so the pass costs the same with a million tasks due, or ten
            # thousand queues holding work that no worker serves. The probe's due time is
            # each queue's oldest due age, for the metrics.
            oldest: dict[str, datetime] = {}
            for start in range(0, len(served), limit):
                oldest.update(await self._broker.oldest_due(served[start : start + limit]))
            to_wake.update(oldest)
            self._set_oldest_due(served, oldest)

        await step("release_dead_holders", release_dead_holders)
        await step("reap", reap)
        await step("archive_expired", archive_expired)
        await step("resolve_missed", resolve_missed)
        await step("purge", purge)
        await step("pending_sweep", sweep_pending)
        await step("wake", lambda: self.wake(sorted(to_wake)))
        if now - self._depth_at >= self.settings.depth_tick:
            self._depth_at = now
            await step("depth", lambda: self.depth_pass(served))
        report = ReaperReport(
            reaped=reaped,
            released=released,
            archived=archived,
            purged=purged,
            resolved=resolved,
            woken=frozenset(to_wake),
            served=len(served),
            failed_steps=tuple(failed),
        )
        if reaped or released or archived or purged or resolved:
            logger.info(
                "maintenance.reaped reaped=%d released=%d archived=%d purged=%d resolved=%d "
                "woken=%d",
                reaped,
                released,
                archived,
                purged,
                resolved,
                len(to_wake),
            )
        return report

    async def depth_pass(self, served: Iterable[str]) -> None:
        """Set the queue depth gauges of the served queues (at most the label cap's
        worth): one ``queue_stats(queue)`` each, a count by state over that queue's
        index entries (its retained ended rows included). Run by the reaper leader every
        ``depth_tick`` seconds, so the cluster pays it once, never per scrape. The
        queues no longer served are dropped from the gauges."""
        labels: set[str] = set()
        for queue in sorted(served)[: metrics.LABEL_LIMIT]:
            for stats in await self._broker.queue_stats(queue):
                label = metrics.QUEUE(stats.queue)
                if label == metrics.OTHER:
                    continue  # no count of a label that stands for many queues
                labels.add(label)
                for state, n in stats.counts.items():
                    metrics.QUEUE_DEPTH.labels(label, state.value).set(n)
        for label in self._depth_labels - labels:
            for state in TaskState:
                with contextlib.suppress(KeyError):
                    metrics.QUEUE_DEPTH.remove(label, state.value)
        self._depth_labels = labels

    def _set_oldest_due(self, served: Iterable[str], oldest: dict[str, datetime]) -> None:
        """Set the oldest due gauge of every served queue from the sweep's due times (0:
        nothing due; the queues past the label cap as one ``other``, their oldest), and
        drop the queues no longer served."""
        now = self.clock.now()
        ages: dict[str, float] = {}
        for queue in served:
            label = metrics.QUEUE(queue)
            due = oldest.get(queue)
            age = max(0.0, (now - due).total_seconds()) if due is not None else 0.0
            ages[label] = max(ages.get(label, 0.0), age)
        for label, age in ages.items():
            metrics.QUEUE_OLDEST_DUE.labels(label).set(age)
        for label in self._due_labels - ages.keys():
            with contextlib.suppress(KeyError):
                metrics.QUEUE_OLDEST_DUE.remove(label)
        self._due_labels = set(ages)


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
