"""Dispatcher: routes queue events to the QueueDispatchers of the queues this instance owns.

Every instance subscribes to every queue's wake/register/done/control subjects (no queue
group): the owner acts, the others ignore. A registration for a queue nobody here owns,
or a wake for one that some gateway serves, makes this instance try to claim it (a KV
create, which fails when another instance owns it). On a claim the instance reloads the
queue's state from the broker and publishes ``owner_changed`` so that gateways re-register
at once. Losing the key stops that queue's dispatch at once; a queue with no registrations
for ``idle_timeout`` is given up, however much work it holds.

Only queues that someone serves are worth a dispatcher: every instance keeps the
registrations it hears (:class:`~conveyor_runtime.demand.Demand`), and a wake or an owner
change for a queue no gateway serves is ignored. So thousands of queues with work and no
worker cost no claims, no ownership keys and no lease cycles; when a worker for one of
them connects, its gateway's first registration brings the queue a dispatcher, which
leases at once.

On start, an instance calls the roll: every gateway re-registers at once, so the queues
that have workers are claimed now rather than at the next register tick (registrations
sent before it subscribed never reached it).

Hand-over. An instance that stops gives its keys up and announces ``owner_changed`` for
each of its queues: the others claim them at once. One that dies cannot, so the
instances beat on NATS (:class:`~conveyor_dispatcher.peers.PeerWatch`): when a peer falls
silent for ``peer_silence``, every survivor lists the keys it held and takes each over
with a compare-and-set on the revision it wrote last (one survivor wins each), instead of
waiting up to ``owner_ttl`` for the keys to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from conveyor_broker.clock import Clock, SystemClock
from conveyor_broker.errors import InvalidTask
from conveyor_broker.interface import Broker
from conveyor_broker.validation import check_queue
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime import metrics
from conveyor_runtime.bus import Bus
from conveyor_runtime.cluster_key import ClusterAuth
from conveyor_runtime.cluster_view import NodeCard
from conveyor_runtime.demand import REGISTER_TICKS_TO_EXPIRE, Demand
from conveyor_runtime.health import Health
from conveyor_runtime.ownership import LeaseKeeper, held_by, open_lease_bucket
from conveyor_runtime.settings import DispatcherSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.tasks import cancel_and_wait
from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from conveyor_dispatcher.leases import LeaseBatcher
from conveyor_dispatcher.peers import PeerWatch
from conveyor_dispatcher.queue import QueueConfig, QueueDispatcher

logger = logging.getLogger(__name__)

#: Most claims in flight at once while taking over the queues of a dead peer.
TAKE_OVER_CONCURRENCY = 32


class Dispatcher:
    """One dispatcher instance: ownership of queues, and a QueueDispatcher per owned queue."""

    def __init__(
        self,
        settings: DispatcherSettings,
        broker: Broker,
        nc: NatsClient,
        clock: Clock | None = None,
        *,
        health: Health | None = None,
    ) -> None:
        """``health``: the process's signals (the ownership bucket reports to them)."""
        self.settings = settings
        self._health = health
        self.instance_id = settings.instance_id
        self.subjects = Subjects(settings.subject_prefix)
        self.bus = Bus(nc, self.subjects, ClusterAuth.from_settings(settings))
        self._broker = broker
        #: Every owned queue leases through it, so their leases share round trips.
        self.leaser = LeaseBatcher(broker)
        self._nc = nc
        # The broker reads "now" from this clock; the dispatcher's own timers are
        # process-local and use the event loop's monotonic time.
        self.clock = clock or SystemClock()
        self._config = QueueConfig(
            instance_id=settings.instance_id,
            batch_max=settings.batch_max,
            lease_ttl=settings.lease_ttl_delta,
            dispatch_timeout=settings.dispatch_timeout,
            register_ttl=settings.register_tick * REGISTER_TICKS_TO_EXPIRE,
            idle_timeout=settings.idle_timeout,
            progress_deadline=settings.progress_deadline,
        )
        # After a refused claim, the queue is not tried again for this long (unless its
        # owner announces a change), so that wakes do not hammer the KV bucket.
        self._claim_retry = settings.owner_ttl / 2
        self._housekeeping_tick = min(
            1.0, settings.register_tick, settings.idle_timeout / 2, settings.progress_deadline / 2
        )
        self._queues: dict[str, QueueDispatcher] = {}
        #: The queues some gateway serves (owned here or not), from their registrations.
        self.demand = Demand(self._config.register_ttl)
        # Queue -> registrations that arrived while its claim was in flight.
        self._claiming: dict[str, list[cluster_pb2.Register]] = {}
        self._refused_until: dict[str, float] = {}
        #: Queues this instance gave up as stuck, and until when it leaves them alone.
        self._abandoned_until: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._subs: list[Subscription] = []
        self._keeper: LeaseKeeper | None = None
        self.peers: PeerWatch | None = None
        self._housekeeper: asyncio.Task[None] | None = None
        # The NATS connection's reconnect count when housekeeping last looked.
        self._reconnects = 0
        self._running = False
        #: Claims that found the queue owned elsewhere (or NATS not answering).
        self.claims_refused = 0
        #: Queues given up because their lease cycle was stuck.
        self.abandoned = 0
        #: Queues taken over from dead peers.
        self.taken_over = 0
        #: This dispatcher in the cluster view: the queues it owns.
        self.card = NodeCard(
            self.bus,
            kind="dispatcher",
            instance=settings.instance_id,
            fill=lambda node: node.owned_queues.extend(sorted(self._queues)),
        )

    # -------------------------------------------------------------- lifecycle

    @property
    def owned(self) -> frozenset[str]:
        """Queues this instance dispatches right now."""
        return frozenset(self._queues)

    def queue(self, name: str) -> QueueDispatcher | None:
        """The QueueDispatcher of an owned queue."""
        return self._queues.get(name)

    async def start(self) -> None:
        """Open the ownership bucket and subscribe; returns once subscriptions are live."""
        if self._running:
            return
        kv = await open_lease_bucket(
            self._nc,
            self.subjects.owners_bucket,
            self.settings.owner_ttl,
            replicas=self.settings.nats_replicas,
            health=self._health,
        )
        self._keeper = LeaseKeeper(kv, self.instance_id, self.settings.owner_ttl, self._on_lost)
        await self._keeper.start()
        self._reconnects = int(self._nc.stats.get("reconnects", 0))
        self._running = True
        bus = self.bus
        self._subs += [
            await bus.subscribe(cluster_pb2.Wake, self._on_wake),
            await bus.subscribe(cluster_pb2.Register, self._on_register),
            await bus.subscribe(cluster_pb2.Done, self._on_done),
            await bus.subscribe(cluster_pb2.Control, self._on_control),
            await bus.subscribe(cluster_pb2.GroupsDue, self._on_groups_due),
            await bus.subscribe_owner_changed(self._on_owner),
        ]
        await self._nc.flush()
        self.peers = PeerWatch(
            self.bus,
            self.instance_id,
            beat=self.settings.peer_beat,
            silence=self.settings.peer_silence,
            on_dead=self._on_peer_dead,
        )
        await self.peers.start()
        await self.card.start()
        self._housekeeper = asyncio.create_task(self._housekeep(), name="dispatcher-housekeeping")
        try:
            # The gateways' answers are registrations: they bring the served queues here.
            await self.bus.publish_roll_call()
        except Exception as exc:
            # They re-register every register tick anyway.
            logger.warning("dispatcher.roll_call_failed error=%r", exc)
        logger.info("dispatcher.started instance=%s", self.instance_id)

    async def stop(self) -> None:
        """Stop dispatching, give every owned queue up, and tell its gateways.

        The ``owner_changed`` announcement makes gateways re-register at once, which lets
        another instance claim the queue without waiting for the key to expire.
        """
        if not self._running:
            return
        self._running = False
        await self.card.stop()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        await cancel_and_wait([self._housekeeper, *self._tasks])
        self._housekeeper = None
        queues = list(self._queues.items())
        self._queues.clear()
        for _, qd in queues:
            qd.close()
        await asyncio.gather(*(qd.wait_closed() for _, qd in queues))
        await self.leaser.aclose()
        if self._keeper is not None:
            await self._keeper.stop(release=True)
            self._keeper = None
        with contextlib.suppress(Exception):
            for name, _ in queues:
                await self.bus.publish_owner_changed(name)
            await self._nc.flush()
        if self.peers is not None:
            # Last: beating until the keys are given up, then a goodbye, so that no peer
            # takes this one for dead (and looks for keys it no longer holds).
            await self.peers.stop()
            self.peers = None
        with contextlib.suppress(Exception):
            await self._nc.flush()
        logger.info("dispatcher.stopped instance=%s released=%d", self.instance_id, len(queues))

    # ------------------------------------------------------------- messages

    # A queue owned or being claimed here was checked when it was wanted, so only the
    # others are: the check costs more than the rest of a wake's handling.
    @staticmethod
    def _valid(queue: str) -> bool:
        try:
            check_queue(queue)
        except InvalidTask:
            logger.debug("dispatcher.bad_queue queue=%r", queue)
            return False
        return True

    def _on_wake(self, wake: cluster_pb2.Wake) -> None:
        queue = wake.queue
        qd = self._queues.get(queue)
        if qd is not None:
            qd.wake()
        elif self.demand.served(queue, self._now()) and self._valid(queue):
            # Served here or elsewhere: if its owner left, this claim takes over.
            self._want(queue, None)
        # Else nobody serves the queue: its work waits for a worker, whose gateway's
        # registration will bring the queue a dispatcher.

    def _on_register(self, reg: cluster_pb2.Register) -> None:
        if not reg.gateway:
            return
        queue = reg.queue
        self.demand.heard(queue, reg.gateway, closing=reg.closing, now=self._now())
        qd = self._queues.get(queue)
        if qd is not None:
            qd.register(reg)
        elif queue in self._claiming:
            self._claiming[queue].append(reg)
        elif not reg.closing and self._valid(queue):
            self._want(queue, reg)

    def _on_done(self, done: cluster_pb2.Done) -> None:
        qd = self._queues.get(done.queue)
        if qd is not None:
            qd.done(done)

    def _on_groups_due(self, due: cluster_pb2.GroupsDue) -> None:
        qd = self._queues.get(due.queue)
        if qd is not None:
            qd.groups_due(due)
        elif self.demand.served(due.queue, self._now()) and self._valid(due.queue):
            self._want(due.queue, None)  # as a wake: the next sweep hints the new owner

    def _on_control(self, control: cluster_pb2.Control) -> None:
        qd = self._queues.get(control.queue)
        if qd is not None:
            self._spawn(self._reload(qd))

    def _on_owner(self, queue: str) -> None:
        if (
            queue not in self._queues
            and self.demand.served(queue, self._now())
            and self._valid(queue)
        ):
            # The owner changed or left. Try at once: if it left, this claim is the
            # hand-over (whatever order the gateways' re-registrations arrive in); if
            # another instance just claimed, it costs one refused create.
            self._refused_until.pop(queue, None)
            self._want(queue, None)

    async def _reload(self, qd: QueueDispatcher) -> None:
        try:
            await qd.reload()
        except Exception as exc:
            logger.warning("dispatcher.reload_failed queue=%s error=%r", qd.queue, exc)

    # ------------------------------------------------------------ ownership

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _may_claim(self, queue: str) -> bool:
        """False while ``queue`` is owned here, being claimed, was refused a moment ago, or
        was given up here as stuck a moment ago."""
        if not self._running or queue in self._queues or queue in self._claiming:
            return False
        now = self._now()
        return (
            self._refused_until.get(queue, 0.0) <= now
            and self._abandoned_until.get(queue, 0.0) <= now
        )

    def _want(self, queue: str, reg: cluster_pb2.Register | None) -> None:
        """Try to claim ``queue`` in the background, unless a claim is in flight or was
        refused a moment ago."""
        if not self._may_claim(queue):
            return
        self._claiming[queue] = [reg] if reg is not None else []
        self._spawn(self._claim(queue))

    async def _claim(self, queue: str, revision: int | None = None) -> None:
        try:
            await self._try_claim(queue, revision)
        except Exception:
            logger.exception("dispatcher.claim_failed queue=%s", queue)
        finally:
            self._claiming.pop(queue, None)

    async def _try_claim(self, queue: str, revision: int | None = None) -> None:
        """Claim ``queue`` (with ``revision``: take it over from a dead owner whose last
        write that was), then open it and announce it."""
        keeper = self._keeper
        if keeper is None:
            return
        if revision is None:
            claimed = await keeper.claim(queue)
        else:
            claimed = await keeper.take_over(queue, revision)
        if not claimed:
            self._refused_until[queue] = self._now() + self._claim_retry
            self.claims_refused += 1
            return
        qd = QueueDispatcher(
            queue,
            broker=self._broker,
            bus=self.bus,
            config=self._config,
            leaser=self.leaser,
            clock=self.clock,
        )
        try:
            await qd.open()
        except Exception as exc:
            logger.warning("dispatcher.open_failed queue=%s error=%r", queue, exc)
            await keeper.release(queue)
            self._refused_until[queue] = self._now() + self._claim_retry
            return
        if not self._running or not keeper.holds(queue):
            await keeper.release(queue)
            return
        self._queues[queue] = qd
        self._refused_until.pop(queue, None)
        for reg in self._claiming.pop(queue, []):
            qd.register(reg)
        if revision is not None:
            self.taken_over += 1
        metrics.OWNERSHIP.labels("claimed").inc()
        logger.info(
            "dispatcher.queue_claimed queue=%s instance=%s paused=%s taken_over=%s",
            queue,
            self.instance_id,
            qd.paused,
            revision is not None,
        )
        await self.bus.publish_owner_changed(queue)
        qd.wake()

    def _on_peer_dead(self, peer: str) -> None:
        if self._running:
            self._spawn(self._take_over_from(peer))

    async def _take_over_from(self, peer: str) -> None:
        """Take over every queue the dead ``peer`` held (each key with a compare-and-set
        on its last revision: of several survivors, one gets each)."""
        keeper = self._keeper
        if keeper is None:
            return
        try:
            held = await held_by(keeper.kv, peer)
        except Exception as exc:
            # Its keys expire within owner_ttl, and wakes and registrations bring the
            # queues here then, as without peer beats.
            logger.warning("dispatcher.take_over_scan_failed peer=%s error=%r", peer, exc)
            return
        logger.warning(
            "dispatcher.taking_over peer=%s queues=%d instance=%s",
            peer,
            len(held),
            self.instance_id,
        )
        room = asyncio.Semaphore(TAKE_OVER_CONCURRENCY)

        async def one(queue: str, revision: int) -> None:
            async with room:
                # A refusal a moment ago was the dead peer's key: try again now.
                self._refused_until.pop(queue, None)
                if not self._valid(queue) or not self._may_claim(queue):
                    return
                self._claiming[queue] = []
                await self._claim(queue, revision)

        await asyncio.gather(*(one(queue, revision) for queue, revision in held.items()))

    def _on_lost(self, queue: str) -> None:
        qd = self._queues.pop(queue, None)
        if qd is not None:
            qd.close()
            metrics.OWNERSHIP.labels("lost").inc()
            logger.warning("dispatcher.queue_lost queue=%s instance=%s", queue, self.instance_id)

    async def _give_up(self, queue: str) -> None:
        qd = self._queues.pop(queue, None)
        if qd is None:
            return
        qd.close()
        if self._keeper is not None:
            await self._keeper.release(queue)
        metrics.OWNERSHIP.labels("released").inc()
        logger.info("dispatcher.queue_released queue=%s reason=idle", queue)

    async def _abandon(self, queue: str, spent: float) -> None:
        """Give up a queue whose cycle is stuck: cancel the cycle, release the key, and
        announce it, so that another instance claims it at once. This one does not claim
        it back for a progress deadline."""
        qd = self._queues.pop(queue, None)
        if qd is None:
            return
        logger.warning(
            "dispatcher.queue_abandoned queue=%s instance=%s reason=stuck seconds=%.1f",
            queue,
            self.instance_id,
            spent,
        )
        qd.abandon()
        self.abandoned += 1
        # Not _refused_until: an owner change (our own announcement, first of all)
        # clears that, and this instance, still stuck, would win the queue back.
        self._abandoned_until[queue] = self._now() + self.settings.progress_deadline
        if self._keeper is not None:
            await self._keeper.release(queue)
        await self.bus.publish_owner_changed(queue)

    async def _after_reconnect(self) -> None:
        """When the NATS link was re-established: ask the gateways of every owned queue to
        register again (the Dones and registrations in flight through the server that
        went away are lost, and without them the gateways' credits stay spent until the
        next register tick), and call the roll, as at start (the wakes sent meanwhile are lost,
        and the queues given up while NATS did not answer have no owner: the gateways'
        answers bring every served one back)."""
        reconnects = int(self._nc.stats.get("reconnects", 0))
        if reconnects == self._reconnects:
            return
        self._reconnects = reconnects
        queues = list(self._queues)
        logger.info(
            "dispatcher.nats_reconnected instance=%s queues=%d", self.instance_id, len(queues)
        )
        for queue in queues:
            await self.bus.publish_owner_changed(queue)
        try:
            # As at start: the gateways' registrations bring back every served queue.
            await self.bus.publish_roll_call()
        except Exception as exc:
            logger.warning("dispatcher.roll_call_failed error=%r", exc)

    async def _housekeep(self) -> None:
        while True:
            await asyncio.sleep(self._housekeeping_tick)
            try:
                await self._after_reconnect()
                for queue, qd in list(self._queues.items()):
                    spent = qd.stuck()
                    if spent is not None:
                        await self._abandon(queue, spent)
                        continue
                    qd.expire_registrations()
                    if qd.idle():
                        await self._give_up(queue)
                now = self._now()
                self.demand.expire(now)
                for pauses in (self._refused_until, self._abandoned_until):
                    for queue, until in list(pauses.items()):
                        if until <= now:
                            del pauses[queue]
            except Exception:
                logger.exception("dispatcher.housekeeping_failed")
