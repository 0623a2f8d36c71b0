"""Circuit breakers per task type, as a gateway runs them (the rules are
:mod:`conveyor_broker.breakers`).

Each gateway counts the failed attempts of each (queue, type) that has a config
(:class:`BreakerConfigs`, one cache per process). When a breaker opens:

* **WORKER scope**: the gateway takes no task of that type for the cool-down. It says so
  to the dispatcher in every registration and dispatch reply (``blocked_types``), so the
  dispatcher leases it none (and a task of that type it is offered anyway is refused).
  Once the cool-down is over the type is announced again; the first task of it the
  gateway takes is the probe, and the type is blocked again until the probe's outcome
  closes the breaker or opens it again.
* **QUEUE scope**: the gateway stores the breaker queue-wide in the broker and sends the
  queue's dispatchers a ``Control``; they lease that type to nobody until its cool-down
  is over, then one of them takes the probe (``Broker.take_probe``) and leases one task
  of the type marked ``probe``. Whichever gateway holds the probe closes the breaker
  (drops the row) or opens it again with its outcome.

Every change is stored for the operator (``Broker.put_breaker`` / ``drop_breaker``: queue
stats and ``conveyor breakers status`` show it) and published as a breaker event on the
queue's event stream. Storing is best effort (logged when it fails): what decides for a
WORKER-scope breaker is the gateway's memory, and a failed write of a QUEUE-scope one
only leaves that type flowing.

Metrics: each opening and closing counts in ``conveyor_type_breaker_transitions_total``,
and the states are read from the gateways' memory at scrape time
(:meth:`Breakers.states`, ``conveyor_type_breaker_state``): nothing on the dispatch path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable, Coroutine, Sequence
from datetime import datetime, timedelta
from typing import Any

from conveyor_broker import Breaker, BreakerConfig, BreakerScope, BreakerStatus, Broker
from conveyor_broker.breakers import BreakerMachine, config_for
from conveyor_broker.clock import Clock
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime import metrics
from conveyor_runtime.bus import Bus
from conveyor_runtime.wire.breakers import breaker_to_proto
from nats.aio.subscription import Subscription

from conveyor_gateway.holdings import Held

logger = logging.getLogger(__name__)

#: Seconds between reloads of the breaker configs.
CONFIG_REFRESH = 2.0


class BreakerConfigs:
    """The breaker configs of every queue, as one process's gateways see them: loaded
    from the broker at :meth:`start`, again as soon as a ``Control`` with reason
    ``breakers`` comes on the ``bus`` (the api sends one with every change), and every
    ``refresh`` seconds anyway (should that message be lost); or at once with
    :meth:`reload`.
    """

    def __init__(
        self, broker: Broker, *, bus: Bus | None = None, refresh: float = CONFIG_REFRESH
    ) -> None:
        self._broker = broker
        self._bus = bus
        self._refresh = refresh
        self._by_queue: dict[str, list[BreakerConfig]] = {}
        self._memo: dict[tuple[str, str], BreakerConfig | None] = {}
        self._task: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None
        self._changed = asyncio.Event()

    def for_type(self, queue: str, task_type: str) -> BreakerConfig | None:
        """The config of ``task_type`` on ``queue`` (None: it has no breaker)."""
        configs = self._by_queue.get(queue)
        if not configs:
            return None
        key = (queue, task_type)
        try:
            return self._memo[key]
        except KeyError:
            found = self._memo[key] = config_for(task_type, configs)
            return found

    def set(self, configs: Sequence[BreakerConfig]) -> None:
        """Put ``configs`` in force (what :meth:`reload` does with the broker's)."""
        by_queue: dict[str, list[BreakerConfig]] = {}
        for config in configs:
            by_queue.setdefault(config.queue, []).append(config)
        self._by_queue = by_queue
        self._memo = {}

    async def reload(self) -> None:
        """Read the configs from the broker now."""
        self.set(await self._broker.list_breaker_configs())

    async def start(self) -> None:
        """Load the configs, then keep reloading them."""
        if self._bus is not None:
            self._sub = await self._bus.subscribe(cluster_pb2.Control, self._on_control)
        try:
            await self.reload()
        except Exception as exc:
            logger.warning("breakers.configs_load_failed error=%r", exc)
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def _on_control(self, control: cluster_pb2.Control) -> None:
        if control.reason == "breakers":
            self._changed.set()

    async def _loop(self) -> None:
        while True:
            # Changes that come while a reload runs coalesce into the next one. (Not
            # asyncio.wait_for: on 3.11 it can swallow a cancellation that comes as the
            # event is set, and this loop would never end.)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._refresh):
                    await self._changed.wait()
            self._changed.clear()
            try:
                await self.reload()
            except Exception as exc:
                logger.warning("breakers.configs_load_failed error=%r", exc)

    async def aclose(self) -> None:
        """Stop reloading."""
        if self._sub is not None:
            with contextlib.suppress(Exception):  # the connection may be gone already
                await self._sub.unsubscribe()
            self._sub = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=5)
            self._task = None


class Breakers:
    """The circuit breakers of one gateway (see the module docstring).

    ``announce(queue)`` re-announces the queue's slots (its blocked types changed);
    ``spawn`` runs the broker writes and event publishes in the background.
    """

    def __init__(
        self,
        gateway_id: str,
        *,
        configs: BreakerConfigs,
        broker: Broker,
        bus: Bus,
        clock: Clock,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        announce: Callable[[str], None],
        probe_lapse: timedelta,
        worker_id: str = "",
        holder: str = "",
    ) -> None:
        self._id = gateway_id
        self._configs = configs
        self._broker = broker
        self._bus = bus
        self._clock = clock
        self._spawn = spawn
        self._announce = announce
        self._probe_lapse = probe_lapse
        self._worker_id = worker_id
        self._holder = holder
        self._machines: dict[tuple[str, str], BreakerMachine] = {}
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        #: Queue-wide breakers this gateway opened, until their cool-down is over: its
        #: own later failures of the type (attempts that were running) do not count.
        self._queue_open: dict[tuple[str, str], datetime] = {}
        #: Breakers opened and closed here (for tests and metrics).
        self.opened = 0
        self.closed = 0
        #: Stops reporting this gateway's breakers to the metrics (None: not reported yet).
        self._unwatch: Callable[[], None] | None = None

    # ------------------------------------------------------------- dispatch

    def blocked(self, queue: str) -> list[str]:
        """The types of ``queue`` this gateway takes none of now, sorted: WORKER scope,
        open or half-open with the probe out; QUEUE scope, opened here and still cooling
        down (the dispatchers hear of it a moment later, and meanwhile this gateway at
        least takes no more of it)."""
        if not self._machines:
            return []
        now = self._clock.now()
        types = {
            task_type
            for (q, task_type), machine in self._machines.items()
            if q == queue
            and machine.config.scope is BreakerScope.WORKER
            and machine.status is not None
            and not machine.allows(now)
        }
        types.update(t for (q, t), until in self._queue_open.items() if q == queue and now < until)
        return sorted(types)

    def admit(self, queue: str, task_type: str, *, probe: bool = False) -> tuple[bool, bool]:
        """Whether a dispatched task of ``task_type`` may be taken (``probe``: the
        dispatcher sent it as a queue-wide breaker's probe), and whether it is then the
        probe of a half-open WORKER-scope breaker (the type is blocked again until its
        outcome)."""
        if self._queue_open and not probe:
            until = self._queue_open.get((queue, task_type))
            if until is not None and self._clock.now() < until:
                return False, False
        machine = self._machines.get((queue, task_type))
        if (
            machine is None
            or machine.status is None
            or machine.config.scope is not BreakerScope.WORKER
        ):
            return True, False
        now = self._clock.now()
        if not machine.allows(now):
            return False, False
        machine.probe_sent(now, self._probe_lapse)
        self._arm(queue, task_type, machine)
        self._spawn(self._store(queue, task_type, machine))
        self._announce(queue)
        return True, True

    # -------------------------------------------------------------- outcomes

    def record(self, held: Held, *, ok: bool) -> None:
        """The attempt ``held`` ended: succeeded (``ok``) or failed (a failure, a
        skip-retry, an attempt over its time)."""
        if not held.type:
            return
        key = (held.queue, held.type)
        config = self._configs.for_type(held.queue, held.type)
        machine = self._machines.get(key)
        if machine is None:
            if config is None:
                if held.probe:
                    # A queue-wide probe whose config was deleted meanwhile: the breaker
                    # has nothing left to guard.
                    self._spawn(self._close_queue_wide(held.queue, held.type))
                return
            if ok and not held.probe:
                return  # a success changes nothing on a closed breaker
            machine = self._machines[key] = BreakerMachine(config)
            self._watch()
        elif config is not None:
            machine.config = config  # changed meanwhile; a deleted one runs out as it is
        now = self._clock.now()
        if machine.config.scope is BreakerScope.QUEUE:
            self._record_queue_wide(held, machine, ok=ok, now=now)
            return
        changed = (
            machine.succeeded(now, probe=held.probe)
            if ok
            else machine.failed(now, probe=held.probe)
        )
        if not changed:
            return
        if machine.status is None:
            self.closed += 1
            self._transition(key, "closed")
            self._disarm(key)
            logger.info("gateway.breaker_closed gateway=%s queue=%s type=%s", self._id, *key)
            self._spawn(self._drop(held.queue, held.type, self._id))
            self._spawn(self._event(held.queue, held.type, machine, "closed"))
        else:
            self.opened += 1
            self._transition(key, "opened")
            logger.warning(
                "gateway.breaker_opened gateway=%s queue=%s type=%s failures=%d cooldown=%s",
                self._id,
                held.queue,
                held.type,
                machine.tripped_by,
                machine.config.cooldown,
            )
            self._arm(held.queue, held.type, machine)
            self._spawn(self._store(held.queue, held.type, machine))
            self._spawn(self._event(held.queue, held.type, machine, "open"))
        self._announce(held.queue)

    def _record_queue_wide(
        self, held: Held, machine: BreakerMachine, *, ok: bool, now: datetime
    ) -> None:
        key = (held.queue, held.type)
        config = machine.config
        if held.probe:
            if ok:
                self._queue_open.pop(key, None)
                self.closed += 1
                self._transition(key, "closed")
                logger.info(
                    "gateway.breaker_closed gateway=%s queue=%s type=%s scope=queue",
                    self._id,
                    *key,
                )
                self._spawn(self._close_queue_wide(held.queue, held.type))
            else:
                self._open_queue_wide(held, config, now, failures=1)
            return
        if ok:
            return
        until = self._queue_open.get(key)
        if until is not None and now < until:
            return  # an attempt that was running when it opened
        if machine.failed(now):
            # The broker's row decides from here on; this gateway counts afresh.
            failures = machine.tripped_by
            self._machines[key] = BreakerMachine(config)
            self._open_queue_wide(held, config, now, failures=failures)

    def _open_queue_wide(
        self, held: Held, config: BreakerConfig, now: datetime, *, failures: int
    ) -> None:
        key = (held.queue, held.type)
        until = now + config.cooldown
        self._queue_open[key] = until
        self._watch()
        self.opened += 1
        self._transition(key, "opened")
        logger.warning(
            "gateway.breaker_opened gateway=%s queue=%s type=%s failures=%d cooldown=%s "
            "scope=queue",
            self._id,
            held.queue,
            held.type,
            failures,
            config.cooldown,
        )
        breaker = Breaker(
            queue=held.queue,
            type=held.type,
            status=BreakerStatus.OPEN,
            opened_at=now,
            until=until,
            failures=failures,
        )
        self._spawn(self._open_in_broker(breaker))
        self._announce(held.queue)

    # ---------------------------------------------------------------- metrics

    def states(self) -> list[tuple[str, str, int]]:
        """``(queue, type, state)`` of every breaker of this gateway, ``state`` one of
        :data:`~conveyor_runtime.metrics.BREAKER_CLOSED`, ``BREAKER_HALF_OPEN`` and
        ``BREAKER_OPEN``: a WORKER-scope one as it stands (an open one whose cool-down
        is over is half-open), a QUEUE-scope one open while the cool-down it opened
        here lasts. Only reads (the metrics call it on their scrape thread)."""
        now = self._clock.now()
        rows: list[tuple[str, str, int]] = []
        for (queue, task_type), machine in list(self._machines.items()):
            status, until = machine.status, machine.until
            if status is BreakerStatus.OPEN and (until is None or now < until):
                state = metrics.BREAKER_OPEN
            elif status is not None:
                state = metrics.BREAKER_HALF_OPEN
            else:
                state = metrics.BREAKER_CLOSED
            rows.append((queue, task_type, state))
        for (queue, task_type), open_until in list(self._queue_open.items()):
            if now < open_until:
                rows.append((queue, task_type, metrics.BREAKER_OPEN))
        return rows

    def _watch(self) -> None:
        """Report this gateway's breakers to the metrics from its first one on (most
        gateways never have one); weakly, so a gateway never closed is not kept."""
        if self._unwatch is not None:
            return
        ref = weakref.WeakMethod(self.states)

        def states() -> list[tuple[str, str, int]]:
            method = ref()
            return method() if method is not None else []

        self._unwatch = metrics.watch_type_breakers(states)

    def _transition(self, key: tuple[str, str], event: str) -> None:
        queue, task_type = key
        metrics.TYPE_BREAKER.labels(metrics.QUEUE(queue), metrics.TYPE(task_type), event).inc()

    # ----------------------------------------------------------------- timers

    def _arm(self, queue: str, task_type: str, machine: BreakerMachine) -> None:
        """Re-announce the queue when the breaker's ``until`` comes (it goes half-open,
        or its probe's chance lapses)."""
        key = (queue, task_type)
        self._disarm(key)
        if machine.until is None:
            return
        delay = max(0.0, (machine.until - self._clock.now()).total_seconds())
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_later(delay, self._due, queue, task_type)

    def _disarm(self, key: tuple[str, str]) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def _due(self, queue: str, task_type: str) -> None:
        self._timers.pop((queue, task_type), None)
        self.tick(queue, task_type)

    def tick(self, queue: str, task_type: str) -> None:
        """The breaker's ``until`` came (the timer calls this; a test may too): an open
        breaker goes half-open and the type is announced again."""
        machine = self._machines.get((queue, task_type))
        if machine is None:
            return
        if machine.tick(self._clock.now()):
            logger.info(
                "gateway.breaker_half_open gateway=%s queue=%s type=%s",
                self._id,
                queue,
                task_type,
            )
            self._spawn(self._store(queue, task_type, machine))
            self._spawn(self._event(queue, task_type, machine, "half_open"))
        self._announce(queue)

    # ------------------------------------------------------------- lifecycle

    async def aclose(self) -> None:
        """Stop the timers and drop this gateway's stored breakers (they die with it)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        for (queue, task_type), machine in list(self._machines.items()):
            if machine.status is not None and machine.config.scope is BreakerScope.WORKER:
                await self._drop(queue, task_type, self._id)
        self._machines.clear()

    # --------------------------------------------------------------- broker

    def _stored(self, queue: str, task_type: str, machine: BreakerMachine) -> Breaker:
        """The breaker as stored (a closed one as it was when it closed)."""
        now = self._clock.now()
        return Breaker(
            queue=queue,
            type=task_type,
            status=machine.status or BreakerStatus.HALF_OPEN,
            opened_at=machine.opened_at or now,
            until=machine.until or now,
            failures=machine.tripped_by,
            gateway=self._id,
            worker_id=self._worker_id,
            holder=self._holder,
        )

    async def _store(self, queue: str, task_type: str, machine: BreakerMachine) -> None:
        if machine.status is None:
            return  # closed meanwhile
        try:
            await self._broker.put_breaker(self._stored(queue, task_type, machine))
        except Exception as exc:
            logger.warning(
                "gateway.breaker_store_failed gateway=%s queue=%s type=%s error=%r",
                self._id,
                queue,
                task_type,
                exc,
            )

    async def _drop(self, queue: str, task_type: str, gateway: str) -> None:
        try:
            await self._broker.drop_breaker(queue, task_type, gateway)
        except Exception as exc:
            logger.warning(
                "gateway.breaker_drop_failed gateway=%s queue=%s type=%s error=%r",
                self._id,
                queue,
                task_type,
                exc,
            )

    async def _open_in_broker(self, breaker: Breaker) -> None:
        try:
            await self._broker.put_breaker(breaker)
            await self._bus.publish(cluster_pb2.Control(queue=breaker.queue, reason="breakers"))
        except Exception as exc:
            logger.warning(
                "gateway.breaker_store_failed gateway=%s queue=%s type=%s error=%r",
                self._id,
                breaker.queue,
                breaker.type,
                exc,
            )
        await self._publish(breaker_to_proto(breaker))

    async def _close_queue_wide(self, queue: str, task_type: str) -> None:
        await self._drop(queue, task_type, "")
        try:
            await self._bus.publish(cluster_pb2.Control(queue=queue, reason="breakers"))
        except Exception as exc:
            logger.warning("gateway.breaker_control_failed queue=%s error=%r", queue, exc)
        now = self._clock.now()
        closed = Breaker(
            queue=queue,
            type=task_type,
            status=BreakerStatus.HALF_OPEN,
            opened_at=now,
            until=now,
            failures=0,
        )
        await self._publish(breaker_to_proto(closed), state="closed")

    async def _event(self, queue: str, task_type: str, machine: BreakerMachine, state: str) -> None:
        await self._publish(breaker_to_proto(self._stored(queue, task_type, machine)), state=state)

    async def _publish(self, pb: service_pb2.Breaker, *, state: str | None = None) -> None:
        """Publish the breaker event of ``pb`` (``state``: instead of its own)."""
        if state is not None:
            pb.state = state
        try:
            await self._bus.publish_breaker_event(pb)
        except Exception as exc:
            logger.warning(
                "gateway.breaker_event_failed queue=%s type=%s error=%r", pb.queue, pb.type, exc
            )
