"""The Gateway: one per worker (a stream session, or a webhook registration), the bridge
between that worker and the cluster.

It is the only place that performs execution transitions (ack, fail, archive, release)
for its worker's tasks. Its parts, each in a module of its own:

- :mod:`~conveyor_gateway.holdings`: what it holds, per lease, task and queue, with the
  timer of each bounded attempt (:mod:`~conveyor_gateway.attempt_bounds`);
- :mod:`~conveyor_gateway.credits`: the slots per queue, which dispatch offers it
  accepts, and what it announces to the dispatchers;
- :mod:`~conveyor_gateway.leases`: heartbeats and lease extension;
- :mod:`~conveyor_gateway.outcomes`: what a Result does in the broker.

The worker is reached through a :class:`~conveyor_gateway.transport.Transport`; its
answers come in through the ``on_*`` methods. The ledger is changed only in synchronous
code; broker calls happen after it changed and never hold it.

For workers that are not a stream (the webhook service), the gateway offers a few more
primitives, which know nothing of how those workers work: :meth:`Gateway.cap_concurrency`
(with held leases that keep their slots on top of the cap), heartbeat skips and an
extension listener (constructor arguments), :meth:`Gateway.extend_held`,
:meth:`Gateway.adopt`, :meth:`Gateway.fail_held`, :meth:`Gateway.forget` and
:meth:`Gateway.resolve`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Container, Coroutine, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from conveyor_broker import AckItem, Broker, LeaseLost, Task, TaskNotFound, TaskState
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime import metrics, wire
from conveyor_runtime.bus import Bus
from opentelemetry.trace import Span

from conveyor_gateway.attempt_bounds import AttemptBound
from conveyor_gateway.breakers import BreakerConfigs, Breakers
from conveyor_gateway.config import GatewayConfig, WorkerSpec
from conveyor_gateway.credits import REDELIVERED_REASON, Credits
from conveyor_gateway.group_commit import AckBatcher
from conveyor_gateway.hints import WakePublisher
from conveyor_gateway.holdings import Held, Holdings
from conveyor_gateway.leases import LeaseExtension, OnExtended
from conveyor_gateway.outcomes import FINAL_OUTCOMES, Outcomes, is_well_formed
from conveyor_gateway.tracing import traced
from conveyor_gateway.transport import Transport

logger = logging.getLogger(__name__)

#: Why a worker is told to drop a task whose lease the broker says is lost.
LEASE_LOST_REASON = "lease lost"
#: The error of a batch member its BatchResult gave no outcome.
MISSING_FROM_BATCH = "no outcome for this member in the batch result"


class Gateway:
    """Serves one worker: capacity registration, dispatch, outcomes, leases.

    ``heartbeat_skips`` are leases the worker's heartbeat does not extend (the caller may
    change the container's contents at any time); ``on_extended`` hears of every lease
    extension the gateway makes (see :class:`~conveyor_gateway.leases.LeaseExtension`).
    """

    def __init__(
        self,
        gateway_id: str,
        spec: WorkerSpec,
        *,
        broker: Broker,
        bus: Bus,
        config: GatewayConfig,
        acks: AckBatcher,
        wakes: WakePublisher,
        transport: Transport,
        connected_at: datetime,
        heartbeat_skips: Container[str] = frozenset(),
        on_extended: OnExtended | None = None,
        breakers: BreakerConfigs | None = None,
    ) -> None:
        self.id = gateway_id
        self.spec = spec
        self.connected_at = connected_at
        self._broker = broker
        self._config = config
        self._wakes = wakes
        self._transport = transport
        self._tasks: set[asyncio.Task[None]] = set()
        self._holdings = Holdings(
            grace=config.timeout_grace, clock=config.clock, on_overrun=self._on_overrun
        )
        self._held = self._holdings.by_lease
        self._traces = self._holdings.traces
        self._traces.gateway = gateway_id
        self._credits = Credits(
            gateway_id,
            spec,
            holdings=self._holdings,
            transport=transport,
            bus=bus,
            register_tick=config.register_tick,
            spawn=self._spawn,
            holder=config.holder,
        )
        self._done = self._credits.done
        #: The circuit breakers per task type (None: this gateway runs none).
        self.breakers: Breakers | None = None
        if breakers is not None:
            credits = self._credits
            self.breakers = credits.breakers = Breakers(
                gateway_id,
                configs=breakers,
                broker=broker,
                bus=bus,
                clock=config.clock,
                spawn=self._spawn,
                announce=lambda queue: self._spawn(credits.register(queue)),
                probe_lapse=config.lease_ttl,
                worker_id=spec.worker_id,
                holder=config.holder,
            )
        #: The worker's own slots per queue.
        self.capacity = self._credits.capacity
        self._leases = LeaseExtension(
            gateway_id,
            broker=broker,
            holdings=self._holdings,
            lease_ttl=config.lease_ttl,
            clock=config.clock,
            spawn=self._spawn,
            lose=self._lose,
            skips=heartbeat_skips,
            on_extended=on_extended,
        )
        self._outcomes = Outcomes(
            gateway_id,
            broker=broker,
            acks=acks,
            wakes=wakes,
            config=config,
            on_backlog=self._on_backlog,
        )
        #: The backlog of outcomes being retried past which no new work is taken.
        self.backlog_limit = config.outcome_backlog or spec.concurrency
        self._close_done = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
        ttl = config.lease_ttl.total_seconds()
        #: How long past its known expiry a lease counts as lost (an extension may be on
        #: its way), and how often the held leases are looked at.
        self._lapse_grace = timedelta(seconds=min(1.0, ttl / 10))
        self._watch_every = max(0.05, min(2.0, ttl / 4))

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Subscribe, then announce capacity on every queue and keep re-announcing it, and
        watch the held leases for any that runs out (see :meth:`check_leases`)."""
        await self._credits.start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_leases())
        logger.info(
            "gateway.started gateway=%s worker=%s capacity=%s",
            self.id,
            self.spec.worker_id,
            self.capacity,
        )

    async def close(self) -> None:
        """Stop taking work, release every task still held, and say goodbye.

        Safe to call more than once and from several places at once: every caller
        returns when the one close has finished. Released tasks are due at once, so
        their queues are woken for another worker to pick them up.
        """
        if self._credits.closed:
            await self._close_done.wait()
            return
        self._credits.closed = True
        try:
            await self._close()
        finally:
            self._close_done.set()

    async def _close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self._credits.stop()
        held = [t for h in self._holdings.clear() for t in h.tasks]
        outcomes = await asyncio.gather(
            *(self._broker.release(h.task_id, h.lease_id) for h in held), return_exceptions=True
        )
        for h, outcome in zip(held, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                logger.warning(
                    "gateway.release_failed gateway=%s task=%s lease=%s error=%r",
                    self.id,
                    h.task_id,
                    h.lease_id,
                    outcome,
                )
            else:
                self._wakes.wake(h.queue)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.breakers is not None:
            await self.breakers.aclose()
        await self._done.aclose()
        logger.info("gateway.closed gateway=%s released=%d", self.id, len(held))

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has begun."""
        return self._credits.closed

    # ----------------------------------------------------------- bookkeeping

    @property
    def in_flight(self) -> int:
        """Tasks this gateway holds right now."""
        return len(self._held)

    @property
    def timed(self) -> int:
        """Held attempts whose time bound is armed."""
        return len(self._holdings.timers)

    @property
    def backlog(self) -> int:
        """Outcomes whose commit failed and that are being retried (their leases kept
        alive meanwhile)."""
        return self._outcomes.backlog

    @property
    def outcomes_retried(self) -> int:
        """Outcome commits retried since the gateway started (a counter, for metrics)."""
        return self._outcomes.retried

    @property
    def held_back(self) -> bool:
        """True while the backlog is full and the gateway takes no new work."""
        return self._credits.held_back

    def _on_backlog(self, backlog: int) -> None:
        # Past the limit no new work is taken (every slot announced as none); taken again
        # once the backlog has drained to half of it.
        credits = self._credits
        if not credits.held_back and backlog >= self.backlog_limit:
            logger.warning(
                "gateway.outcome_backlog_full gateway=%s backlog=%d limit=%d",
                self.id,
                backlog,
                self.backlog_limit,
            )
            credits.hold_back(True)
        elif credits.held_back and backlog <= self.backlog_limit // 2:
            logger.info(
                "gateway.outcome_backlog_drained gateway=%s backlog=%d limit=%d",
                self.id,
                backlog,
                self.backlog_limit,
            )
            credits.hold_back(False)

    def holds(self, task_id: str) -> bool:
        """True when this gateway holds ``task_id``."""
        return task_id in self._holdings.lease_of

    def holds_lease(self, lease_id: str) -> bool:
        """True when this gateway holds the delivery under ``lease_id``."""
        return lease_id in self._held

    def free(self, queue: str) -> int:
        """Slots this gateway can still take on ``queue``."""
        return self._credits.free(queue)

    def _free(self, lease_id: str) -> Held | None:
        """Drop a delivery and give its slot back to the dispatcher at once (a Done).

        The slot is counted free here and given back in the same step, so the running
        total in Done, DispatchReply and Register always matches :meth:`free`: the
        dispatcher can then tell which Dones a reply already accounts for.
        """
        held = self._holdings.take(lease_id)
        if held is not None:
            self._credits.freed(held.queue)
        return held

    def _lose(self, lease_id: str) -> Held | None:
        """Drop a delivery whose lease is lost, and tell the worker to stop it."""
        held = self._free(lease_id)
        if held is not None:
            self._transport.cancel(held.task_id, held.lease_id, LEASE_LOST_REASON)
        return held

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ dispatch

    def accept(self, request: cluster_pb2.DispatchRequest) -> list[str]:
        """Take what fits of a dispatch offer and hand it to the worker (see
        :meth:`~conveyor_gateway.credits.Credits.accept`); the accepted ids."""
        return self._credits.accept(request)

    # ---------------------------------------------------- from the worker

    def on_results(self, results: Iterable[service_pb2.Result]) -> None:
        """Apply the worker's Results: each frees its slot at once; the broker calls run
        in the background, and one that fails is retried (its lease extended) until it
        commits or its lease is gone (see :mod:`~conveyor_gateway.outcomes`). A Result for
        no delivery held here is logged and ignored."""
        # Successes (nearly every result) are acked together, in one task: a frame's worth
        # of results costs one ack round trip, not a task and a future apiece.
        acks: list[tuple[Held, AckItem]] = []
        # The commit spans of traced deliveries (see conveyor_gateway.tracing).
        traces = self._traces if self._traces.spans else None
        ack_spans: list[Span] = []
        max_result = self._config.max_result
        now = time.monotonic()
        for result in results:
            held = self._held_for(result)
            if held is None:
                continue
            span = None if traces is None else traces.answered(held.lease_id, result.outcome)
            self._free(held.lease_id)
            metrics.run_time(held.queue).observe(now - held.started)
            fits = len(result.result) <= max_result
            if self.breakers is not None:
                # A success whose result is too big fails the attempt: so it counts.
                ok = result.outcome != service_pb2.OUTCOME_SUCCESS or fits
                self._record(held, result.outcome if ok else service_pb2.OUTCOME_FAILURE)
            if result.outcome == service_pb2.OUTCOME_SUCCESS and fits:
                acks.append((held, AckItem(held.task_id, held.lease_id, result.result or None)))
                if span is not None:
                    ack_spans.append(span)
            else:
                spans = () if span is None else (span,)
                self._spawn(traced(self._outcomes.complete(held, result), spans))
        if acks:
            self._spawn(traced(self._outcomes.ack_all(acks), ack_spans))

    def on_batch_result(self, results: Sequence[service_pb2.Result]) -> None:
        """Apply the worker's BatchResult: one Result per member of a batch it holds, all
        under the batch's lease. The batch's slot frees at once; each member's outcome is
        applied as a single task's would be (successes acked together), and a member the
        results leave out fails (:data:`MISSING_FROM_BATCH`); results under another lease
        are logged and ignored. Results whose lease is no batch held here are single
        tasks' Results sent together (:meth:`on_results`)."""
        held = next(
            (h for h in (self._held.get(r.lease_id) for r in results) if h and h.members), None
        )
        lease_id = held.lease_id if held is not None else ""
        if held is None:
            # Several single tasks' Results in one frame (what a BatchResult carries when
            # it answers no batch).
            self.on_results(results)
            return
        if any(result.lease_id != lease_id for result in results):
            logger.warning(
                "gateway.batch_result_mixes_leases gateway=%s lease=%s results=%d",
                self.id,
                lease_id,
                len(results),
            )
            results = [result for result in results if result.lease_id == lease_id]
        by_task: dict[str, service_pb2.Result] = {}
        for result in results:
            if is_well_formed(result):
                by_task.setdefault(result.task_id, result)
        self._free(held.lease_id)
        metrics.run_time(held.queue).observe(time.monotonic() - held.started)
        max_result = self._config.max_result
        acks: list[tuple[Held, AckItem]] = []
        failed = False
        for member in held.members:
            answer = by_task.get(member.task_id)
            result = (
                answer
                if answer is not None
                else service_pb2.Result(
                    task_id=member.task_id,
                    lease_id=member.lease_id,
                    outcome=service_pb2.OUTCOME_FAILURE,
                    error=MISSING_FROM_BATCH,
                )
            )
            if result.outcome == service_pb2.OUTCOME_SUCCESS and len(result.result) <= max_result:
                acks.append(
                    (member, AckItem(member.task_id, member.lease_id, result.result or None))
                )
                continue
            if result.outcome != service_pb2.OUTCOME_RELEASE:
                failed = True
            self._spawn(self._outcomes.complete(member, result))
        if self.breakers is not None:
            # The batch is one attempt of its type for the breakers.
            self._record(
                held, service_pb2.OUTCOME_FAILURE if failed else service_pb2.OUTCOME_SUCCESS
            )
        if acks:
            self._spawn(self._outcomes.ack_all(acks))

    def _record(self, held: Held, outcome: int) -> None:
        """Count an attempt's end for its type's breaker (a release counts for nothing)."""
        assert self.breakers is not None
        if outcome == service_pb2.OUTCOME_SUCCESS:
            self.breakers.record(held, ok=True)
        elif outcome in (service_pb2.OUTCOME_FAILURE, service_pb2.OUTCOME_SKIP_RETRY):
            self.breakers.record(held, ok=False)

    def _held_for(self, result: service_pb2.Result) -> Held | None:
        """The delivery ``result`` answers, or None (logged) when it answers none of ours."""
        if not result.task_id or not result.lease_id or result.outcome not in FINAL_OUTCOMES:
            logger.warning(
                "gateway.malformed_result gateway=%s task=%s lease=%s outcome=%d",
                self.id,
                result.task_id,
                result.lease_id,
                result.outcome,
            )
            return None
        held = self._held.get(result.lease_id)
        if held is None or held.task_id != result.task_id or held.members:
            # (A batch is answered by one BatchResult, never by a Result.)
            logger.info(
                "gateway.result_for_unknown_lease gateway=%s task=%s lease=%s",
                self.id,
                result.task_id,
                result.lease_id,
            )
            return None
        return held

    def on_heartbeat(self) -> None:
        """The worker is alive: extend the leases of everything held (but the skipped)."""
        self._leases.heartbeat()

    def on_progress(self, task_id: str, lease_id: str, progress: bytes) -> None:
        """Store the progress the worker reported for a delivery it holds."""
        self._leases.progress(task_id, lease_id, progress)

    def on_credit(self, queue: str, n: int = 0) -> None:
        """The worker asks for ``n`` more slots on ``queue`` (fewer when negative; 0: a
        resync), see :meth:`~conveyor_gateway.credits.Credits.credit`; the slots of the
        queue are announced again either way."""
        if queue not in self.capacity:
            logger.warning("gateway.credit_unknown_queue gateway=%s queue=%s", self.id, queue)
            return
        # The gateway's own accounting is authoritative: a Credit changes what it takes,
        # then the dispatcher hears the queue's current state.
        self._credits.credit(queue, n)
        self._spawn(self._credits.register(queue))

    async def check_leases(self) -> int:
        """Drop every held delivery whose lease the broker no longer has (the worker
        stopped heartbeating, the lease ran out and the reaper released the task, or
        another worker leased it since): the worker is told to cancel that run
        (LEASE_LOST_REASON) and its slot is freed; a late Progress or Result for it is
        then ignored. Only leases past their known expiry are looked up, one read each
        (a lease past its expiry that the reaper has not reclaimed is still the
        worker's). Returns how many were dropped. The gateway calls it every few
        seconds; tests may too."""
        suspects = self._leases.expired(self._config.clock.now(), self._lapse_grace)
        if not suspects:
            return 0
        dropped = 0
        for lease_id in suspects:
            held = self._held.get(lease_id)
            if held is None:
                continue
            try:
                # A batch is still ours while any member is (one canceled by an operator
                # loses only its own outcome).
                live = await self._live_member(held)
            except Exception as exc:
                logger.warning("gateway.lease_check_failed gateway=%s error=%r", self.id, exc)
                return dropped
            if self._held.get(lease_id) is not held:
                continue  # its Result came meanwhile
            if live is not None:
                if live.lease_expires_at is not None:
                    self._holdings.expires[lease_id] = live.lease_expires_at
                continue
            if self._lose(lease_id) is not None:
                dropped += 1
                logger.warning(
                    "gateway.lease_lost gateway=%s task=%s lease=%s",
                    self.id,
                    held.task_id,
                    lease_id,
                )
        return dropped

    async def _live_member(self, held: Held) -> Task | None:
        """The first task of ``held`` (a batch's members in order) still ACTIVE under its
        lease in the broker, or None."""
        for member in held.tasks:
            try:
                task = await self._broker.get_task(member.task_id)
            except TaskNotFound:
                continue
            if task.state is TaskState.ACTIVE and task.lease_id == held.lease_id:
                return task
        return None

    async def _watch_leases(self) -> None:
        while True:
            await asyncio.sleep(self._watch_every)
            try:
                await self.check_leases()
            except Exception:
                logger.exception("gateway.lease_watch_failed gateway=%s", self.id)

    def drain(self) -> None:
        """The worker drains (a Drain frame): it gets no new task for the rest of the
        session, and what it holds completes as usual (see
        :meth:`~conveyor_gateway.credits.Credits.drain`)."""
        self._credits.drain()

    @property
    def draining(self) -> bool:
        """True once the worker said it drains."""
        return self._credits.draining

    def _on_overrun(self, lease_id: str, bound: AttemptBound) -> None:
        # The worker kept the attempt past its bound without a Result: stop it there,
        # stop extending its lease, and fail the attempt here.
        held = self._free(lease_id)
        if held is None:
            return
        if self.breakers is not None:
            self.breakers.record(held, ok=False)
        logger.warning(
            "gateway.attempt_overran gateway=%s task=%s lease=%s queue=%s reason=%s",
            self.id,
            held.task_id,
            held.lease_id,
            held.queue,
            bound.cancel_reason,
        )
        self._transport.cancel(held.task_id, held.lease_id, bound.cancel_reason)
        for task in held.tasks:
            self._spawn(self._outcomes.give_up(task, bound))

    # -------------------------------------------------------------- cancel

    def cancel(self, task_id: str, reason: str) -> bool:
        """Tell the worker to stop ``task_id`` if this gateway holds it; refund its slot."""
        lease_id = self._holdings.lease_of.get(task_id)
        if lease_id is None:
            return False
        batch = self._held.get(lease_id)
        if batch is not None and batch.members:
            # One member of a batch: the batch runs on for the others, and this member's
            # outcome will find its lease gone.
            logger.info(
                "gateway.batch_member_canceled gateway=%s task=%s group=%s reason=%s",
                self.id,
                task_id,
                batch.group,
                reason,
            )
            return False
        held = self._free(lease_id)
        if held is None:
            return False
        self._transport.cancel(held.task_id, held.lease_id, reason)
        logger.info("gateway.canceled gateway=%s task=%s reason=%s", self.id, task_id, reason)
        return True

    # ------------------------------------------ for workers that are not a stream

    @property
    def concurrency(self) -> int:
        """The concurrency in force: the worker's (with what its Credit frames asked
        for), or less under :meth:`cap_concurrency`."""
        return self._credits.limit

    def cap_concurrency(self, cap: int | None, *, kept: Collection[str] = ()) -> None:
        """Hold at most ``cap`` tasks (None: the worker's full concurrency) from now on.

        0 announces capacity 0 on every queue; a cap below the worker's concurrency
        announces that many slots split across the queues as usual. The held leases in
        ``kept`` count only on top of ``cap``: they keep their slots (each queue gets its
        kept deliveries plus its share of ``cap``); call it again when they change. Tasks
        already held are kept. When the announced capacity changes, it is re-announced at
        once.
        """
        self._credits.cap(cap, kept=kept)

    async def extend_held(self, task_id: str, lease_id: str) -> datetime | None:
        """Extend one held lease by the lease TTL; the new expiry. None when this gateway
        does not hold it. When the broker says the lease is lost, the delivery is dropped
        (the worker is told to cancel it, its slot freed) and LeaseLost raised."""
        return await self._leases.extend(task_id, lease_id)

    def adopt(self, task: Task) -> bool:
        """Hold ``task`` (ACTIVE, leased by another gateway: an earlier incarnation, say),
        so it counts against the concurrency from now on, even past it. Its attempt bound
        (timeout from its start, deadline) is armed as for a dispatch. False, changing
        nothing, when this gateway is closed, does not serve the task's queue, the task
        is not ACTIVE, or it already holds the lease."""
        lease_id = task.lease_id
        if (
            self.closed
            or lease_id is None
            or task.state != TaskState.ACTIVE
            or task.queue not in self.capacity
            or lease_id in self._held
        ):
            return False
        stale = self._holdings.lease_of.get(task.id)
        if stale is not None:
            # Leased again since: the old run is over, and the adopted delivery takes its
            # slot (nothing is given back).
            old = self._holdings.take(stale)
            if old is not None:
                self._transport.cancel(old.task_id, old.lease_id, REDELIVERED_REASON)
        self._holdings.hold_task(task, lease_id)
        logger.info(
            "gateway.adopted gateway=%s task=%s lease=%s queue=%s",
            self.id,
            task.id,
            lease_id,
            task.queue,
        )
        return True

    async def fail_held(self, lease_id: str, error: str) -> bool:
        """End the held delivery ``lease_id`` whose worker stopped answering for it: free
        its slot, publish done, and fail the attempt in the broker with ``error`` and the
        usual backoff (archived when retries are exhausted or the retry would miss the
        deadline), so a late Result finds the lease lost. A lost lease is fine. False when
        ``lease_id`` is not held here."""
        held = self._free(lease_id)
        if held is None:
            return False
        logger.info(
            "gateway.held_lease_failed gateway=%s task=%s lease=%s",
            self.id,
            held.task_id,
            lease_id,
        )
        for task in held.tasks:
            await self._outcomes.abandon(task, error)
        return True

    def forget(self, lease_id: str) -> bool:
        """Let the held delivery ``lease_id`` go with no broker call and no Done: no longer
        held, counted or bounded here, its lease left as it is (whoever does the work
        keeps driving it). For a gateway about to close that must not release it. False
        when it is not held."""
        return self._holdings.take(lease_id) is not None

    async def resolve(self, result: service_pb2.Result, *, queue: str = "") -> bool:
        """Apply a Result that arrived out of band (a webhook callback) and wait for it.

        For a delivery this gateway holds it does what a Result from the worker does
        (the same outcome mapping; the slot is freed and done published). For one it does
        not hold (say, one made before a restart) only the lease-scoped broker call is
        made (:meth:`~conveyor_gateway.outcomes.Outcomes.resolve`). True when the outcome
        was applied; False when the lease is lost (or the task is not on ``queue``, when
        given). Raises ValueError for a malformed result or a task on a queue this gateway
        does not serve; a broker failure propagates (the task then stays leased until it
        expires).
        """
        if not is_well_formed(result):
            raise ValueError("a result needs a task id, a lease id and a final outcome")
        held = self._held.get(result.lease_id)
        if held is not None and held.task_id == result.task_id and not held.members:
            traces = self._traces
            span = traces.answered(held.lease_id, result.outcome) if traces.spans else None
            self._free(held.lease_id)
            if self.breakers is not None:
                self._record(held, result.outcome)
            try:
                await traced(self._outcomes.apply(held, result), () if span is None else (span,))
            except LeaseLost:
                return False
            return True
        return await self._outcomes.resolve(result, queue=queue, served=self.capacity)

    # ---------------------------------------------------------------- view

    def session_info(self) -> service_pb2.WorkerSessionInfo:
        """This gateway's worker for the cluster view."""
        return service_pb2.WorkerSessionInfo(
            session_id=self.id,
            worker_id=self.spec.worker_id,
            queues=dict(self.spec.queues),
            concurrency=self.spec.concurrency,
            in_flight=len(self._held),
            labels=dict(self.spec.labels),
            connected_at=wire.timestamp(self.connected_at),
        )
