"""WebhookGateway: a :class:`~conveyor_gateway.gateway.Gateway` whose worker is an HTTP
endpoint.

One per active webhook registration. The Gateway does everything it does for a stream
worker (capacity registration, credits, holding, outcome transitions, lease extension);
this class is its :class:`~conveyor_gateway.transport.Transport` and its callback surface:

- A dispatch becomes one signed HTTP delivery per task, all concurrent (its own aiohttp
  session: :mod:`conveyor_webhook.http`). The answer (:mod:`conveyor_webhook.response`)
  becomes a Result fed to the Gateway like a stream Result; ``accepted`` parks the
  delivery instead (asynchronous mode, :mod:`conveyor_webhook.parking`), or fails the
  attempt when no callback address is configured (the endpoint could never report).
- An aggregation group's batch (``dispatch_batch``, for the registration's
  ``batch_types``) becomes one signed HTTP delivery of every member under the batch's one
  lease (:func:`~conveyor_webhook.delivery.batch_body`); its answer becomes one Result
  per member, fed to the Gateway as one batch result (:func:`batch_results`). A failed
  request fails every member alike, and counts for the breaker (and the metrics) as one
  delivery. Batches are synchronous only: ``accepted`` fails every member
  (:data:`~conveyor_webhook.response.ASYNC_BATCH_ERROR`).
- A cancel (lease lost, attempt overran, admin cancel) cancels that task's HTTP request
  (a batch's, for its lease) if it is still in flight, and stops watching it if it was
  parked.
- While any synchronous delivery is open, the Gateway's heartbeat runs every
  ``lease_ttl / 3``; it skips parked deliveries, whose leases only the endpoint's
  Heartbeat callbacks extend. A parked delivery whose last known lease expiry passes is
  dropped: its slot freed and its attempt failed ("webhook delivery stopped
  heartbeating"), so a late callback finds the lease lost.
- Callbacks (:mod:`conveyor_webhook.callbacks`) reach :meth:`WebhookGateway.handle_callback`
  through the manager. A heartbeat for a lease this gateway does not hold (one made by an
  earlier incarnation) adopts the delivery as parked, so it counts against the
  concurrency again.
- The endpoint's circuit breaker (:mod:`conveyor_webhook.breaker`) caps the synchronous
  deliveries: none while open, one probe while half-open; parked deliveries keep their
  slots on top.
- Draining (pause, restart, leadership loss, shutdown) lets parked deliveries go without
  a broker call (their endpoint is still working on them; their callbacks go on being
  answered), waits for open synchronous ones, then releases whatever is still held.
- Metrics, by registration name (``worker``): every delivery's outcome
  (``conveyor_webhook_deliveries_total``, see :func:`delivery_outcome` and
  :func:`batch_outcome`: a batch counts once) and how long its
  endpoint took (``conveyor_webhook_delivery_seconds``); the breaker's state while the
  gateway serves (``conveyor_webhook_breaker_state``) and its openings and closings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from datetime import datetime
from typing import Any

import aiohttp
from conveyor_broker import LeaseLost, WebhookWorker
from conveyor_gateway.outcomes import MAX_RETRY_AFTER
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime import metrics, wire
from conveyor_runtime.webhook_auth import signed_headers
from conveyor_runtime.webhook_urls import FORBIDDEN_ADDRESS

from conveyor_webhook.breaker import BreakerState, CircuitBreaker, Ticket
from conveyor_webhook.callbacks import (
    Status,
    answer,
    apply_result,
    live_task,
    reply,
    set_retry_after,
)
from conveyor_webhook.config import WebhookConfig, Wiring
from conveyor_webhook.delivery import batch_body, delivery_body, delivery_headers
from conveyor_webhook.http import forbidden, open_session, signed_by
from conveyor_webhook.parking import ParkedDeliveries
from conveyor_webhook.response import (
    MISSING_MEMBER_ERROR,
    OUTCOMES,
    Accepted,
    BatchReply,
    Broken,
    Finished,
    Reply,
    parse_batch_response,
    parse_response,
    transport_failure,
)

logger = logging.getLogger(__name__)

__all__ = [
    "WebhookConfig",
    "WebhookGateway",
    "as_result",
    "batch_outcome",
    "batch_results",
    "delivery_outcome",
]

#: Room in a response body beyond the base64 of the largest result.
RESPONSE_HEADROOM = 64 * 1024
#: The largest answer to a batch call taken, whatever its members' results add up to.
MAX_BATCH_RESPONSE = 64 * 1024 * 1024
#: How long past a registration's timeout a drain waits for open deliveries' answers.
DRAIN_GRACE = 1.0
#: The last error of an attempt whose endpoint answered "accepted" with nowhere to report.
NO_CALLBACK_ERROR = "endpoint answered accepted but no callback address is configured"
#: The last error of a parked delivery whose lease lapsed with no heartbeat.
STOPPED_HEARTBEATING = "webhook delivery stopped heartbeating"


#: The ``outcome`` label of each final outcome an endpoint can answer.
_OUTCOME_LABELS = {outcome: name for name, outcome in OUTCOMES.items()}
#: The breaker state gauge's value of each state.
_BREAKER_GAUGE = {
    BreakerState.CLOSED: metrics.BREAKER_CLOSED,
    BreakerState.HALF_OPEN: metrics.BREAKER_HALF_OPEN,
    BreakerState.OPEN: metrics.BREAKER_OPEN,
}


class ResponseTooLarge(Exception):
    """The endpoint's response body is over the limit."""


def delivery_outcome(reply: Reply) -> str:
    """The ``outcome`` label of a delivery that got ``reply``: the endpoint's final outcome
    (success, failure, skip_retry, release), ``accepted`` (asynchronous), ``transport``
    (no answer, a timeout or a 5xx: what the breaker counts) or ``error`` (any other
    answer that fails the attempt). A delivery aborted in flight counts as
    ``canceled``."""
    if isinstance(reply, Finished):
        return _OUTCOME_LABELS.get(reply.outcome, "error")
    if isinstance(reply, Accepted):
        return "accepted"
    return "transport" if reply.transport else "error"


def batch_outcome(reply: BatchReply) -> str:
    """The ``outcome`` label of a batch delivery that got ``reply``: as for a single
    delivery (:func:`delivery_outcome`) when every member got the same final outcome (or
    the call failed), ``mixed`` when the members' outcomes differ."""
    if isinstance(reply, Broken):
        return delivery_outcome(reply)
    labels = {delivery_outcome(finished) for finished in reply.outcomes.values()}
    return labels.pop() if len(labels) == 1 else "mixed"


def batch_results(
    reply: BatchReply, tasks: Sequence[task_pb2.TaskEnvelope], lease_id: str
) -> list[service_pb2.Result]:
    """One Result per member of ``tasks`` (in order, all under the batch's ``lease_id``)
    for the batch answer ``reply``: each member's own outcome, or the one failure of all
    (FAILURE, the server's backoff)."""
    results = []
    for env in tasks:
        answer: Finished | Broken
        if isinstance(reply, Broken):
            answer = reply
        else:
            found = reply.outcomes.get(env.id)
            answer = found if found is not None else Broken(MISSING_MEMBER_ERROR)
        results.append(as_result(answer, env.id, lease_id))
    return results


def as_result(reply: Finished | Broken, task_id: str, lease_id: str) -> service_pb2.Result:
    """The stream Result a final answer stands for (a broken delivery: FAILURE, backoff)."""
    if isinstance(reply, Broken):
        return service_pb2.Result(
            task_id=task_id,
            lease_id=lease_id,
            outcome=service_pb2.OUTCOME_FAILURE,
            error=reply.error,
        )
    result = service_pb2.Result(
        task_id=task_id,
        lease_id=lease_id,
        outcome=reply.outcome,
        result=reply.result,
        error=reply.error,
    )
    # Longer than a stream Result may ask for: the server's backoff.
    set_retry_after(result, reply.retry_after, MAX_RETRY_AFTER)
    return result


class WebhookGateway:
    """Serves one webhook registration: deliveries, callbacks, circuit breaker."""

    def __init__(self, worker: WebhookWorker, wiring: Wiring) -> None:
        if not worker.secrets:
            raise ValueError(f"webhook worker {worker.name!r} has no secret to sign with")
        self.worker = worker
        self.name = worker.name
        self._broker = wiring.broker
        self._config = config = wiring.config
        self._clock = config.gateway.clock
        self._http: aiohttp.ClientSession | None = None
        self._max_body = config.gateway.max_result * 4 // 3 + RESPONSE_HEADROOM
        self._parked = ParkedDeliveries(self._clock, self._on_lapse_due)
        self.gateway = wiring.gateway(
            worker, self, heartbeat_skips=self._parked, on_extended=self._parked.note_extended
        )
        self.breaker = CircuitBreaker(config.breaker_threshold, config.breaker_cooldown)
        #: This registration's label (capped) and its pre-bound metrics.
        self._label = metrics.WORKER(worker.name)
        self._latency = metrics.WEBHOOK_DELIVERY_SECONDS.labels(self._label)
        self._breaker_gauge = metrics.WEBHOOK_BREAKER.labels(self._label)
        self._deliveries: dict[str, asyncio.Task[None]] = {}  # lease id -> open delivery
        self._breaker_timer: asyncio.TimerHandle | None = None
        self._beat: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False
        self._retired = False
        self._draining = False
        self._drained = asyncio.Event()

    @property
    def id(self) -> str:
        """The gateway id (``wh-<name>-<ulid>``, unique per incarnation)."""
        return self.gateway.id

    @property
    def open_deliveries(self) -> int:
        """Synchronous deliveries whose HTTP request is still in flight."""
        return len(self._deliveries)

    @property
    def parked(self) -> int:
        """Deliveries the endpoint accepted and has not finished yet (whose lease expiry
        this gateway knows)."""
        return self._parked.watched

    def parked_until(self, lease_id: str) -> datetime | None:
        """The lease expiry this gateway knows of for parked ``lease_id`` (None: not
        parked here)."""
        parked = self._parked.get(lease_id)
        return parked.expires if parked is not None else None

    @property
    def serving(self) -> bool:
        """True from a successful :meth:`start` until it is retired."""
        return self._started and not self._retired

    @property
    def http_closed(self) -> bool:
        """True when no HTTP session of this gateway is open."""
        return self._http is None or self._http.closed

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Open the HTTP session, then start the Gateway (announce capacity, take
        dispatches). On any failure (or cancellation) everything started is drained
        again before the error propagates."""
        if self._started or self._draining:
            raise RuntimeError(f"webhook gateway {self.id} was started already")
        resolver = self._config.resolver() if self._config.resolver is not None else None
        self._http = open_session(self._config.policy, resolver=resolver)
        try:
            await self.gateway.start()
        except BaseException:
            await asyncio.shield(self.drain())
            raise
        self._started = True
        if not self._retired:
            self._breaker_gauge.set(_BREAKER_GAUGE[self.breaker.state(self._loop_time())])
        logger.info(
            "webhook.gateway_started worker=%s gateway=%s url=%s",
            self.name,
            self.id,
            self.worker.url,
        )

    def refresh(self, worker: WebhookWorker) -> None:
        """Take a changed url, timeout or secrets in place (for deliveries from now on).

        Queues, concurrency and batch types cannot change in place: the manager restarts
        the gateway.
        """
        if not worker.secrets:
            raise ValueError(f"webhook worker {worker.name!r} has no secret to sign with")
        self.worker = worker

    def retire(self) -> None:
        """Stop taking work at once: announce no capacity, stop the breaker, and let the
        parked deliveries go (no broker call: their endpoints are still working on them,
        and their callbacks are answered elsewhere from now on). :meth:`drain` does the
        rest. Safe to call more than once."""
        if self._retired:
            return
        self._retired = True
        self._cancel_breaker_timer()
        if self._started and self._label != metrics.OTHER:
            # Its state is no one's now (the next gateway of the name sets it again).
            metrics.WEBHOOK_BREAKER.remove(self._label)
        self._let_parked_go()
        self.gateway.cap_concurrency(0)

    async def drain(self) -> None:
        """Retire (:meth:`retire`), wait for open synchronous deliveries (up to the
        registration's timeout), release every task still held, and close the HTTP
        session. Parked deliveries are never released.

        Safe to call more than once; every caller returns once the one drain is done.
        """
        if self._draining:
            await self._drained.wait()
            return
        self._draining = True
        try:
            await self._drain()
        finally:
            self._drained.set()

    async def _drain(self) -> None:
        self.retire()
        try:
            open_ = list(self._deliveries.values())
            if open_:
                await asyncio.wait(open_, timeout=self.worker.timeout.total_seconds() + DRAIN_GRACE)
            # Deliveries accepted meanwhile stay with their endpoint too.
            self._let_parked_go()
            for task in list(self._deliveries.values()):
                task.cancel()
            await self.gateway.close()
            if self._beat is not None:
                self._beat.cancel()
            pending = [*self._deliveries.values(), *self._tasks]
            if self._beat is not None:
                pending.append(self._beat)
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            if self._http is not None:
                await self._http.close()
        logger.info("webhook.gateway_drained worker=%s gateway=%s", self.name, self.id)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------- transport

    def dispatch(self, tasks: Sequence[task_pb2.TaskEnvelope]) -> None:
        """(Transport) Deliver each of ``tasks`` in an HTTP request of its own."""
        for env in tasks:
            self._open(env)

    def dispatch_batch(self, batch: service_pb2.BatchDispatch) -> None:
        """(Transport) Deliver aggregation group ``batch`` (every member under one lease,
        held by the Gateway as one delivery) in one HTTP request; its answer goes back as
        one batch result (a Result per member)."""
        if not batch.tasks:
            logger.warning(
                "webhook.empty_batch worker=%s queue=%s group=%s",
                self.name,
                batch.queue,
                batch.group,
            )
            return
        lease_id = batch.tasks[0].lease_id

        def crashed(error: Broken) -> None:
            self.gateway.on_batch_result(batch_results(error, batch.tasks, lease_id))

        self._track(lease_id, batch.tasks[0].id, self._deliver_batch(batch, lease_id), crashed)

    def cancel(self, task_id: str, lease_id: str, reason: str) -> None:
        """(Transport) The Gateway holds ``lease_id`` no more: abort its HTTP request if
        it is still in flight, and stop watching it if it was parked."""
        if self._parked.forget(lease_id):
            self._apply_cap()
        task = self._deliveries.pop(lease_id, None)
        if task is not None:
            task.cancel()
            logger.info(
                "webhook.delivery_canceled worker=%s task=%s reason=%s",
                self.name,
                task_id,
                reason,
            )

    def _open(self, env: task_pb2.TaskEnvelope) -> None:
        def crashed(error: Broken) -> None:
            self.gateway.on_results((as_result(error, env.id, env.lease_id),))

        self._track(env.lease_id, env.id, self._deliver(env), crashed)

    def _track(
        self,
        lease_id: str,
        task_id: str,
        delivery: Coroutine[Any, Any, None],
        crashed: Callable[[Broken], None],
    ) -> None:
        """Run ``delivery`` as the open delivery of ``lease_id`` (of task ``task_id``, a
        batch's first member); should it crash, ``crashed`` fails its attempt."""
        task = asyncio.get_running_loop().create_task(delivery)
        self._deliveries[lease_id] = task

        def closed(done: asyncio.Task[None]) -> None:
            if self._deliveries.get(lease_id) is done:
                del self._deliveries[lease_id]
            if not done.cancelled() and done.exception() is not None:
                logger.error(
                    "webhook.delivery_crashed worker=%s task=%s",
                    self.name,
                    task_id,
                    exc_info=done.exception(),
                )
                # Fail the attempt rather than hold (and keep extending) its lease.
                if not self.gateway.closed:
                    crashed(Broken(f"webhook delivery failed: {done.exception()!r}"))
            # Unless it is parked now, nothing about it is left to know (what the
            # heartbeat told of its lease included).
            parked = lease_id in self._parked and self.gateway.holds_lease(lease_id)
            if not parked and self._parked.forget(lease_id):
                self._apply_cap()

        task.add_done_callback(closed)
        if self._beat is None or self._beat.done():
            self._beat = asyncio.get_running_loop().create_task(self._beat_loop())

    async def _beat_loop(self) -> None:
        # The bulk heartbeat extends every held lease that is not parked: exactly the
        # open synchronous deliveries.
        interval = self._config.gateway.lease_ttl.total_seconds() / 3
        while self._deliveries:
            await asyncio.sleep(interval)
            if self._deliveries and not self.gateway.closed:
                self.gateway.on_heartbeat()

    async def _deliver(self, env: task_pb2.TaskEnvelope) -> None:
        sent = self._loop_time()
        ticket = self.breaker.ticket(sent)
        try:
            reply_ = await self._post(env, self.worker)
        except asyncio.CancelledError:
            self._count("canceled", sent)
            raise
        self._count(delivery_outcome(reply_), sent)
        self._record(reply_, ticket)
        if isinstance(reply_, Accepted):
            if self._config.callback_address:
                await self._park(env)
                return
            reply_ = Broken(NO_CALLBACK_ERROR)
        if isinstance(reply_, Broken):
            logger.info(
                "webhook.delivery_failed worker=%s task=%s error=%s",
                self.name,
                env.id,
                reply_.error,
            )
        self.gateway.on_results((as_result(reply_, env.id, env.lease_id),))

    async def _deliver_batch(self, batch: service_pb2.BatchDispatch, lease_id: str) -> None:
        sent = self._loop_time()
        ticket = self.breaker.ticket(sent)
        try:
            reply_ = await self._post_batch(batch, lease_id, self.worker)
        except asyncio.CancelledError:
            self._count("canceled", sent)
            raise
        self._count(batch_outcome(reply_), sent)
        self._record(reply_, ticket)
        if isinstance(reply_, Broken):
            logger.info(
                "webhook.batch_failed worker=%s queue=%s group=%s tasks=%d error=%s",
                self.name,
                batch.queue,
                batch.group,
                len(batch.tasks),
                reply_.error,
            )
        self.gateway.on_batch_result(batch_results(reply_, batch.tasks, lease_id))

    async def _post(self, env: task_pb2.TaskEnvelope, worker: WebhookWorker) -> Reply:
        secret = worker.secrets[0]
        body, _ = delivery_body(
            env, worker=worker.name, secret=secret, callback=self._config.callback_address
        )
        answer = await self._send(
            worker, body, env.lease_id, task_id=env.id, task_headers=env.headers
        )
        if isinstance(answer, Broken):
            return answer
        status, raw = answer
        return parse_response(status, raw, env.lease_id)

    async def _post_batch(
        self, batch: service_pb2.BatchDispatch, lease_id: str, worker: WebhookWorker
    ) -> BatchReply:
        body = batch_body(batch)
        # Room for every member's largest result.
        limit = min(self._max_body * len(batch.tasks), max(MAX_BATCH_RESPONSE, self._max_body))
        answer = await self._send(
            worker, body, lease_id, task_id=None, task_headers=batch.tasks[0].headers, limit=limit
        )
        if isinstance(answer, Broken):
            return answer
        status, raw = answer
        return parse_batch_response(status, raw, lease_id, [env.id for env in batch.tasks])

    async def _send(
        self,
        worker: WebhookWorker,
        body: bytes,
        delivery_id: str,
        *,
        task_id: str | None,
        task_headers: Mapping[str, str],
        limit: int | None = None,
    ) -> tuple[int, bytes] | Broken:
        """POST ``body`` to the endpoint as delivery ``delivery_id`` (the lease id: new for
        every attempt, never sent twice), signed with the newest secret; the answer's
        status and body (at most ``limit`` bytes, default the single delivery's limit),
        or the Broken of a request that got none."""
        http = self._http
        if http is None or http.closed:
            return Broken("the webhook gateway is not running")
        secret = worker.secrets[0]
        limit = self._max_body if limit is None else limit
        # Signature timestamps are wall time: the endpoint checks them against its clock.
        # The headers are signed again once a connection is ready (signed_by).
        headers = delivery_headers(
            body,
            task_id=task_id,
            delivery_id=delivery_id,
            secret=secret,
            timestamp=int(time.time()),
            task_headers=task_headers,
        )
        timeout = worker.timeout.total_seconds()
        try:
            with signed_by(lambda: signed_headers(secret, delivery_id, body, int(time.time()))):
                async with asyncio.timeout(timeout):
                    async with http.post(
                        worker.url, data=body, headers=headers, allow_redirects=False
                    ) as response:
                        status = response.status
                        raw = await self._read(response, limit)
        except TimeoutError:
            return transport_failure(f"endpoint did not answer within {timeout:g} s")
        except ResponseTooLarge:
            return Broken(f"endpoint response is larger than {limit} bytes")
        except (aiohttp.ClientError, OSError) as exc:
            if forbidden(exc):
                # The same text whatever the address: nothing about what listens there.
                return transport_failure(FORBIDDEN_ADDRESS)
            return transport_failure(f"could not reach the endpoint: {exc or type(exc).__name__}")
        return status, raw

    async def _read(self, response: aiohttp.ClientResponse, limit: int) -> bytes:
        if response.content_length is not None and response.content_length > limit:
            raise ResponseTooLarge
        chunks: list[bytes] = []
        size = 0
        while chunk := await response.content.readany():
            size += len(chunk)
            if size > limit:
                raise ResponseTooLarge
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def _loop_time() -> float:
        return asyncio.get_running_loop().time()

    def _count(self, outcome: str, sent: float) -> None:
        """One delivery sent at ``sent`` (loop time) ended with ``outcome``."""
        metrics.WEBHOOK_DELIVERIES.labels(self._label, outcome).inc()
        self._latency.observe(self._loop_time() - sent)

    # -------------------------------------------------------- circuit breaker

    def _record(self, reply_: Reply | BatchReply, ticket: Ticket) -> None:
        now = self._loop_time()
        before = self.breaker.state(now)
        if isinstance(reply_, Broken) and reply_.transport:
            self.breaker.record_failure(now, ticket)
        else:
            self.breaker.record_success(now, ticket)
        after = self.breaker.state(now)
        if after is BreakerState.OPEN and before is not BreakerState.OPEN:
            metrics.WEBHOOK_BREAKER_TRANSITIONS.labels(self._label, "opened").inc()
        elif after is BreakerState.CLOSED and before is BreakerState.HALF_OPEN:
            metrics.WEBHOOK_BREAKER_TRANSITIONS.labels(self._label, "closed").inc()
        self._apply_breaker()

    def _apply_cap(self) -> None:
        # The breaker caps the synchronous deliveries; parked ones keep their slots.
        if self._retired:
            return
        cap = self.breaker.cap(asyncio.get_running_loop().time())
        self.gateway.cap_concurrency(cap, kept=self._parked.leases)

    def _apply_breaker(self) -> None:
        if self._retired:
            return
        self._breaker_gauge.set(_BREAKER_GAUGE[self.breaker.state(self._loop_time())])
        self._apply_cap()
        self._cancel_breaker_timer()
        reopens_at = self.breaker.reopens_at()
        if reopens_at is not None:
            loop = asyncio.get_running_loop()
            self._breaker_timer = loop.call_at(reopens_at, self._apply_breaker)

    def _cancel_breaker_timer(self) -> None:
        if self._breaker_timer is not None:
            self._breaker_timer.cancel()
            self._breaker_timer = None

    # --------------------------------------------------------- async (parked)

    async def _park(self, env: task_pb2.TaskEnvelope) -> None:
        lease_id = env.lease_id
        if not self.gateway.holds_lease(lease_id):
            return  # finished (by a callback) or canceled meanwhile
        self._parked.park(lease_id)
        self._apply_cap()
        # The endpoint gets a full lease from the moment it accepted.
        try:
            expires = await self.gateway.extend_held(env.id, lease_id)
        except LeaseLost:
            return  # the Gateway dropped it (and canceled it here)
        except Exception:
            logger.exception("webhook.park_extend_failed worker=%s task=%s", self.name, env.id)
            # The latest expiry known: the dispatch's, or a heartbeat's since.
            known = [
                wire.from_timestamp(env.lease_expires_at)
                if env.HasField("lease_expires_at")
                else self._clock.now()
            ]
            extended = self._parked.extended_until(lease_id)
            if extended is not None:
                known.append(extended)
            expires = max(known)
        if expires is None:
            if self._parked.forget(lease_id):  # finished (by a callback) meanwhile
                self._apply_cap()
            return
        self._watch_parked(lease_id, env.id, expires)
        logger.info("webhook.delivery_accepted worker=%s task=%s", self.name, env.id)

    def _watch_parked(self, lease_id: str, task_id: str, expires: datetime) -> bool:
        """Keep an eye on parked ``lease_id`` until ``expires``; False when it is no
        longer parked here (or this gateway is retired)."""
        if self._retired or lease_id not in self._parked or not self.gateway.holds_lease(lease_id):
            self._parked.forget(lease_id)
            return False
        self._parked.watch(lease_id, task_id, expires)
        return True

    def _let_parked_go(self) -> None:
        left = sum(self.gateway.forget(lease_id) for lease_id in self._parked.clear())
        if left:
            logger.info(
                "webhook.parked_left_running worker=%s gateway=%s count=%d",
                self.name,
                self.id,
                left,
            )

    def _on_lapse_due(self, lease_id: str) -> None:
        self._spawn(self._lapse(lease_id))

    async def _lapse(self, lease_id: str) -> None:
        await self._check_parked(lease_id)

    async def _check_parked(self, lease_id: str) -> bool:
        parked = self._parked.get(lease_id)
        if parked is None:
            return False
        if not self.gateway.holds_lease(lease_id):
            self._parked.forget(lease_id)
            return False
        if self._clock.now() < parked.expires:
            self._watch_parked(lease_id, parked.task_id, parked.expires)
            return False
        # The lease it knew of has passed. Unless someone else extended it meanwhile (a
        # gateway of another process answering during a hand-over), end it.
        try:
            task = await self._broker.get_task(parked.task_id)
        except Exception as exc:
            logger.info("webhook.parked_check_failed task=%s error=%r", parked.task_id, exc)
            task = None
        if self._parked.get(lease_id) is not parked:
            return False  # a heartbeat (or a result) came meanwhile
        if (
            task is not None
            and task.lease_id == lease_id
            and task.lease_expires_at is not None
            and task.lease_expires_at > self._clock.now()
        ):
            self._watch_parked(lease_id, parked.task_id, task.lease_expires_at)
            return False
        self._parked.forget(lease_id)
        dropped = await self.gateway.fail_held(lease_id, STOPPED_HEARTBEATING)
        if dropped:
            logger.info(
                "webhook.parked_lease_lapsed worker=%s task=%s lease=%s",
                self.name,
                parked.task_id,
                lease_id,
            )
        self._apply_cap()
        return dropped

    async def sweep_lapsed(self) -> int:
        """End every parked delivery whose last known lease expiry has passed (timers do
        this on their own); how many were ended."""
        dropped = 0
        for lease_id in list(self._parked):
            dropped += await self._check_parked(lease_id)
        return dropped

    # -------------------------------------------------------------- callbacks

    async def handle_callback(self, callback: cluster_pb2.WebhookCallback) -> Status:
        """Apply one endpoint callback (Heartbeat or ReportResult) and say how it went
        (never raises)."""
        return await answer(self.name, callback, self._apply_callback)

    async def _apply_callback(self, callback: cluster_pb2.WebhookCallback) -> Status:
        if callback.WhichOneof("kind") == "heartbeat":
            return await self._on_beat(callback)
        return await self._on_outcome(callback)

    async def _on_beat(self, callback: cluster_pb2.WebhookCallback) -> Status:
        task_id, lease_id = callback.task_id, callback.lease_id
        expires = await self.gateway.extend_held(task_id, lease_id)
        if expires is None:
            # Not ours (made before a restart, say): take it on as parked when it is a
            # live task of a queue we serve.
            task = await live_task(self._broker, callback, self.gateway.capacity)
            if self.serving and self.gateway.adopt(task):
                self._parked.park(lease_id)
                self._apply_cap()
                expires = await self.gateway.extend_held(task_id, lease_id)
            if expires is None:
                expires = await self._broker.extend_lease(
                    task_id, lease_id, self._config.gateway.lease_ttl
                )
        if lease_id in self._parked:
            self._watch_parked(lease_id, task_id, expires)
        if callback.heartbeat.progress:
            await self._broker.set_progress(task_id, lease_id, callback.heartbeat.progress)
        return reply(Status.STATUS_OK, expires=expires.timestamp())

    async def _on_outcome(self, callback: cluster_pb2.WebhookCallback) -> Status:
        return await apply_result(
            self.name, callback, self._resolve, self._config.gateway.max_result
        )

    async def _resolve(self, result: service_pb2.Result, *, queue: str) -> bool:
        try:
            applied = await self.gateway.resolve(result, queue=queue)
        finally:
            # Resolved (or failed in the broker): the Gateway holds it no more.
            lease_id = result.lease_id
            if not self.gateway.holds_lease(lease_id) and self._parked.forget(lease_id):
                self._apply_cap()
        # A synchronous request still open for this delivery has nothing left to say.
        open_ = self._deliveries.pop(result.lease_id, None)
        if open_ is not None:
            open_.cancel()
        return applied
