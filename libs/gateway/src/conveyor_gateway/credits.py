"""How much work a gateway takes, and what it tells the dispatchers about it.

The worker's concurrency is split across its queues by weight
(:func:`~conveyor_gateway.capacity.split_capacity`). A dispatched task is accepted only
while its queue has a free slot *and* the gateway as a whole is under the concurrency in
force, whatever the dispatcher believes; so a stale or doubled dispatcher can never
overload a worker.

The dispatcher of each queue hears of the slots three ways: a ``Register`` per queue
(at start, every ``register_tick``, when the queue's owner changes, on a dispatcher's roll
call, when the concurrency is capped, and a closing one at the end), the
``DispatchReply`` to each offer, and a ``Done`` as soon as a slot is given back
(:class:`~conveyor_gateway.hints.DonePublisher`).
All three carry the running total of slots given back on the queue, so the dispatcher can
tell which Dones a reply already accounts for.

When the slots per queue add up to more than the concurrency (more queues than slots),
the queues *share* the gateway's room, and a freed slot goes to the queue whose turn it is
(:mod:`~conveyor_gateway.turns`): only that queue's dispatcher hears of it. A queue that
is not waiting keeps a standing credit of one (in its replies and registrations) while it
has a slot of its own, so new work there is offered at once: taken when there is room,
otherwise refused, and the queue joins the turns.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Collection, Coroutine
from dataclasses import replace
from typing import Any

from conveyor_broker.ids import is_ulid
from conveyor_broker.validation import MAX_WEBHOOK_CONCURRENCY
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.tracing import tracing_enabled
from nats.aio.subscription import Subscription

from conveyor_gateway.breakers import Breakers
from conveyor_gateway.capacity import capped_slots, split_capacity
from conveyor_gateway.config import WorkerSpec
from conveyor_gateway.hints import DonePublisher
from conveyor_gateway.holdings import Holdings
from conveyor_gateway.transport import Transport
from conveyor_gateway.turns import CallLater, Turns

logger = logging.getLogger(__name__)

#: The most slots a worker may have in all, however many it asks for with Credit frames
#: (the bound on a Hello's concurrency).
MAX_SLOTS = MAX_WEBHOOK_CONCURRENCY

#: Seconds a freed slot stays reserved for the queue whose turn it is, waiting for its
#: dispatcher's offer, before it passes to the next waiting queue.
TURN_TIMEOUT = 0.2

#: Why a worker is told to drop a task it holds when the same task is dispatched again.
REDELIVERED_REASON = "task was delivered again under a new lease"


class Credits:
    """The slots of gateway ``gateway_id``: what it accepts of a dispatch offer (holding
    it in ``holdings`` and handing it to ``transport``) and what it announces."""

    def __init__(
        self,
        gateway_id: str,
        spec: WorkerSpec,
        *,
        holdings: Holdings,
        transport: Transport,
        bus: Bus,
        register_tick: float,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        holder: str = "",
        turn_timeout: float = TURN_TIMEOUT,
        call_later: CallLater | None = None,
    ) -> None:
        self._id = gateway_id
        self._holder = holder
        self._spec = spec
        #: The worker's own slots per queue.
        self.capacity = split_capacity(spec.concurrency, spec.queues)
        # The concurrency in force and the per-queue slots announced: the worker's own,
        # unless cap() lowered them.
        self.limit = spec.concurrency
        self._slots = self.capacity
        #: Slots the worker opened (or closed, when negative) per queue with Credit{n},
        #: on top of its split; in force while no cap is.
        self.granted: Counter[str] = Counter()
        self._cap: int | None = None
        self._kept: Collection[str] = ()
        self._holdings = holdings
        self._held = holdings.by_lease
        self._per_queue = holdings.per_queue
        self._transport = transport
        self._bus = bus
        self._register_tick = register_tick
        self._spawn = spawn
        #: Slots given back (a Done per queue, coalesced).
        self.done = DonePublisher(bus, gateway_id)
        self._subs: list[Subscription] = []
        self._ticker: asyncio.Task[None] | None = None
        # True while a roll call's re-registration is pending (roll calls coalesce).
        self._answering = False
        self._started = False
        #: True once the gateway began closing: it takes nothing from then on.
        self.closed = False
        #: True while the gateway takes no new work (its backlog of outcomes to commit is
        #: full): every queue is announced with no slots and offers are refused.
        self.held_back = False
        #: True once the worker said it drains (it is shutting down): it takes nothing
        #: more for the rest of the session, while what it holds still completes.
        self.draining = False
        #: Whose turn a freed slot is while the queues share the gateway's room.
        self.turns = Turns(
            spec.queues, timeout=turn_timeout, on_lapse=self._pass_on, call_later=call_later
        )
        self._shared = self._sharing()
        #: The gateway's circuit breakers per task type (None: none configured here).
        self.breakers: Breakers | None = None

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Subscribe to dispatch offers, owner changes and roll calls, then announce the
        slots on every queue and keep re-announcing them."""
        bus = self._bus
        self._subs.append(await bus.serve_dispatch(self._id, self.answer))
        for queue in sorted(self.capacity):
            self._subs.append(
                await bus.subscribe_owner_changed(self._on_owner_changed, queue=queue)
            )
        self._subs.append(await bus.subscribe_roll_call(self._on_roll_call))
        # The dispatch subscription must be known to the server before a dispatcher
        # hears about us, or its first request finds no responder.
        await bus.nc.flush()
        self._started = True
        for queue in sorted(self.capacity):
            await self.register(queue)
        self._ticker = asyncio.get_running_loop().create_task(self._register_loop())

    async def stop(self) -> None:
        """Stop announcing and taking offers, and say goodbye on every queue (a closing
        Register). :attr:`closed` must be set already."""
        if self._ticker is not None:
            self._ticker.cancel()
        self.turns.clear()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection may already be gone
                logger.debug("gateway.unsubscribe_failed gateway=%s error=%r", self._id, exc)
        self._subs.clear()
        for queue in sorted(self.capacity):
            await self.register(queue, closing=True)

    # ----------------------------------------------------------------- slots

    def free(self, queue: str) -> int:
        """Slots the gateway can still take on ``queue``: its own free slots, within the
        gateway's room less what is reserved for other queues' turns."""
        if self.closed or self.held_back or self.draining or queue not in self.capacity:
            return 0
        by_queue = self._slots[queue] - self._per_queue[queue]
        overall = self.limit - len(self._held)
        turns = self.turns
        if turns.total_reserved:
            mine = turns.reserved[queue]
            overall = min(overall, mine + max(0, overall - turns.total_reserved))
        return max(0, min(by_queue, overall))

    def _room(self, queue: str) -> int:
        """``queue``'s own free slots, whatever the gateway's room."""
        return self._slots[queue] - self._per_queue[queue]

    def _sharing(self) -> bool:
        """True when the queues' slots add up to more than the concurrency in force."""
        return sum(self._slots.values()) > self.limit

    def offered(self, queue: str) -> int:
        """The credits to announce on ``queue`` (in a reply): its free slots, or, while
        the queues share the room, a standing credit of one when the queue is not waiting
        for a turn and has a slot of its own free (so new work is offered at once)."""
        free = self.free(queue)
        if (
            free == 0
            and self._shared
            and queue not in self.turns.waiting
            and not (self.closed or self.held_back or self.draining)
            and queue in self.capacity
            and self._room(queue) > 0
        ):
            return 1
        return free

    def freed(self, queue: str) -> None:
        """A slot of ``queue`` was given back: tell the dispatcher whose turn it is (a
        waiting queue's, while the queues share the room), else ``queue``'s."""
        if self._shared and not (self.closed or self.held_back or self.draining):
            turn = self.turns.give(self._room)
            if turn is not None:
                self.done.done(turn)
                return
        self.done.done(queue)

    def _pass_on(self, queue: str) -> None:
        """A turn lapsed unused (``queue``'s dispatcher did not offer): the next waiting
        queue gets the slot, else it stays free for whoever offers first."""
        logger.debug("gateway.turn_lapsed gateway=%s queue=%s", self._id, queue)
        if self._shared and not (self.closed or self.held_back or self.draining):
            turn = self.turns.give(self._room)
            if turn is not None:
                self.done.done(turn)

    def _reshape(self) -> None:
        """The slots or the concurrency changed: recompute whether the queues share."""
        self._shared = self._sharing()
        if not self._shared:
            self.turns.clear()

    def cap(self, cap: int | None, *, kept: Collection[str] = ()) -> None:
        """Hold at most ``cap`` tasks (None: the worker's full concurrency) from now on,
        the held leases in ``kept`` keeping their slots on top (see
        :func:`~conveyor_gateway.capacity.capped_slots`). Tasks already held are kept.
        When the announced slots change, they are re-announced at once."""
        self._cap, self._kept = cap, kept
        held = self._held
        on_top = Counter(held[lease_id].queue for lease_id in kept if lease_id in held)
        limit, slots = capped_slots(cap, self._spec.concurrency, self._spec.queues, on_top)
        if cap is None and self.granted:
            # The worker's own Credit adjustments: a cap in force wins over them.
            slots = {q: max(0, n + self.granted[q]) for q, n in slots.items()}
            limit = max(0, limit + sum(self.granted.values()))
        if limit == self.limit and slots == self._slots:
            return
        self.limit = limit
        self._slots = slots
        self._reshape()
        logger.info("gateway.concurrency_capped gateway=%s concurrency=%d", self._id, limit)
        if self._started and not self.closed:
            self._spawn(self._register_all())

    def credit(self, queue: str, n: int) -> None:
        """The worker asks for ``n`` more slots on ``queue`` (fewer when negative): its
        slots there become its split plus everything it asked for, never below 0, and
        its whole concurrency never above :data:`MAX_SLOTS`. Tasks already held are
        kept (a smaller count only stops new offers until enough results came back).
        The slots are re-announced at once."""
        if queue not in self.capacity or n == 0:
            return
        base = self.capacity[queue]
        total = self._spec.concurrency + sum(self.granted.values())
        current = base + self.granted[queue]
        wanted = max(0, current + n)
        wanted = min(wanted, current + max(0, MAX_SLOTS - total))
        self.granted[queue] = wanted - base
        logger.info("gateway.credit gateway=%s queue=%s n=%d slots=%d", self._id, queue, n, wanted)
        self.cap(self._cap, kept=self._kept)

    def drain(self) -> None:
        """The worker takes nothing more (it is shutting down): every queue is announced
        with no slots at once, offers are refused, and it stays so for the session."""
        if self.draining or self.closed:
            return
        self.draining = True
        self.turns.clear()
        logger.info("gateway.draining gateway=%s held=%d", self._id, len(self._held))
        if self._started:
            self._spawn(self._register_all())

    def hold_back(self, on: bool) -> None:
        """Take no new work (``on``) or take it again; the slots are re-announced at once
        when this changes (no slots while held back)."""
        if on == self.held_back:
            return
        self.held_back = on
        if on:
            self.turns.clear()
        if self._started and not self.closed:
            self._spawn(self._register_all())

    # -------------------------------------------------------------- dispatch

    def accept(self, request: cluster_pb2.DispatchRequest) -> list[str]:
        """Take what fits of a dispatch offer, hold it, and hand it to the transport (one
        call for the whole offer). Returns the accepted ids; the dispatcher releases the
        rest."""
        queue = request.queue
        if request.group:
            return self._accept_batch(request)
        room = self.free(queue)
        accepted: list[str] = []
        envelopes: list[task_pb2.TaskEnvelope] = []
        held, lease_of, hold = self._held, self._holdings.lease_of, self._holdings.hold
        for env in request.tasks:
            if room <= 0:
                break
            # A task id that is no ULID comes only from a broken or forged offer, and
            # the broker would refuse its ack and every ack committed with it.
            if not is_ulid(env.id) or not env.lease_id or env.lease_id in held:
                logger.warning(
                    "gateway.bad_envelope gateway=%s task=%s lease=%s",
                    self._id,
                    env.id,
                    env.lease_id,
                )
                continue
            if env.queue and env.queue != queue:
                logger.warning(
                    "gateway.wrong_queue gateway=%s task=%s queue=%s expected=%s",
                    self._id,
                    env.id,
                    env.queue,
                    queue,
                )
                continue
            probe = False
            if self.breakers is not None:
                admitted, probe = self.breakers.admit(queue, env.type, probe=env.probe)
                if not admitted:
                    logger.debug(
                        "gateway.type_blocked gateway=%s task=%s type=%s",
                        self._id,
                        env.id,
                        env.type,
                    )
                    continue
            stale = lease_of.get(env.id)
            if stale is not None:
                # The broker leased the task again, so our old lease is gone: the worker
                # must drop that run, and the slot goes to the new delivery.
                old = self._holdings.take(stale)
                if old is not None:
                    self._transport.cancel(old.task_id, old.lease_id, REDELIVERED_REASON)
                    room = self.free(queue)
            try:
                hold(env, queue, probe=probe)
            except (ValueError, OverflowError) as exc:
                # A timeout or deadline that is no valid Duration or Timestamp (protobuf
                # refuses to convert it): only a broken or forged offer carries one.
                logger.warning(
                    "gateway.bad_envelope gateway=%s task=%r lease=%r error=%r",
                    self._id,
                    env.id,
                    env.lease_id,
                    exc,
                )
                continue
            envelopes.append(env)
            accepted.append(env.id)
            room -= 1
        if envelopes:
            if tracing_enabled():
                self._holdings.traces.push(envelopes)
            self._transport.dispatch(envelopes)
        if self._shared:
            self._turn_taken(request, queue, len(accepted))
        return accepted

    def _accept_batch(self, request: cluster_pb2.DispatchRequest) -> list[str]:
        """Take an aggregation group's batch whole, for one slot, or none of it: its
        members must be well formed, of one type the worker takes as batches, of this
        queue and under one lease no other delivery here holds."""
        queue, envs = request.queue, request.tasks
        refusal = self._batch_refusal(request)
        if refusal is not None:
            logger.warning(
                "gateway.batch_refused gateway=%s queue=%s group=%s tasks=%d reason=%s",
                self._id,
                queue,
                request.group,
                len(envs),
                refusal,
            )
            return []
        if self.free(queue) <= 0:
            if self._shared and queue in self.capacity and not (self.closed or self.draining):
                self.turns.wait(queue)
            return []
        type_ = envs[0].type
        probe = False
        if self.breakers is not None:
            admitted, probe = self.breakers.admit(queue, type_)
            if not admitted:
                logger.debug(
                    "gateway.type_blocked gateway=%s group=%s type=%s",
                    self._id,
                    request.group,
                    type_,
                )
                return []
        holdings = self._holdings
        for env in envs:
            stale = holdings.lease_of.get(env.id)
            if stale is not None:
                # Leased again (with its group): the old run must stop.
                old = holdings.take(stale)
                if old is not None:
                    self._transport.cancel(old.task_id, old.lease_id, REDELIVERED_REASON)
        try:
            held = holdings.hold_batch(envs, queue, request.group)
        except (ValueError, OverflowError) as exc:
            logger.warning(
                "gateway.bad_envelope gateway=%s group=%r error=%r", self._id, request.group, exc
            )
            return []
        if probe:
            holdings.by_lease[held.lease_id] = replace(held, probe=True)
        self._transport.dispatch_batch(
            service_pb2.BatchDispatch(queue=queue, group=request.group, type=type_, tasks=envs)
        )
        if self._shared:
            self.turns.take(queue, 1)
            self.turns.stop_waiting(queue)
        return [env.id for env in envs]

    def _batch_refusal(self, request: cluster_pb2.DispatchRequest) -> str | None:
        """Why a batch offer is malformed or not for this worker; None when it is fine."""
        envs = request.tasks
        if not envs:
            return "empty"
        lease_id, type_ = envs[0].lease_id, envs[0].type
        if type_ not in self._spec.batch_types:
            return "type_not_taken_as_batch"
        if not lease_id or lease_id in self._held:
            return "bad_lease"
        ids: set[str] = set()
        for env in envs:
            if not is_ulid(env.id) or env.id in ids or env.lease_id != lease_id:
                return "bad_envelope"
            if env.type != type_ or (env.queue and env.queue != request.queue):
                return "mixed_batch"
            ids.add(env.id)
        return None

    def _turn_taken(self, request: cluster_pb2.DispatchRequest, queue: str, taken: int) -> None:
        """While the queues share the room: ``queue`` used its reservations, and waits
        for a turn when its offer did not fit, or when it was served and its dispatcher
        has more (a turn goes only to a waiting queue with a slot of its own free)."""
        turns = self.turns
        turns.take(queue, taken)
        if self.closed or self.held_back or self.draining or queue not in self.capacity:
            return
        if taken < len(request.tasks) or request.more:
            turns.wait(queue)
        else:
            turns.stop_waiting(queue)

    def answer(self, request: cluster_pb2.DispatchRequest) -> cluster_pb2.DispatchReply:
        """The reply to a dispatch offer (the bus sends it; one it cannot decode comes
        here empty, and gets the free slots of no queue: none)."""
        queue = request.queue
        accepted = self.accept(request) if queue else []
        logger.debug(
            "gateway.dispatch gateway=%s queue=%s offered=%d accepted=%d",
            self._id,
            queue,
            len(request.tasks),
            len(accepted),
        )
        return cluster_pb2.DispatchReply(
            accepted=accepted,
            credits=self.offered(queue),
            returned=self.done.returned(queue),
            blocked_types=self.blocked(queue),
        )

    def blocked(self, queue: str) -> list[str]:
        """The task types of ``queue`` the gateway takes none of now (its breakers)."""
        return [] if self.breakers is None else self.breakers.blocked(queue)

    # -------------------------------------------------------------- register

    def _register_message(self, queue: str, *, closing: bool) -> cluster_pb2.Register:
        return cluster_pb2.Register(
            gateway=self._id,
            queue=queue,
            capacity=0 if self.held_back or self.draining else self._slots[queue],
            weight=self._spec.queues[queue],
            in_flight=self._per_queue[queue],
            labels=dict(self._spec.labels),
            closing=closing,
            returned=self.done.returned(queue),
            holder=self._holder,
            blocked_types=self.blocked(queue),
            batch_types=self._spec.batch_types,
        )

    async def register(self, queue: str, *, closing: bool = False) -> None:
        """Announce the slots of ``queue`` (a failure to publish is logged)."""
        message = self._register_message(queue, closing=closing)
        try:
            await self._bus.publish(message)
        except Exception as exc:
            logger.warning(
                "gateway.register_failed gateway=%s queue=%s error=%r", self._id, queue, exc
            )

    async def _register_all(self) -> None:
        for queue in sorted(self.capacity):
            if self.closed:
                return  # the closing registration must be the last word
            await self.register(queue)

    async def _register_loop(self) -> None:
        while True:
            await asyncio.sleep(self._register_tick)
            for queue in sorted(self.capacity):
                await self.register(queue)

    def _on_roll_call(self) -> None:
        """A dispatcher started: announce every queue now (once, however many roll calls
        arrive meanwhile)."""
        if self._answering or not self._started or self.closed:
            return
        self._answering = True
        self._spawn(self._answer_roll_call())

    async def _answer_roll_call(self) -> None:
        try:
            await self._register_all()
        finally:
            self._answering = False

    async def _on_owner_changed(self, queue: str) -> None:
        if queue in self.capacity and not self.closed:
            await self.register(queue)
