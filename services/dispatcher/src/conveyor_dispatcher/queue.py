"""QueueDispatcher: the dispatch loop of one owned queue.

Its state is rebuilt from the broker (the pause flag, the rate limit) and from gateway
registrations; it holds nothing durable: a rate-limited queue's tokens live in the broker,
so a new owner spends the same bucket as the last one (no fresh burst per failover). Events (wake, register, done, control) arrive from NATS callbacks
and only flip flags and counters; the one lease cycle at a time runs in its own task, so
a callback never waits on the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

import nats.errors
from conveyor_broker.clock import Clock, SystemClock
from conveyor_broker.errors import LeaseLost
from conveyor_broker.interface import MAX_BATCH, Broker
from conveyor_broker.types import Breaker, BreakerScope, BreakerStatus, RateLimit, Task
from conveyor_protos.v1 import cluster_pb2, task_pb2
from conveyor_runtime import metrics
from conveyor_runtime.bus import Bus
from conveyor_runtime.wire import task_to_envelope
from google.protobuf.message import DecodeError

from conveyor_dispatcher.credits import CreditBook
from conveyor_dispatcher.leases import LeaseBatcher
from conveyor_dispatcher.tracing import OfferSpans, lease_started

logger = logging.getLogger(__name__)

#: Seconds a cycle waits after a broker error before it retries (if anything asked it to).
ERROR_BACKOFF = 0.5
#: Seconds the task type a group's members had is trusted without a new lease.
GROUP_TYPE_TTL = 60.0


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """How a QueueDispatcher leases and dispatches."""

    instance_id: str
    batch_max: int
    lease_ttl: timedelta
    dispatch_timeout: float
    #: A registration not refreshed for this long is forgotten.
    register_ttl: float
    #: The queue is given up after this long with no registrations (and no work leased).
    idle_timeout: float
    #: A lease cycle stuck in one round (lease, dispatch, release) for this long makes
    #: the instance give the queue up (see :meth:`QueueDispatcher.stuck`).
    progress_deadline: float = 30.0


class QueueDispatcher:
    """Leases due tasks of one queue and pushes them to its registered gateways."""

    def __init__(
        self,
        queue: str,
        *,
        broker: Broker,
        bus: Bus,
        config: QueueConfig,
        leaser: LeaseBatcher | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.queue = queue
        self.book = CreditBook()
        self._broker = broker
        # Shared by every queue of one dispatcher, so their leases go out together.
        self._leaser = leaser or LeaseBatcher(broker)
        self._bus = bus
        self._config = config
        self._paused = False
        self._rate: RateLimit | None = None
        # Armed while a rate-limited queue waits for its bucket's next token.
        self._rate_timer: asyncio.TimerHandle | None = None
        self._clock: Clock = clock or SystemClock()
        #: The queue-wide circuit breakers that are not closed, by task type, as last
        #: loaded from the broker: their types are leased to nobody (but the probe).
        self._breakers: dict[str, Breaker] = {}
        # Armed for the earliest breaker's until (its probe is due then).
        self._breaker_timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._dirty = False
        self._cycle: asyncio.Task[None] | None = None
        self._last_active = asyncio.get_running_loop().time()
        #: When the running cycle's current round began (loop time); None between cycles.
        self._round_since: float | None = None
        #: Aggregation groups the sweeper found due, waiting for a lease: group -> the most
        #: members one delivery takes.
        self._due_groups: dict[str, int] = {}
        #: The task type each group's members had when last leased, and when (loop time):
        #: a group whose type no gateway takes as batches is not leased again only to be
        #: released, for GROUP_TYPE_TTL.
        self._group_types: dict[str, tuple[str, float]] = {}
        self._group_cycle: asyncio.Task[None] | None = None
        #: Batches delivered (for logs and tests).
        self.batches = 0
        # Counters, for logs and tests.
        self.wakes = 0
        self.dispatched = 0
        self.released = 0
        self.probes = 0

    # ----------------------------------------------------------------- state

    @property
    def paused(self) -> bool:
        """The pause flag as last loaded from the broker."""
        return self._paused

    @property
    def rate_limit(self) -> RateLimit | None:
        """The queue's rate limit as last loaded from the broker."""
        return self._rate

    @property
    def closed(self) -> bool:
        """True once the dispatcher stopped dispatching for good."""
        return self._closed

    @property
    def cycling(self) -> bool:
        """True while a lease cycle runs."""
        return self._cycle is not None and not self._cycle.done()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # ---------------------------------------------------------------- events

    async def open(self) -> None:
        """Load the queue's settings from the broker (called once, on claim)."""
        self._paused = await self._broker.queue_paused(self.queue)
        self._rate = await self._broker.get_rate_limit(self.queue)
        await self._load_breakers()
        self._last_active = self._now()

    def wake(self) -> None:
        """Due work may exist.

        A wake does not keep the queue: with no gateway registered, its work can go
        nowhere (and wakes keep coming while it waits: every enqueue sends one), so the
        queue idles out and the next registration brings it back."""
        self.wakes += 1
        self._kick()

    def register(self, msg: cluster_pb2.Register) -> None:
        """A gateway announced (or withdrew) its capacity on this queue."""
        if msg.closing:
            if self.book.forget(msg.gateway):
                logger.info(
                    "dispatcher.gateway_closed queue=%s gateway=%s", self.queue, msg.gateway
                )
            return
        known = msg.gateway in self.book
        entry = self.book.register(
            msg.gateway,
            capacity=msg.capacity,
            weight=msg.weight,
            in_flight=msg.in_flight,
            now=self._now(),
            returned=msg.returned,
            holder=msg.holder,
            blocked=frozenset(msg.blocked_types),
            batch_types=frozenset(msg.batch_types),
        )
        self._last_active = self._now()
        if not known:
            logger.info(
                "dispatcher.gateway_registered queue=%s gateway=%s capacity=%d weight=%d credits=%d",
                self.queue,
                entry.gateway,
                entry.capacity,
                entry.weight,
                entry.credits,
            )
        self._kick()

    def done(self, msg: cluster_pb2.Done) -> None:
        """A gateway gave ``n`` slots back (tasks finished, canceled or lost)."""
        if self.book.refill(msg.gateway, msg.n, msg.returned):
            self._kick()

    def groups_due(self, msg: cluster_pb2.GroupsDue) -> None:
        """The sweeper found these groups due: lease each whole and offer it as one batch
        (see :meth:`_fire`), one group at a time, in the order given."""
        for hint in msg.groups:
            if hint.group and hint.max_size > 0:
                self._due_groups[hint.group] = min(hint.max_size, MAX_BATCH)
        self._kick_groups()

    async def reload(self) -> None:
        """Control: reload the pause flag, the rate limit and the queue-wide breakers.
        Pause stops dispatch at once; resume (or a changed limit) kicks."""
        paused = await self._broker.queue_paused(self.queue)
        rate = await self._broker.get_rate_limit(self.queue)
        if paused != self._paused:
            logger.info("dispatcher.pause_changed queue=%s paused=%s", self.queue, paused)
        if rate != self._rate:
            logger.info(
                "dispatcher.rate_limit_changed queue=%s per_second=%s burst=%s",
                self.queue,
                None if rate is None else rate.per_second,
                None if rate is None else rate.burst,
            )
            self._disarm()  # a wait for the old bucket's next token no longer holds
        self._paused = paused
        self._rate = rate
        await self._load_breakers()
        if not paused:
            self._kick()

    def close(self) -> None:
        """Stop dispatching now (ownership lost or given up). A cycle in flight finishes its
        current request and releases whatever it leased but did not send."""
        self._closed = True
        self._disarm()
        self._disarm_breakers()
        self._credits_changed()

    def stuck(self) -> float | None:
        """Seconds the running cycle has spent in its current round, when that is past
        the progress deadline (a broker call or a dispatch that does not come back: a
        wedged database connection, say); else None. The owner then gives the queue up
        (:meth:`abandon`) so that another dispatcher, whose links work, takes it over."""
        since = self._round_since
        if since is None or not self.cycling:
            return None
        spent = self._now() - since
        return spent if spent >= self._config.progress_deadline else None

    def abandon(self) -> None:
        """Stop dispatching now and cancel the cycle in flight (stuck): what it leased and
        did not send comes back when its lease expires (the reaper)."""
        self._closed = True
        self._disarm()
        for cycle in (self._cycle, self._group_cycle):
            if cycle is not None:
                cycle.cancel()

    async def wait_closed(self) -> None:
        """Wait for the cycles in flight (tasks, groups), if any, to end."""
        for cycle in (self._cycle, self._group_cycle):
            if cycle is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(cycle)

    def expire_registrations(self) -> list[str]:
        """Forget gateways that stopped re-registering."""
        gone = self.book.expire(self._now(), self._config.register_ttl)
        for gateway in gone:
            logger.info("dispatcher.gateway_expired queue=%s gateway=%s", self.queue, gateway)
        return gone

    def idle(self) -> bool:
        """True when the queue may be given up: no cycle, and no registration or leased
        work for ``idle_timeout`` (due work nobody serves does not count)."""
        return (
            not self.cycling
            and len(self.book) == 0
            and self._now() - self._last_active >= self._config.idle_timeout
        )

    # ------------------------------------------------------------------ cycle

    def _credits_changed(self) -> None:
        metrics.credits(self.queue).set(0 if self._closed else self.book.total)

    def _kick(self) -> None:
        self._credits_changed()
        if self._closed or self._rate_timer is not None:
            # Rate-limited and out of tokens: the timer kicks when the next one is due.
            return
        if self.cycling:
            # Coalesce: the running cycle goes round once more instead of a second cycle.
            self._dirty = True
            return
        if self._paused or self.book.total <= 0:
            return
        self._cycle = asyncio.create_task(self._run(), name=f"dispatch-{self.queue}")

    def _stopped(self) -> bool:
        return self._closed or self._paused

    # ---------------------------------------------------------- groups

    def _kick_groups(self) -> None:
        if not self._due_groups or self._stopped():
            self._due_groups.clear()
            return
        if self._group_cycle is not None and not self._group_cycle.done():
            return  # the running cycle takes the new ones too
        self._group_cycle = asyncio.create_task(self._run_groups(), name=f"groups-{self.queue}")

    async def _run_groups(self) -> None:
        try:
            while self._due_groups and not self._stopped() and self.book.batch_capable():
                group = next(iter(self._due_groups))
                max_size = self._due_groups.pop(group)
                await self._fire(group, max_size)
        except Exception:
            logger.exception("dispatcher.groups_failed queue=%s", self.queue)
        finally:
            # What no gateway could take now waits for the next sweep's hint.
            self._due_groups.clear()

    async def _fire(self, group: str, max_size: int) -> None:
        """Lease the due members of ``group`` (at most ``max_size``) under one lease and
        offer them as one batch, for one slot, to a gateway that takes their type as
        batches. Members of another type than the first go back (they come in a batch
        of their own next time: a group is expected to hold one type); so do those past
        what one NATS message carries, and everything when no gateway takes the batch."""
        known, learned_at = self._group_types.get(group, (None, 0.0))
        if known is not None and self._now() - learned_at > GROUP_TYPE_TTL:
            known = None  # (the group may hold another type by now)
        # The slot is taken before the lease, so that the members are leased in the name
        # of the process that will hold them (first lease: a gateway taking any batch).
        gateway = (
            self.book.take_batch_slot(known)
            if known is not None
            else self.book.take_any_batch_slot()
        )
        if gateway is None:
            return
        holder = self.book.holder_of(gateway)
        try:
            tasks = await self._broker.lease_group(
                self.queue, group, max_size, self._config.lease_ttl, holder=holder
            )
        except Exception as exc:
            if gateway is not None:
                self.book.refund([gateway])
            logger.warning(
                "dispatcher.lease_group_failed queue=%s group=%s error=%r", self.queue, group, exc
            )
            return
        if not tasks:
            self.book.refund([gateway])
            return
        self._last_active = self._now()
        task_type = tasks[0].type
        self._group_types.pop(group, None)
        self._group_types[group] = (task_type, self._now())
        if len(self._group_types) > MAX_BATCH:
            self._group_types.pop(next(iter(self._group_types)))
        batch = [t for t in tasks if t.type == task_type]
        back = [t for t in tasks if t.type != task_type]
        entry = self.book.get(gateway)
        if entry is None or task_type not in entry.batch_types or task_type in entry.blocked:
            # Not this gateway's type after all: another one that takes it, if any.
            self.book.refund([gateway])
            gateway = self.book.take_batch_slot(task_type)
        if gateway is None or self._stopped() or task_type in self._breakers:
            if gateway is not None:
                self.book.refund([gateway])
            await self._release(tasks)
            return
        envelopes = [task_to_envelope(task) for task in batch]
        fit = fit_batch(envelopes, self._bus.max_payload)
        back += batch[fit:]
        batch, envelopes = batch[:fit], envelopes[:fit]
        if back:
            logger.info(
                "dispatcher.batch_trimmed queue=%s group=%s kept=%d back=%d",
                self.queue,
                group,
                len(batch),
                len(back),
            )
            await self._release(back)
        if not batch:
            self.book.refund([gateway])
            return
        left = await self._send_batch(gateway, group, batch, envelopes)
        if left:
            await self._release(left)
            return
        self.batches += 1
        self.dispatched += len(batch)
        self._count_dispatch(
            [(t, e) for t, e in zip(batch, envelopes, strict=True)], [], len(batch)
        )
        logger.debug(
            "dispatcher.batch queue=%s group=%s gateway=%s members=%d",
            self.queue,
            group,
            gateway,
            len(batch),
        )

    async def _send_batch(
        self,
        gateway: str,
        group: str,
        batch: Sequence[Task],
        envelopes: Sequence[task_pb2.TaskEnvelope],
    ) -> list[Task]:
        """Offer one batch to ``gateway``; the tasks to give back (all, or none)."""
        metrics.offers(self.queue).inc()
        request = cluster_pb2.DispatchRequest(
            queue=self.queue,
            dispatcher=self._config.instance_id,
            tasks=envelopes,
            group=group,
        )
        try:
            reply = await self._bus.dispatch(gateway, request, within=self._config.dispatch_timeout)
        except nats.errors.NoRespondersError:
            self.book.forget(gateway)
            return list(batch)
        except Exception as exc:
            logger.warning(
                "dispatcher.batch_dispatch_failed queue=%s gateway=%s error=%r",
                self.queue,
                gateway,
                exc,
            )
            self.book.block(gateway)
            return list(batch)
        left = self._answered(gateway, reply, batch)
        if not left:
            return []
        logger.info(
            "dispatcher.batch_refused queue=%s group=%s gateway=%s", self.queue, group, gateway
        )
        return list(batch)

    async def _run(self) -> None:
        try:
            while not self._stopped():
                self._round_since = self._now()
                self._dirty = False
                if self._breakers:
                    await self._probe()
                # The slots are picked before the lease, so that each task is leased in
                # the name of the process that will hold it (its gateway's holder): if
                # that process dies, the reaper releases the task within seconds.
                want = min(self.book.total, self._config.batch_max)
                if want <= 0:
                    break
                try:
                    # As many tokens as slots, or fewer: the lease takes no more.
                    want, wait = await self._take_tokens(want)
                except Exception as exc:
                    logger.warning("dispatcher.rate_failed queue=%s error=%r", self.queue, exc)
                    await asyncio.sleep(ERROR_BACKOFF)
                    if self._dirty:
                        continue
                    break
                if want <= 0:
                    break  # the timer kicks when the next token is due
                slots = self.book.take_slots(want)
                holders = [self.book.holder_of(gw) for gw in slots]
                lease_at = lease_started()
                try:
                    if self._breakers or self.book.any_blocked(slots):
                        groups = await self._lease_filtered(slots, holders)
                    else:
                        tasks = await self._leaser.lease(
                            self.queue, want, self._config.lease_ttl, holders
                        )
                        groups = [(tasks, slots, holders)]
                except Exception as exc:
                    self.book.refund(slots)
                    await self._give_tokens_back(want)
                    logger.warning("dispatcher.lease_failed queue=%s error=%r", self.queue, exc)
                    await asyncio.sleep(ERROR_BACKOFF)
                    if self._dirty:
                        continue
                    break
                leased = sum(len(tasks) for tasks, _, _ in groups)
                await self._give_tokens_back(want - leased)
                if not leased:
                    self.book.refund(slots)
                    if self._dirty:
                        continue
                    break
                self._last_active = self._now()
                if self._stopped():
                    # Paused or lost the queue while leasing: give the tasks back now.
                    self.book.refund(slots)
                    await self._release([task for tasks, _, _ in groups for task in tasks])
                    await self._give_tokens_back(leased)
                    break
                accepted = rejected = 0
                for tasks, group_slots, group_holders in groups:
                    if not tasks:
                        self.book.refund(group_slots)
                        continue
                    took, left = await self._dispatch(
                        tasks,
                        group_slots,
                        group_holders,
                        more=len(tasks) == len(group_slots),
                        lease_at=lease_at,
                    )
                    accepted += took
                    rejected += left
                # A task no gateway took did not start: its token goes back too.
                await self._give_tokens_back(rejected)
                if wait is not None:
                    # The bucket ran dry: go on when it holds the next token.
                    self._arm(wait)
                    break
                more = leased == want or (rejected > 0 and accepted > 0)
                if not (more or self._dirty):
                    break
                if accepted == 0 and not self._dirty:
                    # Gateways refused everything: wait for a new event instead of spinning.
                    break
        except Exception:
            logger.exception("dispatcher.cycle_failed queue=%s", self.queue)
        finally:
            self._round_since = None

    # -------------------------------------------------------------- breakers

    @property
    def breakers(self) -> dict[str, Breaker]:
        """The queue-wide breakers that are not closed, by type, as last loaded."""
        return dict(self._breakers)

    async def _load_breakers(self) -> None:
        rows = await self._broker.list_breakers(self.queue)
        breakers = {b.type: b for b in rows if b.scope is BreakerScope.QUEUE}
        if breakers.keys() != self._breakers.keys():
            logger.info(
                "dispatcher.breakers_changed queue=%s types=%s", self.queue, sorted(breakers)
            )
        self._breakers = breakers
        self._arm_breakers()

    def _arm_breakers(self) -> None:
        """Kick the cycle when the earliest breaker's until comes (its probe is due)."""
        self._disarm_breakers()
        if not self._breakers or self._closed:
            return
        earliest = min(b.until for b in self._breakers.values())
        delay = max(0.0, (earliest - self._clock.now()).total_seconds())
        loop = asyncio.get_running_loop()
        self._breaker_timer = loop.call_later(delay + 0.001, self._breakers_due)

    def _disarm_breakers(self) -> None:
        if self._breaker_timer is not None:
            self._breaker_timer.cancel()
            self._breaker_timer = None

    def _breakers_due(self) -> None:
        self._breaker_timer = None
        self._kick()

    async def _probe(self) -> None:
        """Send the probe of each queue-wide breaker whose until has come: one task of its
        type, to one gateway, if this dispatcher wins the probe (``take_probe``: of the
        owners of a moment, one does) and such a task is due. The breaker stays half-open
        (its type leased to nobody else) until the probe's outcome closes it or opens it
        again, or the probe's chance lapses a lease TTL later and another may go."""
        now = self._clock.now()
        due = sorted(b.type for b in self._breakers.values() if b.until <= now)
        if not due:
            return
        ttl = self._config.lease_ttl
        stale = False
        for task_type in due:
            slots = self.book.take_slots(1)
            if not slots:
                break
            holders = [self.book.holder_of(slots[0])]
            until = now + ttl
            try:
                won = await self._broker.take_probe(self.queue, task_type, until)
                granted = (await self._take_tokens(1))[0] if won else 0
                tasks = (
                    await self._broker.lease(
                        self.queue, 1, ttl, holders=holders, only_types=[task_type]
                    )
                    if granted
                    else []
                )
            except Exception as exc:
                self.book.refund(slots)
                logger.warning("dispatcher.probe_failed queue=%s error=%r", self.queue, exc)
                break
            if not won:
                stale = True  # another took it: learn its new until
            else:
                self._breakers[task_type] = replace(
                    self._breakers[task_type], status=BreakerStatus.HALF_OPEN, until=until
                )
            if not tasks:
                self.book.refund(slots)
                if granted:
                    await self._give_tokens_back(granted)
                continue
            self.probes += 1
            logger.info(
                "dispatcher.breaker_probe queue=%s type=%s task_id=%s",
                self.queue,
                task_type,
                tasks[0].id,
            )
            accepted, _ = await self._dispatch(tasks, slots, holders, probe=True)
            if not accepted:
                await self._give_tokens_back(1)
        if stale:
            await self._load_breakers()
        else:
            self._arm_breakers()

    async def _lease_filtered(
        self, slots: Sequence[str], holders: Sequence[str]
    ) -> list[tuple[list[Task], list[str], list[str]]]:
        """The lease of a round when some types may not go everywhere: the queue-wide
        breakers' types to nobody, a gateway's blocked types not to it. The slots are
        grouped by what their gateways block, and each group leases for itself with those
        types left out. Returns each group's tasks, slots and holders (its tasks go to
        its slots only)."""
        excluded = frozenset(self._breakers)
        by_types: dict[frozenset[str], list[int]] = {}
        for index, gateway in enumerate(slots):
            by_types.setdefault(self.book.blocked_of(gateway) | excluded, []).append(index)
        groups: list[tuple[list[Task], list[str], list[str]]] = []
        for types, indexes in by_types.items():
            group_holders = [holders[i] for i in indexes]
            try:
                tasks = await self._broker.lease(
                    self.queue,
                    len(indexes),
                    self._config.lease_ttl,
                    holders=group_holders,
                    exclude_types=sorted(types),
                )
            except Exception:
                # What the groups before leased goes back now, not at lease expiry.
                await self._release([task for done, _, _ in groups for task in done])
                raise
            groups.append((tasks, [slots[i] for i in indexes], group_holders))
        return groups

    # ------------------------------------------------------------ rate limit

    async def _take_tokens(self, want: int) -> tuple[int, float | None]:
        """How many tasks this round may lease (``want``, or fewer when the queue is
        rate-limited), and, when the bucket gave fewer than ``want``, the seconds until
        it holds the next token. Tokens are spent in the broker: every owner of the
        queue, at once or one after another, draws from one bucket."""
        if self._rate is None:
            return want, None
        grant = await self._broker.take_rate_tokens(self.queue, want)
        wait = None if grant.wait is None else grant.wait.total_seconds()
        if grant.granted == 0 and wait is not None:
            self._arm(wait)
        return grant.granted, wait

    async def _give_tokens_back(self, count: int) -> None:
        """Return ``count`` tokens this round took and leased no started task for."""
        if self._rate is None or count <= 0:
            return
        try:
            await self._broker.return_rate_tokens(self.queue, count)
        except Exception as exc:
            # The bucket refills anyway: a few tokens lost slow the queue for a moment.
            logger.warning("dispatcher.rate_return_failed queue=%s error=%r", self.queue, exc)

    def _arm(self, wait: float) -> None:
        if self._rate_timer is None and not self._closed:
            self._rate_timer = asyncio.get_running_loop().call_later(wait, self._tokens_due)

    def _disarm(self) -> None:
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None

    def _tokens_due(self) -> None:
        self._rate_timer = None
        self._kick()

    async def _dispatch(
        self,
        tasks: Sequence[Task],
        slots: Sequence[str],
        holders: Sequence[str],
        *,
        more: bool = False,
        probe: bool = False,
        lease_at: int = 0,
    ) -> tuple[int, int]:
        """Send ``tasks`` to the gateways whose ``slots`` (taken from the book for this
        lease, the gateway of each, named as ``holders`` in the lease) they were leased
        for; release what nobody accepted, and give back the slots no task used. ``more``:
        the lease got all it asked for (the queue probably holds more), which the offers
        say; ``probe``: the tasks are a half-open breaker's probe (their envelopes say so);
        ``lease_at``: when their lease began, while tracing is on (0: nothing traced; see
        :mod:`~conveyor_dispatcher.tracing`).

        A task too big for any NATS message is archived first (see :func:`split_offer`):
        its slot is given back and it counts as neither accepted nor released. Returns
        (accepted, released).
        """
        envelopes = [(task, task_to_envelope(task)) for task in tasks]
        if probe:
            for _, envelope in envelopes:
                envelope.probe = True
        offer, oversized = fit_offer(envelopes, self._bus.max_payload)
        if oversized:
            await self._archive_oversized(oversized)
        spans = OfferSpans.start(self.queue, offer, lease_at) if lease_at else None
        plan, unused = assign(offer, slots, holders)
        self.book.refund(unused)
        # A gateway forgotten while the lease ran (it closed) gets nothing: its tasks go
        # back at once.
        leftover = [task for gw, batch in plan.items() if gw not in self.book for task, _ in batch]
        results = await asyncio.gather(
            *(self._send(gw, batch, more) for gw, batch in plan.items() if gw in self.book)
        )
        rejected = leftover + [task for batch in results for task in batch]
        if spans is not None:
            spans.end(rejected)
        await self._release(rejected)
        accepted = len(offer) - len(rejected)
        self.dispatched += accepted
        self._count_dispatch(offer, rejected, accepted)
        return accepted, len(rejected)

    def _count_dispatch(self, offer: _Offer, rejected: Sequence[Task], accepted: int) -> None:
        """The metrics of one dispatch: counters per batch, and the enqueue-to-start
        latency of each accepted first attempt (its lease time, ``started_at``, less when
        it was created or, when later, due: ``process_at``)."""
        metrics.offered(self.queue).inc(len(offer))
        metrics.accepted(self.queue).inc(accepted)
        metrics.started(self.queue).inc(accepted)
        self._credits_changed()
        if not accepted:
            return
        refused = {task.id for task in rejected}
        latency = metrics.enqueue_to_start(self.queue)
        for task, _ in offer:
            if task.id in refused or task.retried or task.started_at is None:
                continue
            since = task.created_at
            if task.process_at is not None and task.process_at > since:
                since = task.process_at
            latency.observe(max(0.0, (task.started_at - since).total_seconds()))

    async def _send(
        self, gateway: str, batch: Sequence[tuple[Task, task_pb2.TaskEnvelope]], more: bool
    ) -> list[Task]:
        """Offer ``batch`` to ``gateway``; returns the tasks it did not accept.

        The offer goes as one DispatchRequest when it is small, else as several of about
        PIECE_BYTES (or the NATS server's max_payload, when smaller), one after another,
        while the queue is still dispatched and the gateway still has room.
        """
        pieces = split_offer(batch, min(PIECE_BYTES, self._bus.max_payload))
        rejected: list[Task] = []
        for n, piece in enumerate(pieces):
            if n and (self._stopped() or self.book.credits_of(gateway) <= 0):
                rejected += [task for later in pieces[n:] for task, _ in later]
                break
            left = await self._send_piece(gateway, piece, more)
            rejected += left
            if left:
                # Full, gone or failing: the rest is not worth offering now.
                rejected += [task for later in pieces[n + 1 :] for task, _ in later]
                break
        return rejected

    async def _send_piece(
        self, gateway: str, piece: Sequence[tuple[Task, task_pb2.TaskEnvelope]], more: bool
    ) -> list[Task]:
        """One DispatchRequest to ``gateway``; returns the tasks it did not accept."""
        batch = [task for task, _ in piece]
        metrics.offers(self.queue).inc()
        request = cluster_pb2.DispatchRequest(
            queue=self.queue,
            dispatcher=self._config.instance_id,
            tasks=[envelope for _, envelope in piece],
            more=more,
        )
        reconnects = self._bus.nc.stats["reconnects"]
        try:
            reply = await self._bus.dispatch(gateway, request, within=self._config.dispatch_timeout)
        except nats.errors.NoRespondersError:
            logger.info("dispatcher.gateway_gone queue=%s gateway=%s", self.queue, gateway)
            self.book.forget(gateway)
            return batch
        except TimeoutError:  # nats.errors.TimeoutError is one too
            if self._bus.nc.stats["reconnects"] != reconnects:
                # Lost with our own NATS link (a request or reply in flight through a
                # server that went away): the gateway is not to blame. It refuses the
                # request if it arrives now, past its deadline.
                logger.warning(
                    "dispatcher.dispatch_lost queue=%s gateway=%s reason=nats_reconnected",
                    self.queue,
                    gateway,
                )
                return batch
            # Slow or dead: send it nothing more until it registers again.
            logger.warning("dispatcher.dispatch_timeout queue=%s gateway=%s", self.queue, gateway)
            self.book.block(gateway)
            return batch
        except (DecodeError, nats.errors.Error) as exc:
            logger.warning(
                "dispatcher.dispatch_failed queue=%s gateway=%s error=%r", self.queue, gateway, exc
            )
            self.book.block(gateway)
            return batch
        except Exception:
            # Whatever went wrong, the leased tasks must go back rather than wait for expiry.
            logger.exception("dispatcher.dispatch_error queue=%s gateway=%s", self.queue, gateway)
            self.book.block(gateway)
            return batch
        return self._answered(gateway, reply, batch)

    def _answered(
        self, gateway: str, reply: cluster_pb2.DispatchReply, offered: Sequence[Task]
    ) -> list[Task]:
        """Take a gateway's reply to an offer into the book; the tasks it did not accept."""
        self.book.set_credits(
            gateway,
            reply.credits,
            returned=reply.returned,
            blocked=frozenset(reply.blocked_types),
        )
        accepted = set(reply.accepted)
        return [task for task in offered if task.id not in accepted]

    async def _archive_oversized(self, tasks: Sequence[tuple[Task, int]]) -> None:
        for task, size in tasks:
            error = (
                f"cannot dispatch: the task's envelope is {size} bytes and this cluster's "
                f"NATS messages carry at most {self._bus.max_payload}; raise the nats-server "
                "max_payload (or lower CONVEYOR_MAX_PAYLOAD), then revive the task"
            )
            logger.error(
                "dispatcher.task_too_big queue=%s task_id=%s bytes=%d", self.queue, task.id, size
            )
            try:
                await self._broker.archive(task.id, task.lease_id or "", error)
            except LeaseLost:
                pass
            except Exception as exc:
                # Its lease expires and the reaper retries it (and it comes back here).
                logger.warning(
                    "dispatcher.archive_failed queue=%s task_id=%s error=%r",
                    self.queue,
                    task.id,
                    exc,
                )

    async def _release(self, tasks: Sequence[Task]) -> None:
        if not tasks:
            return
        results = await asyncio.gather(
            *(self._broker.release(task.id, task.lease_id or "") for task in tasks),
            return_exceptions=True,
        )
        for task, result in zip(tasks, results, strict=True):
            if isinstance(result, LeaseLost):
                continue  # reaped or canceled meanwhile: nothing to give back
            if isinstance(result, BaseException):
                # The lease will expire and the reaper puts the task back.
                logger.warning(
                    "dispatcher.release_failed queue=%s task_id=%s lease_id=%s error=%r",
                    self.queue,
                    task.id,
                    task.lease_id,
                    result,
                )
        self.released += len(tasks)
        metrics.released(self.queue).inc(len(tasks))


#: Bytes of a DispatchRequest besides its envelopes (queue, dispatcher id) and of each
#: envelope's own framing, with room to spare.
_REQUEST_OVERHEAD = 1024
_ENVELOPE_FRAMING = 8
#: An offer bigger than this goes to its gateway as several DispatchRequests (a bigger
#: task alone in one): each is quick to send and answer, and each becomes a Dispatches
#: frame of about this size at most.
PIECE_BYTES = 1024 * 1024

_Offer = list[tuple[Task, task_pb2.TaskEnvelope]]


def _size(envelope: task_pb2.TaskEnvelope) -> int:
    return envelope.ByteSize() + _ENVELOPE_FRAMING


def assign(
    offer: Sequence[tuple[Task, task_pb2.TaskEnvelope]],
    slots: Sequence[str],
    holders: Sequence[str],
) -> tuple[dict[str, _Offer], list[str]]:
    """Give each task of ``offer`` one of the ``slots`` (the gateway of each, in the order
    they were picked, and ``holders``, the holder the lease named for each): the first
    one left whose holder is the one the task was leased for (leasing k tasks, the broker
    names the holders of the first k slots, in some order), else the first one left.
    Returns the tasks per gateway and the slots left unused. So k tasks take the first k
    slots, split between gateways by weight."""
    pools: dict[str, deque[int]] = {}
    for index, holder in enumerate(holders):
        pools.setdefault(holder, deque()).append(index)
    plan: dict[str, _Offer] = {}
    unmatched: _Offer = []
    for item in offer:
        pool = pools.get(item[0].holder or "")
        if pool:
            plan.setdefault(slots[pool.popleft()], []).append(item)
        else:
            unmatched.append(item)
    rest = sorted(index for pool in pools.values() for index in pool)
    # A task whose holder no slot left has (a broker of an older release names none):
    # the first slots left.
    for item, index in zip(unmatched, rest, strict=False):
        plan.setdefault(slots[index], []).append(item)
    left = [slots[index] for index in rest[len(unmatched) :]]
    return plan, left


def fit_batch(envelopes: Sequence[task_pb2.TaskEnvelope], max_message: int) -> int:
    """How many of a batch's ``envelopes``, from the first, fit one DispatchRequest of
    ``max_message`` bytes (the server's ``max_payload``; 0: unknown, all fit)."""
    if max_message <= 0:
        return len(envelopes)
    room = max_message - _REQUEST_OVERHEAD
    used = 0
    for n, envelope in enumerate(envelopes):
        used += _size(envelope)
        if used > room:
            return n
    return len(envelopes)


def fit_offer(
    envelopes: Sequence[tuple[Task, task_pb2.TaskEnvelope]], max_message: int
) -> tuple[_Offer, list[tuple[Task, int]]]:
    """Set apart the tasks too big for a NATS message of ``max_message`` bytes (the
    server's ``max_payload``) on their own; returns the rest, in order, and those with
    their envelope's size. No dispatch could ever carry one of them."""
    room = max_message - _REQUEST_OVERHEAD
    fit: _Offer = []
    oversized: list[tuple[Task, int]] = []
    for task, envelope in envelopes:
        size = _size(envelope)
        if size > room:
            oversized.append((task, size))
        else:
            fit.append((task, envelope))
    return fit, oversized


def split_offer(
    envelopes: Sequence[tuple[Task, task_pb2.TaskEnvelope]], target: int
) -> list[_Offer]:
    """Cut an offer into pieces of about ``target`` bytes, in order (a task bigger than
    that makes a piece of its own)."""
    room = target - _REQUEST_OVERHEAD
    pieces: list[_Offer] = []
    piece: _Offer = []
    used = 0
    for task, envelope in envelopes:
        size = _size(envelope)
        if piece and used + size > room:
            pieces.append(piece)
            piece, used = [], 0
        piece.append((task, envelope))
        used += size
    if piece:
        pieces.append(piece)
    return pieces
