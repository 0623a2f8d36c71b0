"""WebhookManager: the cluster singleton that runs one WebhookGateway per registration.

Every webhook instance runs a manager; only the holder of the ``webhook-manager`` key in
the leaders bucket runs gateways, the others try to claim the key every
``leader_ttl / 2``. The leader reconciles every ``reconcile_tick``: it lists the stored
registrations and converges onto them.

- An active registration (not paused, with at least one secret) with no gateway gets one.
- A changed url, timeout or secret list is taken by the running gateway in place.
- Changed queues, concurrency or batch types restart it: drain the old gateway, then
  start a new one (a new gateway id).
- A registration paused, deleted or left without a secret has its gateway drained.
- Secrets are stored sealed (:mod:`conveyor_runtime.webhook_secrets`); the manager opens
  them with the keyring of its settings and hands its gateways the opened ones. One whose
  secrets do not open (their key is not configured, or is not the one they were sealed
  with) gets no gateway, and the error, naming the key id, is logged once.
- Upkeep: secrets stored in plaintext (from before encryption) or sealed with a key
  other than the newest are sealed again under the newest key, with a compare-and-set
  (:meth:`~conveyor_broker.interface.Broker.replace_webhook_secrets`) so that an
  operator's concurrent edit always wins. That is the upgrade path and key rotation.

Draining lets the parked (accepted, asynchronous) deliveries go with no broker call,
since their endpoints are still working on them; waits for open synchronous deliveries
(up to the registration's timeout); and releases everything else. Drains run in the
background, so a slow endpoint never holds up the reconcile of the others; a
registration whose old gateway is still draining gets its new one from the reconcile
that follows the drain. Losing leadership, or :meth:`WebhookManager.stop`, drains every
gateway.

Callbacks: the leader answers the callbacks of every stored registration, paused ones
included (:meth:`~conveyor_runtime.bus.Bus.serve_webhook_callbacks`, queue group
``webhook``): through the running gateway when there is one (a heartbeat for a delivery it
does not hold adopts it), else through a
:class:`~conveyor_webhook.callbacks.CallbackResponder` (lease-scoped broker calls). A deleted registration's callbacks get no answer (the api refuses its tokens
anyway).

An operator's cancel of a running task (the ``CancelBroadcast`` every gateway hears)
reaches the gateway holding it, which aborts that task's HTTP request if still in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import Any

from conveyor_broker import Broker, WebhookWorker
from conveyor_broker.clock import Clock, SystemClock
from conveyor_gateway import (
    AckBatcher,
    BreakerConfigs,
    GatewayConfig,
    ResolvePublisher,
    WakePublisher,
)
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime import metrics
from conveyor_runtime.bus import Bus
from conveyor_runtime.cluster_key import ClusterAuth
from conveyor_runtime.cluster_view import NodeCard
from conveyor_runtime.health import Health
from conveyor_runtime.ownership import LeaseKeeper, open_lease_bucket
from conveyor_runtime.settings import WebhookSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.tasks import cancel_and_wait
from conveyor_runtime.webhook_secrets import KEY_SETTING, SecretKeyError, is_sealed
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from conveyor_webhook.callbacks import CallbackResponder, Handler, Status
from conveyor_webhook.config import WebhookConfig, Wiring
from conveyor_webhook.gateway import WebhookGateway
from conveyor_webhook.http import ResolverFactory

logger = logging.getLogger(__name__)

#: The manager's key in the leaders bucket.
ROLE = "webhook-manager"


def is_active(worker: WebhookWorker) -> bool:
    """True when ``worker`` should have a running gateway: not paused, and a secret."""
    return not worker.paused and bool(worker.secrets)


def needs_restart(running: WebhookWorker, stored: WebhookWorker) -> bool:
    """True when a running gateway cannot take ``stored`` in place (queues, concurrency,
    batch types: what its registrations announce)."""
    return (
        dict(running.queues) != dict(stored.queues)
        or running.concurrency != stored.concurrency
        or set(running.batch_types) != set(stored.batch_types)
    )


@dataclass(slots=True)
class _Callbacks:
    """The callback subscription of one registration, and who answers when no gateway
    of it runs."""

    sub: Subscription
    responder: CallbackResponder


class WebhookManager:
    """Runs the gateways of every active registration while this instance leads."""

    def __init__(
        self,
        settings: WebhookSettings,
        broker: Broker,
        nc: NATS,
        clock: Clock | None = None,
        *,
        resolver: ResolverFactory | None = None,
        health: Health | None = None,
    ) -> None:
        """``resolver`` makes the resolver of each gateway's HTTP session (None: aiohttp's
        own; tests give their own); ``health``: the process's signals (the leaders bucket
        reports to them)."""
        self.settings = settings
        self._health = health
        self.keyring = settings.secret_keyring()
        self.instance_id = settings.instance_id
        self.subjects = Subjects(settings.subject_prefix)
        self.clock: Clock = clock or SystemClock()
        self._broker = broker
        self._nc = nc
        self.bus = Bus(nc, self.subjects, ClusterAuth.from_settings(settings))
        self.config = WebhookConfig(
            gateway=GatewayConfig(
                lease_ttl=settings.lease_ttl_delta,
                register_tick=settings.register_tick,
                max_result=settings.max_result,
                clock=self.clock,
            ),
            callback_address=settings.callback_address,
            breaker_threshold=settings.breaker_threshold,
            breaker_cooldown=settings.breaker_cooldown,
            policy=settings.address_policy(),
            resolver=resolver,
        )
        #: The last secrets problem logged per registration (logged again on a change).
        self._secret_problems: dict[str, str] = {}
        #: The running gateways, by registration name.
        self.gateways: dict[str, WebhookGateway] = {}
        self.reconciles = 0
        self._keeper: LeaseKeeper | None = None
        self._loop: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        #: What the gateways and callback responders share (from :meth:`start` on).
        self._wiring: Wiring | None = None
        self._retiring: dict[str, tuple[WebhookGateway, asyncio.Task[None]]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._callbacks: dict[str, _Callbacks] = {}
        self._answering: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._cancel_sub: Subscription | None = None
        self._resolves: ResolvePublisher | None = None
        #: This instance in the cluster view: its role and its webhook workers' gateways.
        self.card = NodeCard(
            self.bus, kind="webhook", instance=settings.instance_id, fill=self._describe
        )

    def _describe(self, node: service_pb2.ClusterNode) -> None:
        if self.leading:
            node.leader_roles.append(ROLE)
        now = asyncio.get_running_loop().time()
        for name, gateway in sorted(self.gateways.items()):
            worker = gateway.worker
            node.webhook_gateways.append(
                service_pb2.WebhookGatewayInfo(
                    worker=name,
                    node=self.instance_id,
                    queues=dict(worker.queues),
                    concurrency=worker.concurrency,
                    in_flight=gateway.gateway.in_flight,
                    breaker=gateway.breaker.state(now).value,
                    paused=worker.paused,
                )
            )

    # -------------------------------------------------------------- lifecycle

    @property
    def leading(self) -> bool:
        """True while this instance holds the webhook-manager role."""
        return self._keeper is not None and self._keeper.holds(ROLE)

    @property
    def draining(self) -> frozenset[str]:
        """Registrations whose (old) gateway is draining right now."""
        return frozenset(self._retiring)

    @property
    def answering(self) -> frozenset[str]:
        """Registrations whose callbacks this instance answers right now."""
        return frozenset(self._callbacks)

    async def settled(self) -> None:
        """Wait until no gateway is draining and the reconciles that follow drains ran.

        Not for the manager's own background tasks (they would wait for themselves).
        """
        while self._retiring or self._background:
            pending = [task for _, task in self._retiring.values()]
            await asyncio.gather(*pending, *self._background, return_exceptions=True)

    async def _drains_done(self) -> None:
        while self._retiring:
            await asyncio.gather(
                *(task for _, task in self._retiring.values()), return_exceptions=True
            )

    async def start(self) -> None:
        """Open the leaders bucket and start the leadership/reconcile loop. On failure
        (or cancellation) what was set up is taken down again before the error
        propagates."""
        if self._keeper is not None:
            return
        self._wiring = Wiring(
            broker=self._broker,
            bus=self.bus,
            config=self.config,
            acks=AckBatcher(self._broker),
            wakes=WakePublisher(self.bus),
            breakers=BreakerConfigs(self._broker, bus=self.bus),
        )
        assert self._wiring.breakers is not None
        await self._wiring.breakers.start()
        # The ends of tasks others wait for (its gateways' acks and failures) go to the
        # resolver.
        self._resolves = ResolvePublisher(self.bus, self._wiring.wakes)
        self._resolves.attach(self._broker)
        try:
            kv = await open_lease_bucket(
                self._nc,
                self.subjects.leaders_bucket,
                self.settings.leader_ttl,
                replicas=self.settings.nats_replicas,
                health=self._health,
            )
            self._cancel_sub = await self.bus.subscribe(
                cluster_pb2.CancelBroadcast, self._on_cancel_broadcast
            )
            keeper = LeaseKeeper(kv, self.instance_id, self.settings.leader_ttl, self._on_lost)
            await keeper.start()
            await self.card.start()
        except BaseException:
            await self._close_shared()
            raise
        self._keeper = keeper
        self._loop = asyncio.create_task(self._lead(), name="webhook-manager")
        logger.info("webhook.manager_started instance=%s", self.instance_id)

    async def stop(self) -> None:
        """Drain every gateway, stop answering callbacks, then give the role up so
        another instance takes over."""
        self._stopping = True
        if self._loop is not None:
            await cancel_and_wait([self._loop])
            self._loop = None
        await self._stop_all()
        await self.settled()
        await self._close_shared()
        logger.info("webhook.manager_stopped instance=%s", self.instance_id)

    async def _close_shared(self) -> None:
        await self.card.stop()
        await self._drop_callbacks()
        if self._answering:
            await asyncio.gather(*self._answering, return_exceptions=True)
        if self._cancel_sub is not None:
            try:
                await self._cancel_sub.unsubscribe()
            except Exception as exc:  # the connection may be gone already
                logger.debug("webhook.unsubscribe_failed error=%r", exc)
            self._cancel_sub = None
        if self._keeper is not None:
            await self._keeper.stop(release=True)
            self._keeper = None
        if self._wiring is not None:
            if self._wiring.breakers is not None:
                await self._wiring.breakers.aclose()
            await self._wiring.acks.aclose()
            if self._resolves is not None:
                self._resolves.detach(self._broker)
                await self._resolves.aclose()
                self._resolves = None
            await self._wiring.wakes.aclose()

    def _on_cancel_broadcast(self, request: cluster_pb2.CancelBroadcast) -> None:
        if request.task_id:
            reason = request.reason or "canceled by an operator"
            gateways = [*self.gateways.values(), *(g for g, _ in self._retiring.values())]
            for gateway in gateways:
                if gateway.gateway.cancel(request.task_id, reason):
                    break

    def _on_lost(self, role: str) -> None:
        metrics.LEADERSHIP.labels(role, "lost").inc()
        logger.warning("webhook.leadership_lost role=%s instance=%s", role, self.instance_id)
        self._in_background(self._stop_all())

    async def _lead(self) -> None:
        retry = self.settings.leader_ttl / 2
        while True:
            keeper = self._keeper
            if keeper is None:
                return
            if not keeper.holds(ROLE):
                if self.gateways or self._callbacks:
                    await self._stop_all()
                try:
                    elected = await keeper.claim(ROLE)
                except Exception:
                    logger.exception("webhook.claim_failed")
                    elected = False
                if not elected:
                    await asyncio.sleep(retry)
                    continue
                metrics.LEADERSHIP.labels(ROLE, "won").inc()
                logger.info("webhook.leader_elected instance=%s", self.instance_id)
            try:
                await self.reconcile()
            except Exception:
                logger.exception("webhook.reconcile_failed")
            try:
                await self.reseal()
            except Exception:
                logger.exception("webhook.reseal_failed")
            await asyncio.sleep(self.settings.reconcile_tick)

    # -------------------------------------------------------------- reconcile

    async def reconcile(self) -> None:
        """Converge the running gateways and the callback subscriptions onto the stored
        registrations (see the module docstring); drains it starts go on in the
        background (:meth:`settled` waits for them). Not leading: drain every gateway
        instead, and stop answering callbacks. A broker failure propagates and changes
        nothing."""
        async with self._lock:
            if not self.leading or self._stopping:
                self._retire_all()
                await self._drop_callbacks()
                return
            stored = await self._broker.list_webhook_workers()
            self.reconciles += 1
            await self._answer_for(stored)
            desired = {w.name: w for w in self._opened(stored) if is_active(w)}
            for name, gateway in list(self.gateways.items()):
                worker = desired.get(name)
                if worker is None or needs_restart(gateway.worker, worker):
                    self._retire(gateway)
                else:
                    gateway.refresh(worker)
            for name, worker in desired.items():
                # One whose old gateway still drains starts when that drain is over.
                if name not in self.gateways and name not in self._retiring:
                    await self._start(worker)

    def _opened(self, stored: list[WebhookWorker]) -> list[WebhookWorker]:
        """The ``stored`` registrations whose secrets open, with their secrets opened."""
        opened: list[WebhookWorker] = []
        names = {worker.name for worker in stored}
        for gone in [name for name in self._secret_problems if name not in names]:
            del self._secret_problems[gone]
        for worker in stored:
            try:
                secrets = self.keyring.open_all(worker.name, worker.secrets)
            except SecretKeyError as exc:
                self._secret_problem(worker.name, "webhook.secrets_unusable", str(exc))
                continue
            if any(not is_sealed(value) for value in worker.secrets) and not self.keyring.keys:
                self._secret_problem(
                    worker.name,
                    "webhook.secrets_plaintext",
                    f"the secrets of webhook worker {worker.name!r} are stored in plaintext: "
                    f"set {KEY_SETTING} on the api and the webhook service to encrypt them",
                    level=logging.WARNING,
                )
            else:
                self._secret_problems.pop(worker.name, None)
            opened.append(replace(worker, secrets=secrets))
        return opened

    def _secret_problem(
        self, name: str, event: str, problem: str, level: int = logging.ERROR
    ) -> None:
        """Log ``problem`` of registration ``name`` unless it was the last one logged."""
        if self._secret_problems.get(name) != problem:
            self._secret_problems[name] = problem
            logger.log(level, "%s worker=%s problem=%s", event, name, problem)

    async def reseal(self) -> int:
        """Seal again, under the newest key, every stored secret that is plaintext or
        sealed with an older key (a registration whose secrets do not open is left
        alone); how many registrations were resealed. An operator's edit meanwhile wins:
        that registration is left for the next pass."""
        if not self.keyring.keys:
            return 0
        done = 0
        for worker in await self._broker.list_webhook_workers():
            if not self.keyring.stale(worker.secrets):
                continue
            try:
                secrets = self.keyring.open_all(worker.name, worker.secrets)
            except SecretKeyError:
                continue  # logged by the reconcile
            sealed = self.keyring.seal_all(worker.name, secrets)
            if await self._broker.replace_webhook_secrets(worker.name, worker.secrets, sealed):
                done += 1
                logger.info(
                    "webhook.secrets_resealed worker=%s key=%s", worker.name, self.keyring.primary
                )
        return done

    def _wired(self) -> Wiring:
        if self._wiring is None:
            raise RuntimeError("the webhook manager is not started")
        return self._wiring

    async def _start(self, worker: WebhookWorker) -> None:
        gateway = WebhookGateway(worker, self._wired())
        try:
            # A failed (or canceled) start drains what it started before raising.
            await gateway.start()
        except Exception:
            logger.exception("webhook.gateway_start_failed worker=%s", worker.name)
            return
        self.gateways[worker.name] = gateway

    def _retire(self, gateway: WebhookGateway) -> None:
        """Retire ``gateway`` now and drain it in the background; a reconcile follows."""
        name = gateway.name
        if self.gateways.get(name) is gateway:
            del self.gateways[name]
        logger.info("webhook.draining worker=%s gateway=%s", name, gateway.id)
        gateway.retire()
        task = asyncio.get_running_loop().create_task(gateway.drain())
        self._retiring[name] = (gateway, task)

        def drained(done: asyncio.Task[None]) -> None:
            if self._retiring.get(name, (None, None))[1] is done:
                del self._retiring[name]
            if not done.cancelled() and done.exception() is not None:
                logger.error("webhook.drain_failed worker=%s", name, exc_info=done.exception())
            if not self._stopping and self.leading:
                self._in_background(self._reconcile_quietly())

        task.add_done_callback(drained)

    def _retire_all(self) -> None:
        for gateway in list(self.gateways.values()):
            self._retire(gateway)

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reconcile_quietly(self) -> None:
        try:
            await self.reconcile()
        except Exception:
            logger.exception("webhook.reconcile_failed")

    async def _stop_all(self) -> None:
        """Drain every gateway, wait for every drain, then stop answering callbacks
        (until then the parked deliveries the drains let go are still answered)."""
        async with self._lock:
            self._retire_all()
        await self._drains_done()
        async with self._lock:
            if self._stopping or not self.leading:
                await self._drop_callbacks()

    # -------------------------------------------------------------- callbacks

    async def _answer_for(self, stored: list[WebhookWorker]) -> None:
        """Answer the callbacks of exactly the ``stored`` registrations."""
        wiring = self._wired()
        by_name = {w.name: w for w in stored}
        for name in [n for n in self._callbacks if n not in by_name]:
            await self._drop_callback(name)
        for name, worker in by_name.items():
            route = self._callbacks.get(name)
            if route is not None:
                route.responder.refresh(worker)
                continue
            responder = CallbackResponder(worker, wiring)
            sub = await self.bus.serve_webhook_callbacks(
                name, self._answerer(name), spawn=self._answering_task
            )
            self._callbacks[name] = _Callbacks(sub, responder)

    def _answering_task(self, answer: Coroutine[Any, Any, None]) -> None:
        # One task per callback: a slow broker call must not hold up the others.
        task = asyncio.get_running_loop().create_task(answer)
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    def _answerer(self, name: str) -> Handler:
        """What answers the callbacks of registration ``name`` (never raises)."""

        async def handle(callback: cluster_pb2.WebhookCallback) -> Status:
            gateway = self.gateways.get(name)
            if gateway is not None and gateway.serving:
                return await gateway.handle_callback(callback)
            route = self._callbacks.get(name)
            if route is None:  # deleted meanwhile
                return Status(status=Status.STATUS_LEASE_LOST, message="lease lost")
            return await route.responder.handle_callback(callback)

        return handle

    async def _drop_callback(self, name: str) -> None:
        route = self._callbacks.pop(name, None)
        if route is None:
            return
        try:
            await route.sub.unsubscribe()
        except Exception as exc:  # the connection may be gone already
            logger.debug("webhook.unsubscribe_failed worker=%s error=%r", name, exc)

    async def _drop_callbacks(self) -> None:
        for name in list(self._callbacks):
            await self._drop_callback(name)
