"""The Gateway: one per worker session, the bridge between the stream and the cluster.

It is the only place that performs execution transitions (ack, fail, archive, release)
for its worker's tasks. Its bookkeeping (what it holds, under which lease, per queue) is
changed only in synchronous code, so no two coroutines ever see it half-updated; broker
calls happen after the bookkeeping and never hold it.

Flow control: the worker's concurrency is split across its queues by weight
(:func:`~conveyor_api.capacity.split_capacity`). The gateway accepts a dispatched task
only while the task's queue has a free slot *and* the session as a whole is under the
worker's concurrency, whatever the dispatcher believes; so a stale or doubled dispatcher
can never overload a worker.

Hooks for gateways whose "worker" is not a stream (the webhook service drives one Gateway
per webhook registration, with an HTTP transport as ``send``):

- :meth:`Gateway.cap_concurrency` lowers the concurrency at runtime (a circuit breaker
  announces 0, then a single probe slot) and re-announces capacity at once.
- A held delivery can be *parked* (:meth:`Gateway.park`): its slot stays held, but the
  bulk heartbeat no longer extends its lease; :meth:`Gateway.extend_held` extends one
  lease, :meth:`Gateway.drop_parked` ends a parked delivery whose lease lapsed (failing
  the attempt), :meth:`Gateway.adopt_parked` takes on a parked delivery another gateway
  made, :meth:`Gateway.forget_parked` lets every parked delivery go with no broker call
  (before a close that must not release them), and :meth:`Gateway.resolve` applies a
  Result that arrived out of band and waits for it.
- :meth:`Gateway.track_lease_expiry` makes the gateway remember, per held lease, the
  expiry its own extensions gave it (:meth:`Gateway.known_expiry`).
- A Gateway that is never started holds nothing and announces nothing: its
  :meth:`Gateway.resolve` makes only the lease-scoped broker call, so it can answer
  out-of-band results for leases no running gateway holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from conveyor_broker import (
    AckItem,
    Backoff,
    Broker,
    LeaseLost,
    LeaseRef,
    Task,
    TaskNotFound,
    TaskState,
)
from conveyor_broker.clock import Clock, SystemClock
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime import codec
from conveyor_runtime.subjects import Subjects
from google.protobuf.message import DecodeError
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from conveyor_api.attempt_bounds import (
    DEADLINE_EXCEEDED_ERROR,
    SERVER_TIMEOUT_ERROR,
    AttemptBound,
    AttemptTimers,
    deadline_error,
    envelope_bounds,
    retry_misses_deadline,
)
from conveyor_api.capacity import split_capacity
from conveyor_api.coalesce import DonePublisher, WakePublisher
from conveyor_api.group_commit import AckBatcher

logger = logging.getLogger(__name__)

#: Sends one frame to the worker (through the session's single writer).
SendFrame = Callable[[service_pb2.ServerFrame], None]

_OUTCOMES = frozenset(
    {
        service_pb2.OUTCOME_SUCCESS,
        service_pb2.OUTCOME_FAILURE,
        service_pb2.OUTCOME_SKIP_RETRY,
        service_pb2.OUTCOME_RELEASE,
    }
)
LEASE_LOST_REASON = "lease lost"
REDELIVERED_REASON = "task was delivered again under a new lease"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker declared in its Hello."""

    queues: Mapping[str, int]
    concurrency: int
    labels: Mapping[str, str] = field(default_factory=dict)
    worker_id: str = ""
    sdk_version: str = ""
    batch_types: tuple[str, ...] = ()
    #: The worker takes a dispatch's tasks in one Dispatches frame.
    accepts_dispatches: bool = False


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Server settings a gateway needs."""

    lease_ttl: timedelta
    register_tick: float
    max_result: int
    backoff: Backoff = field(default_factory=Backoff)
    #: How long past an attempt's timeout or deadline the worker may still report.
    timeout_grace: timedelta = timedelta(seconds=5)
    #: Wall time, for deadlines (the broker's clock in production).
    clock: Clock = field(default_factory=SystemClock)


@dataclass(frozen=True, slots=True)
class _Held:
    task_id: str
    lease_id: str
    queue: str
    retried: int
    deadline: datetime | None = None


class Gateway:
    """Serves one worker session: capacity registration, dispatch, outcomes, leases."""

    def __init__(
        self,
        gateway_id: str,
        spec: WorkerSpec,
        *,
        broker: Broker,
        nc: NATS,
        subjects: Subjects,
        config: GatewayConfig,
        acks: AckBatcher,
        wakes: WakePublisher,
        send: SendFrame,
        connected_at: datetime,
    ) -> None:
        self.id = gateway_id
        self.spec = spec
        self.connected_at = connected_at
        self.capacity = split_capacity(spec.concurrency, spec.queues)
        # The concurrency in force and the per-queue slots announced: the worker's own,
        # unless cap_concurrency lowered them.
        self._limit = spec.concurrency
        self._slots = self.capacity
        self._broker = broker
        self._nc = nc
        self._subjects = subjects
        self._config = config
        self._acks = acks
        self._wakes = wakes
        self._send = send
        self._done = DonePublisher(nc, subjects, gateway_id)
        self._held: dict[str, _Held] = {}  # lease id -> delivery
        self._lease_of: dict[str, str] = {}  # task id -> lease id
        self._per_queue: Counter[str] = Counter()
        self._parked: set[str] = set()  # lease ids the bulk heartbeat skips
        # Lease id -> the expiry this gateway's own extensions gave it (None: not tracked).
        self._expiry: dict[str, datetime] | None = None
        self._timers = AttemptTimers(
            grace=config.timeout_grace, clock=config.clock, on_overrun=self._on_overrun
        )
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False
        self._ticker: asyncio.Task[None] | None = None
        self._extending = False
        self._closed = False
        self._close_done = asyncio.Event()

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Subscribe, then announce capacity on every queue and keep re-announcing it."""
        self._subs.append(
            await self._nc.subscribe(self._subjects.dispatch(self.id), cb=self._on_dispatch)
        )
        for queue in sorted(self.capacity):
            self._subs.append(
                await self._nc.subscribe(
                    self._subjects.owner_changed(queue), cb=self._on_owner_changed
                )
            )
        # The dispatch subscription must be known to the server before a dispatcher
        # hears about us, or its first request finds no responder.
        await self._nc.flush()
        self._started = True
        for queue in sorted(self.capacity):
            await self._register(queue)
        self._ticker = asyncio.get_running_loop().create_task(self._register_loop())
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
        if self._closed:
            await self._close_done.wait()
            return
        self._closed = True
        try:
            await self._close()
        finally:
            self._close_done.set()

    async def _close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection may already be gone
                logger.debug("gateway.unsubscribe_failed gateway=%s error=%r", self.id, exc)
        self._subs.clear()
        for queue in sorted(self.capacity):
            await self._register(queue, closing=True)
        held = list(self._held.values())
        self._held.clear()
        self._timers.clear()
        self._parked.clear()
        if self._expiry:
            self._expiry.clear()
        self._lease_of.clear()
        self._per_queue.clear()
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
        await self._done.aclose()
        logger.info("gateway.closed gateway=%s released=%d", self.id, len(held))

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has begun."""
        return self._closed

    # ----------------------------------------------------------- bookkeeping

    @property
    def in_flight(self) -> int:
        """Tasks this session holds right now."""
        return len(self._held)

    def holds(self, task_id: str) -> bool:
        """True when this session holds ``task_id``."""
        return task_id in self._lease_of

    def free(self, queue: str) -> int:
        """Slots this session can still take on ``queue``."""
        if self._closed or queue not in self.capacity:
            return 0
        by_queue = self._slots[queue] - self._per_queue[queue]
        overall = self._limit - len(self._held)
        return max(0, min(by_queue, overall))

    def _hold(self, env: task_pb2.TaskEnvelope, queue: str) -> None:
        bounded = env.HasField("timeout") or env.HasField("deadline")
        timeout, deadline = envelope_bounds(env) if bounded else (None, None)
        held = _Held(env.id, env.lease_id, queue, max(0, env.attempt - 1), deadline)
        self._held[held.lease_id] = held
        self._lease_of[held.task_id] = held.lease_id
        self._per_queue[queue] += 1
        if bounded:
            self._timers.arm(held.lease_id, timeout, deadline)

    def _take(self, lease_id: str) -> _Held | None:
        held = self._held.pop(lease_id, None)
        if held is None:
            return None
        if self._timers:
            self._timers.disarm(lease_id)
        if self._parked:
            self._parked.discard(lease_id)
        if self._expiry:
            self._expiry.pop(lease_id, None)
        if self._lease_of.get(held.task_id) == lease_id:
            del self._lease_of[held.task_id]
        self._per_queue[held.queue] -= 1
        if self._per_queue[held.queue] <= 0:
            del self._per_queue[held.queue]
        return held

    def _free(self, lease_id: str) -> _Held | None:
        """Drop a delivery and give its slot back to the dispatcher at once (a Done).

        The slot is counted free here and given back in the same step, so the running
        total in Done, DispatchReply and Register always matches :meth:`free`: the
        dispatcher can then tell which Dones a reply already accounts for.
        """
        held = self._take(lease_id)
        if held is not None:
            self._done.done(held.queue)
        return held

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _cancel_on_worker(self, held: _Held, reason: str) -> None:
        cancel = service_pb2.Cancel(task_id=held.task_id, lease_id=held.lease_id, reason=reason)
        self._send(service_pb2.ServerFrame(cancel=cancel))

    # ------------------------------------------------------------ dispatch

    def accept(self, request: cluster_pb2.DispatchRequest) -> list[str]:
        """Take what fits of a dispatch and push it to the worker.

        The accepted tasks go out as one Dispatches frame when the worker's Hello set
        ``accepts_dispatches``, else as one Dispatch frame each; either way each task
        holds one credit. Returns the accepted ids; the dispatcher releases the rest.
        """
        queue = request.queue
        room = self.free(queue)
        accepted: list[str] = []
        batched: list[task_pb2.TaskEnvelope] | None = [] if self.spec.accepts_dispatches else None
        for env in request.tasks:
            if room <= 0:
                break
            if not env.id or not env.lease_id or env.lease_id in self._held:
                logger.warning(
                    "gateway.bad_envelope gateway=%s task=%s lease=%s",
                    self.id,
                    env.id,
                    env.lease_id,
                )
                continue
            if env.queue and env.queue != queue:
                logger.warning(
                    "gateway.wrong_queue gateway=%s task=%s queue=%s expected=%s",
                    self.id,
                    env.id,
                    env.queue,
                    queue,
                )
                continue
            stale = self._lease_of.get(env.id)
            if stale is not None:
                # The broker leased the task again, so our old lease is gone: the worker
                # must drop that run, and the slot goes to the new delivery.
                old = self._take(stale)
                if old is not None:
                    self._cancel_on_worker(old, REDELIVERED_REASON)
                    room = self.free(queue)
            self._hold(env, queue)
            if batched is None:
                self._send(service_pb2.ServerFrame(dispatch=service_pb2.Dispatch(task=env)))
            else:
                batched.append(env)
            accepted.append(env.id)
            room -= 1
        if batched:
            # One frame for the whole offer (each stream write costs tens of microseconds
            # on both ends, far more than the envelopes it carries), cut at
            # DISPATCHES_MAX_BYTES so no worker gets a message bigger than that or than one
            # task alone.
            for chunk in _frame_chunks(batched):
                self._send(service_pb2.ServerFrame(dispatches=service_pb2.Dispatches(tasks=chunk)))
        return accepted

    async def _on_dispatch(self, msg: Msg) -> None:
        try:
            request = cluster_pb2.DispatchRequest.FromString(msg.data)
        except DecodeError:
            logger.warning("gateway.bad_dispatch_request gateway=%s", self.id)
            request = cluster_pb2.DispatchRequest()
        accepted = self.accept(request) if request.queue else []
        reply = cluster_pb2.DispatchReply(
            accepted=accepted,
            credits=self.free(request.queue),
            returned=self._done.returned(request.queue),
        )
        if msg.reply:
            try:
                await msg.respond(reply.SerializeToString())
            except Exception as exc:
                # No reply: the dispatcher times out and releases them, but we already
                # pushed them; the broker's lease keeps that from going wrong.
                logger.warning("gateway.reply_failed gateway=%s error=%r", self.id, exc)
        logger.debug(
            "gateway.dispatch gateway=%s queue=%s offered=%d accepted=%d",
            self.id,
            request.queue,
            len(request.tasks),
            len(accepted),
        )

    # ------------------------------------------------------------ register

    def _register_message(self, queue: str, *, closing: bool) -> cluster_pb2.Register:
        return cluster_pb2.Register(
            gateway=self.id,
            queue=queue,
            capacity=self._slots[queue],
            weight=self.spec.queues[queue],
            in_flight=self._per_queue[queue],
            labels=dict(self.spec.labels),
            closing=closing,
            returned=self._done.returned(queue),
        )

    async def _register(self, queue: str, *, closing: bool = False) -> None:
        body = self._register_message(queue, closing=closing).SerializeToString()
        try:
            await self._nc.publish(self._subjects.register(queue), body)
        except Exception as exc:
            logger.warning(
                "gateway.register_failed gateway=%s queue=%s error=%r", self.id, queue, exc
            )

    async def _register_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.register_tick)
            for queue in sorted(self.capacity):
                await self._register(queue)

    async def _on_owner_changed(self, msg: Msg) -> None:
        queue = Subjects.queue_of(msg.subject)
        if queue in self.capacity and not self._closed:
            await self._register(queue)

    # --------------------------------------------------------------- frames

    def on_frame(self, frame: service_pb2.WorkerFrame) -> None:
        """Handle one worker frame after Hello. Never raises for bad input: a malformed
        frame is logged and ignored, so one bad frame cannot cost the session its tasks.
        """
        kind = frame.WhichOneof("frame")
        if kind == "result":
            self._on_results((frame.result,))
        elif kind == "batch_result":
            self._on_results(frame.batch_result.results)
        elif kind == "heartbeat":
            self._on_heartbeat()
        elif kind == "progress":
            self._on_progress(frame.progress)
        elif kind == "credit":
            self._on_credit(frame.credit)
        else:
            logger.warning("gateway.unexpected_frame gateway=%s kind=%s", self.id, kind)

    def _on_results(self, results: Iterable[service_pb2.Result]) -> None:
        # Successes (nearly every result) are acked together, in one task: a frame's worth
        # of results costs one ack round trip, not a task and a future apiece.
        acks: list[tuple[_Held, AckItem]] = []
        for result in results:
            held = self._held_for(result)
            if held is None:
                continue
            self._free(held.lease_id)
            if (
                result.outcome == service_pb2.OUTCOME_SUCCESS
                and len(result.result) <= self._config.max_result
            ):
                acks.append((held, AckItem(held.task_id, held.lease_id, result.result or None)))
            else:
                self._spawn(self._complete(held, result))
        if acks:
            self._spawn(self._ack_all(acks))

    def _held_for(self, result: service_pb2.Result) -> _Held | None:
        """The delivery ``result`` answers, or None (logged) when it answers none of ours."""
        if not result.task_id or not result.lease_id or result.outcome not in _OUTCOMES:
            logger.warning(
                "gateway.malformed_result gateway=%s task=%s lease=%s outcome=%d",
                self.id,
                result.task_id,
                result.lease_id,
                result.outcome,
            )
            return None
        held = self._held.get(result.lease_id)
        if held is None or held.task_id != result.task_id:
            logger.info(
                "gateway.result_for_unknown_lease gateway=%s task=%s lease=%s",
                self.id,
                result.task_id,
                result.lease_id,
            )
            return None
        return held

    async def _ack_all(self, acks: list[tuple[_Held, AckItem]]) -> None:
        try:
            acked = await self._acks.ack_many([item for _, item in acks])
        except Exception:
            # These tasks stay ACTIVE until their leases expire; the reaper retries them.
            logger.exception("gateway.ack_failed gateway=%s count=%d", self.id, len(acks))
            acked = [True] * len(acks)  # nothing more to log per task
        for (held, _), ok in zip(acks, acked, strict=True):
            if not ok:
                logger.info(
                    "gateway.lease_lost gateway=%s task=%s lease=%s queue=%s",
                    self.id,
                    held.task_id,
                    held.lease_id,
                    held.queue,
                )

    async def _complete(self, held: _Held, result: service_pb2.Result) -> None:
        try:
            await self._apply_outcome(held, result)
        except LeaseLost:
            logger.info(
                "gateway.lease_lost gateway=%s task=%s lease=%s queue=%s",
                self.id,
                held.task_id,
                held.lease_id,
                held.queue,
            )
        except Exception:
            # The task stays ACTIVE until its lease expires; the reaper retries it.
            logger.exception(
                "gateway.outcome_failed gateway=%s task=%s lease=%s queue=%s",
                self.id,
                held.task_id,
                held.lease_id,
                held.queue,
            )

    async def _apply_outcome(self, held: _Held, result: service_pb2.Result) -> None:
        broker, task_id, lease_id = self._broker, held.task_id, held.lease_id
        outcome = result.outcome
        if outcome == service_pb2.OUTCOME_SUCCESS:
            if len(result.result) > self._config.max_result:
                error = (
                    f"result is {len(result.result)} bytes; the limit is {self._config.max_result}"
                )
                await self._fail(held, error, self._config.backoff.delay(held.retried))
                return
            acked = await self._acks.ack(AckItem(task_id, lease_id, result.result or None))
            if not acked:
                raise LeaseLost(task_id, lease_id)
        elif outcome == service_pb2.OUTCOME_FAILURE:
            delay = self._retry_delay(held, result)
            await self._fail(held, result.error or "handler failed", delay)
        elif outcome == service_pb2.OUTCOME_SKIP_RETRY:
            await broker.archive(task_id, lease_id, result.error or "handler asked to skip retries")
        else:
            await broker.release(task_id, lease_id)
            self._wakes.wake(held.queue)

    async def _fail(self, held: _Held, error: str, delay: timedelta) -> None:
        """Fail the attempt: retry after ``delay``, or archive at once when that retry
        could only start past the task's deadline."""
        if retry_misses_deadline(held.deadline, self._config.clock.now(), delay):
            await self._broker.archive(held.task_id, held.lease_id, deadline_error(error))
            return
        task = await self._broker.fail(held.task_id, held.lease_id, error, delay)
        # A retry wakes its queue when due rather than at the reaper's next sweep.
        self._wakes.when_due(task, self._config.clock.now())

    def _on_overrun(self, lease_id: str, bound: AttemptBound) -> None:
        # The worker kept the attempt past its bound without a Result: stop it there,
        # stop extending its lease, and fail the attempt here.
        held = self._free(lease_id)
        if held is None:
            return
        logger.warning(
            "gateway.attempt_overran gateway=%s task=%s lease=%s queue=%s reason=%s",
            self.id,
            held.task_id,
            held.lease_id,
            held.queue,
            bound.cancel_reason,
        )
        self._cancel_on_worker(held, bound.cancel_reason)
        self._spawn(self._give_up(held, bound))

    async def _give_up(self, held: _Held, bound: AttemptBound) -> None:
        try:
            if bound.by_deadline:
                await self._broker.archive(held.task_id, held.lease_id, DEADLINE_EXCEEDED_ERROR)
            else:
                delay = self._config.backoff.delay(held.retried)
                await self._fail(held, SERVER_TIMEOUT_ERROR, delay)
        except LeaseLost:
            logger.info("gateway.lease_lost gateway=%s task=%s", self.id, held.task_id)
        except Exception:
            # Its lease is no longer extended: the reaper takes the task back.
            logger.exception("gateway.give_up_failed gateway=%s task=%s", self.id, held.task_id)

    def _retry_delay(self, held: _Held, result: service_pb2.Result) -> timedelta:
        if result.HasField("retry_after"):
            try:
                requested: timedelta | None = codec.from_duration(result.retry_after)
            except (ValueError, OverflowError):
                requested = None
            if requested is not None and requested >= timedelta(0):
                return requested
        return self._config.backoff.delay(held.retried)

    def _on_heartbeat(self) -> None:
        # One extension at a time: a heartbeat that lands during one adds nothing, since
        # the next heartbeat comes well before any lease could lapse.
        if self._extending or not self._held:
            return
        self._extending = True
        self._spawn(self._extend())

    async def _extend(self) -> None:
        # Only for tracking gateways: the broker's expiry is at least this plus the TTL.
        started = self._config.clock.now() if self._expiry is not None else None
        try:
            parked = self._parked  # async webhook deliveries: their callbacks extend them
            refs = [
                LeaseRef(h.task_id, h.lease_id)
                for h in self._held.values()
                if h.lease_id not in parked
            ]
            if not refs:
                return
            lost = await self._broker.extend_leases(refs, self._config.lease_ttl)
        except Exception:
            logger.exception("gateway.extend_failed gateway=%s", self.id)
            return
        finally:
            self._extending = False
        if started is not None:
            self._note_extended(refs, lost, started + self._config.lease_ttl)
        for ref in lost:
            held = self._free(ref.lease_id)
            if held is None:
                continue  # completed meanwhile
            logger.info(
                "gateway.lease_lost_on_heartbeat gateway=%s task=%s lease=%s",
                self.id,
                held.task_id,
                held.lease_id,
            )
            self._cancel_on_worker(held, LEASE_LOST_REASON)

    def _on_progress(self, progress: service_pb2.Progress) -> None:
        held = self._held.get(progress.lease_id)
        if held is None or held.task_id != progress.task_id:
            logger.info(
                "gateway.progress_for_unknown_lease gateway=%s task=%s lease=%s",
                self.id,
                progress.task_id,
                progress.lease_id,
            )
            return
        self._spawn(self._store_progress(held, bytes(progress.progress)))

    async def _store_progress(self, held: _Held, data: bytes) -> None:
        try:
            await self._broker.set_progress(held.task_id, held.lease_id, data)
        except LeaseLost:
            logger.info("gateway.progress_lease_lost gateway=%s task=%s", self.id, held.task_id)
        except Exception:
            logger.exception("gateway.progress_failed gateway=%s task=%s", self.id, held.task_id)

    def _on_credit(self, credit: service_pb2.Credit) -> None:
        # The gateway's own accounting is authoritative and never exceeds the split, so a
        # Credit is a resync hint: tell the dispatcher our current state for that queue.
        if credit.queue not in self.capacity:
            logger.warning(
                "gateway.credit_unknown_queue gateway=%s queue=%s", self.id, credit.queue
            )
            return
        self._spawn(self._register(credit.queue))

    # -------------------------------------------------------------- cancel

    def cancel(self, task_id: str, reason: str) -> bool:
        """Tell the worker to stop ``task_id`` if this session holds it; refund its slot."""
        lease_id = self._lease_of.get(task_id)
        if lease_id is None:
            return False
        held = self._free(lease_id)
        if held is None:
            return False
        self._cancel_on_worker(held, reason)
        logger.info("gateway.canceled gateway=%s task=%s reason=%s", self.id, task_id, reason)
        return True

    # ------------------------------------------- hooks for non-stream workers

    @property
    def concurrency(self) -> int:
        """The concurrency in force: the worker's, or less under :meth:`cap_concurrency`."""
        return self._limit

    def cap_concurrency(self, cap: int | None, *, over_parked: bool = False) -> None:
        """Hold at most ``cap`` tasks (None: the worker's full concurrency) from now on.

        0 announces capacity 0 on every queue; a cap below the worker's concurrency
        announces that many slots split across the queues as usual. With
        ``over_parked``, ``cap`` counts only the deliveries that are not parked: the
        parked ones held now keep their slots on top (each queue gets its parked
        deliveries plus its share of ``cap``); call it again when they change. Tasks
        already held are kept. When the announced capacity changes, it is re-announced
        at once.
        """
        if cap is not None and cap < 0:
            raise ValueError(f"cap must be >= 0, got {cap}")
        full = self.spec.concurrency
        slots: dict[str, int]
        if cap is None or min(cap + (len(self._parked) if over_parked else 0), full) == full:
            limit, slots = full, self.capacity
        elif over_parked and self._parked:
            parked = Counter(self._held[lease_id].queue for lease_id in self._parked)
            limit = cap + len(self._parked)
            share = split_capacity(cap, self.spec.queues) if cap else {}
            slots = {q: min(self.capacity[q], parked[q] + share.get(q, 0)) for q in self.capacity}
        elif cap == 0:
            limit, slots = 0, dict.fromkeys(self.capacity, 0)
        else:
            limit, slots = cap, split_capacity(cap, self.spec.queues)
        if limit == self._limit and slots == self._slots:
            return
        self._limit = limit
        self._slots = slots
        logger.info("gateway.concurrency_capped gateway=%s concurrency=%d", self.id, limit)
        if self._started and not self._closed:
            self._spawn(self._register_all())

    async def _register_all(self) -> None:
        for queue in sorted(self.capacity):
            if self._closed:
                return  # the closing registration must be the last word
            await self._register(queue)

    def park(self, lease_id: str) -> bool:
        """Park the held delivery ``lease_id``: its slot stays held, but heartbeats no
        longer extend its lease (only :meth:`extend_held` does). False when not held."""
        if lease_id not in self._held:
            return False
        self._parked.add(lease_id)
        return True

    def is_parked(self, lease_id: str) -> bool:
        """True while ``lease_id`` is held and parked."""
        return lease_id in self._parked

    def track_lease_expiry(self) -> None:
        """From now on remember, per held lease, the expiry this gateway's own extensions
        (the bulk heartbeat, :meth:`extend_held`) gave it; see :meth:`known_expiry`."""
        if self._expiry is None:
            self._expiry = {}

    def known_expiry(self, lease_id: str) -> datetime | None:
        """The latest expiry this gateway's own extensions gave ``lease_id`` (a lower
        bound of the broker's); None when it never extended it or does not track."""
        return self._expiry.get(lease_id) if self._expiry is not None else None

    def _note_extended(self, refs: list[LeaseRef], lost: list[LeaseRef], until: datetime) -> None:
        expiry = self._expiry
        if expiry is None:
            return
        gone = {ref.lease_id for ref in lost}
        for ref in refs:
            if ref.lease_id not in gone and ref.lease_id in self._held:
                expiry[ref.lease_id] = max(until, expiry.get(ref.lease_id, until))

    async def extend_held(self, task_id: str, lease_id: str) -> datetime | None:
        """Extend one held lease by the lease TTL; the new expiry. None when this gateway
        does not hold it. When the broker says the lease is lost, the delivery is dropped
        (the worker is told to cancel it, its slot freed) and LeaseLost raised."""
        held = self._held.get(lease_id)
        if held is None or held.task_id != task_id:
            return None
        try:
            expires = await self._broker.extend_lease(task_id, lease_id, self._config.lease_ttl)
        except LeaseLost:
            if self._free(lease_id) is not None:
                self._cancel_on_worker(held, LEASE_LOST_REASON)
            raise
        if self._expiry is not None and self._held.get(lease_id) is held:
            self._expiry[lease_id] = max(expires, self._expiry.get(lease_id, expires))
        return expires

    def adopt_parked(self, task: Task) -> bool:
        """Hold ``task`` (ACTIVE, leased by another gateway: an earlier incarnation, say)
        as a parked delivery, so it counts against the concurrency from now on, even past
        it. Its attempt bound (timeout from its start, deadline) is armed as for a
        dispatch. False, changing nothing, when this gateway is closed, does not serve
        the task's queue, the task is not ACTIVE, or it already holds the lease."""
        lease_id = task.lease_id
        if (
            self._closed
            or lease_id is None
            or task.state != TaskState.ACTIVE
            or task.queue not in self.capacity
            or lease_id in self._held
        ):
            return False
        stale = self._lease_of.get(task.id)
        if stale is not None:
            # Leased again since: the old run is over, and the adopted delivery takes its
            # slot (nothing is given back).
            old = self._take(stale)
            if old is not None:
                self._cancel_on_worker(old, REDELIVERED_REASON)
        held = _Held(task.id, lease_id, task.queue, task.retried, task.deadline)
        self._held[lease_id] = held
        self._lease_of[task.id] = lease_id
        self._per_queue[task.queue] += 1
        self._parked.add(lease_id)
        timeout = task.timeout
        if timeout is not None and task.started_at is not None:
            # What is left of the attempt's timeout (a bound at once when none is).
            elapsed = self._config.clock.now() - task.started_at
            timeout = max(timeout - elapsed, timedelta(microseconds=1))
        if timeout is not None or task.deadline is not None:
            self._timers.arm(lease_id, timeout, task.deadline)
        logger.info(
            "gateway.adopted gateway=%s task=%s lease=%s queue=%s",
            self.id,
            task.id,
            lease_id,
            task.queue,
        )
        return True

    async def drop_parked(self, lease_id: str, error: str) -> bool:
        """End a parked delivery whose lease lapsed: free its slot, publish done, and fail
        the attempt in the broker with ``error`` and the usual backoff (archived when
        retries are exhausted or the retry would miss the deadline), so a late callback
        finds the lease lost. A lost lease is fine (the reaper or a result came first).
        False when ``lease_id`` is not parked here."""
        if lease_id not in self._parked:
            return False
        held = self._free(lease_id)
        if held is None:
            return False
        logger.info(
            "gateway.parked_lease_lapsed gateway=%s task=%s lease=%s",
            self.id,
            held.task_id,
            lease_id,
        )
        try:
            await self._fail(held, error, self._config.backoff.delay(held.retried))
        except LeaseLost:
            pass
        except Exception:
            # The lease is no longer extended: the reaper takes the task back.
            logger.exception("gateway.drop_failed gateway=%s task=%s", self.id, held.task_id)
        return True

    def forget_parked(self) -> int:
        """Let every parked delivery go with no broker call: no longer held, counted or
        bounded here, its lease left as it is (whoever does the work keeps driving it).
        For a gateway about to close that must not release them; how many."""
        forgotten = 0
        for lease_id in list(self._parked):
            if self._take(lease_id) is not None:
                forgotten += 1
        self._parked.clear()
        return forgotten

    async def resolve(self, result: service_pb2.Result, *, queue: str = "") -> bool:
        """Apply a Result that arrived out of band (a webhook callback) and wait for it.

        For a delivery this gateway holds it does what a stream Result does (the same
        outcome mapping; the slot is freed and done published). For one it does not hold
        (say, one made before a restart) only the lease-scoped broker call is made, which
        the broker refuses unless the lease is still current. True when the outcome was
        applied; False when the lease is lost (or the task is not on ``queue``, when
        given). Raises ValueError for a malformed result or a task on a queue this
        gateway does not serve; a broker failure propagates (the task then stays leased
        until it expires).
        """
        if not result.task_id or not result.lease_id or result.outcome not in _OUTCOMES:
            raise ValueError("a result needs a task id, a lease id and a final outcome")
        held = self._held.get(result.lease_id)
        if held is not None and held.task_id == result.task_id:
            self._free(held.lease_id)
            try:
                await self._apply_outcome(held, result)
            except LeaseLost:
                return False
            return True
        try:
            task = await self._broker.get_task(result.task_id)
        except TaskNotFound:
            return False
        if task.state != TaskState.ACTIVE or task.lease_id != result.lease_id:
            return False
        if queue and queue != task.queue:
            return False
        if task.queue not in self.capacity:
            raise ValueError(f"task {task.id} is on queue {task.queue!r}, which is not served here")
        stranger = _Held(task.id, result.lease_id, task.queue, task.retried, task.deadline)
        try:
            await self._apply_outcome(stranger, result)
        except LeaseLost:
            return False
        return True

    # ---------------------------------------------------------------- view

    def session_info(self) -> service_pb2.WorkerSessionInfo:
        """This session for the cluster view."""
        return service_pb2.WorkerSessionInfo(
            session_id=self.id,
            worker_id=self.spec.worker_id,
            queues=dict(self.spec.queues),
            concurrency=self.spec.concurrency,
            in_flight=len(self._held),
            labels=dict(self.spec.labels),
            connected_at=codec.timestamp(self.connected_at),
        )


#: The most bytes of tasks in one Dispatches frame (a single bigger task goes alone), so
#: a worker's receive limit need only fit the largest task.
DISPATCHES_MAX_BYTES = 1024 * 1024


def _frame_chunks(
    envelopes: list[task_pb2.TaskEnvelope],
) -> list[list[task_pb2.TaskEnvelope]]:
    """``envelopes`` in order, in runs of at most DISPATCHES_MAX_BYTES."""
    chunks: list[list[task_pb2.TaskEnvelope]] = []
    chunk: list[task_pb2.TaskEnvelope] = []
    used = 0
    for envelope in envelopes:
        size = envelope.ByteSize() + 8
        if chunk and used + size > DISPATCHES_MAX_BYTES:
            chunks.append(chunk)
            chunk, used = [], 0
        chunk.append(envelope)
        used += size
    if chunk:
        chunks.append(chunk)
    return chunks
