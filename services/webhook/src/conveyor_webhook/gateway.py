"""WebhookGateway: the api's :class:`~conveyor_api.gateway.Gateway` with an HTTP transport.

One per active webhook registration. The Gateway does everything it does for a stream
worker (capacity registration, credits, holding, outcome transitions, lease extension);
this class is its ``send`` callable and its callback surface:

- A Dispatch/Dispatches frame becomes one signed HTTP delivery per task, all concurrent.
  The answer (:mod:`conveyor_webhook.response`) becomes a Result fed to the Gateway like a
  stream Result; ``accepted`` parks the delivery instead (asynchronous mode).
- A Cancel frame (lease lost, attempt overran, admin cancel) cancels that task's HTTP
  request if it is still in flight.
- While any synchronous delivery is open, the Gateway's heartbeat runs every
  ``lease_ttl / 3``; it skips parked deliveries, whose leases only the endpoint's
  Heartbeat callbacks extend. A parked delivery whose last known lease expiry passes is
  dropped (its slot freed); the reaper takes the task back.
- Callbacks arrive over NATS (``Subjects.webhook_callback(name)``, queue group
  ``webhook``) from the api's WebhookService and are answered with a
  WebhookCallbackReply.
- The endpoint's circuit breaker (:mod:`conveyor_webhook.breaker`) caps the Gateway's
  concurrency: 0 while open, 1 while probing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import aiohttp
from conveyor_api.coalesce import WakePublisher
from conveyor_api.gateway import Gateway, GatewayConfig, WorkerSpec
from conveyor_api.group_commit import AckBatcher
from conveyor_broker import Broker, InvalidTask, LeaseLost, TaskNotFound, WebhookWorker
from conveyor_broker.ids import new_id
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime import codec
from conveyor_runtime.subjects import Subjects
from google.protobuf.message import DecodeError
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from conveyor_webhook.breaker import CircuitBreaker
from conveyor_webhook.delivery import delivery_body, delivery_headers
from conveyor_webhook.response import (
    OUTCOMES,
    Accepted,
    Broken,
    Finished,
    Reply,
    parse_response,
    transport_failure,
)
from conveyor_webhook.version import __version__

logger = logging.getLogger(__name__)

#: The NATS queue group every webhook gateway's callback subscription joins.
CALLBACK_GROUP = "webhook"
#: Room in a response body beyond the base64 of the largest result.
RESPONSE_HEADROOM = 64 * 1024
#: Longest retry_after a callback may ask for (larger ones use the server's backoff).
MAX_RETRY_AFTER = timedelta(days=3650)
#: How long past a registration's timeout a drain waits for open deliveries' answers.
DRAIN_GRACE = 1.0

_Status = cluster_pb2.WebhookCallbackReply
_FINAL_OUTCOMES = frozenset(OUTCOMES.values())


class ResponseTooLarge(Exception):
    """The endpoint's response body is over the limit."""


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """What every webhook gateway of a manager shares."""

    gateway: GatewayConfig
    #: The api's public gRPC address, sent in every delivery (empty: none).
    callback_address: str = ""
    breaker_threshold: int = 5
    breaker_cooldown: float = 30.0


def _reply(status: _Status.Status, message: str = "", expires: float = 0.0) -> _Status:
    return _Status(status=status, message=message, lease_expires_at=expires)


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
    _set_retry_after(result, reply.retry_after)
    return result


def _set_retry_after(result: service_pb2.Result, seconds: float | None) -> None:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return
    delay = timedelta(seconds=seconds) if seconds < MAX_RETRY_AFTER.total_seconds() else None
    if delay is not None:
        result.retry_after.CopyFrom(codec.duration(delay))


class WebhookGateway:
    """Serves one webhook registration: deliveries, callbacks, circuit breaker."""

    def __init__(
        self,
        worker: WebhookWorker,
        *,
        broker: Broker,
        nc: NATS,
        subjects: Subjects,
        config: WebhookConfig,
        acks: AckBatcher,
        wakes: WakePublisher,
        http: aiohttp.ClientSession,
    ) -> None:
        if not worker.secrets:
            raise ValueError(f"webhook worker {worker.name!r} has no secret to sign with")
        self.worker = worker
        self.name = worker.name
        self._broker = broker
        self._nc = nc
        self._subjects = subjects
        self._config = config
        self._clock = config.gateway.clock
        self._http = http
        self._max_body = config.gateway.max_result * 4 // 3 + RESPONSE_HEADROOM
        now = self._clock.now()
        spec = WorkerSpec(
            queues=dict(worker.queues),
            concurrency=worker.concurrency,
            labels={"webhook": worker.name},
            worker_id=f"webhook:{worker.name}",
            sdk_version=f"conveyor-webhook/{__version__}",
            accepts_dispatches=True,
        )
        self.gateway = Gateway(
            f"wh-{worker.name}-{new_id(now)}",
            spec,
            broker=broker,
            nc=nc,
            subjects=subjects,
            config=config.gateway,
            acks=acks,
            wakes=wakes,
            send=self._send,
            connected_at=now,
        )
        self.breaker = CircuitBreaker(config.breaker_threshold, config.breaker_cooldown)
        self._deliveries: dict[str, asyncio.Task[None]] = {}  # lease id -> open delivery
        self._parked: dict[str, datetime] = {}  # lease id -> last known lease expiry
        self._parked_timers: dict[str, asyncio.TimerHandle] = {}
        self._breaker_timer: asyncio.TimerHandle | None = None
        self._beat: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()
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
        """Deliveries the endpoint accepted and has not finished yet."""
        return len(self._parked)

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Answer callbacks, then start the Gateway (announce capacity, take dispatches)."""
        self._sub = await self._nc.subscribe(
            self._subjects.webhook_callback(self.name),
            queue=CALLBACK_GROUP,
            cb=self._on_callback,
        )
        await self.gateway.start()
        logger.info(
            "webhook.gateway_started worker=%s gateway=%s url=%s",
            self.name,
            self.id,
            self.worker.url,
        )

    def refresh(self, worker: WebhookWorker) -> None:
        """Take a changed url, timeout or secrets in place (for deliveries from now on).

        Queues and concurrency cannot change in place: the manager restarts the gateway.
        """
        if not worker.secrets:
            raise ValueError(f"webhook worker {worker.name!r} has no secret to sign with")
        self.worker = worker

    async def drain(self) -> None:
        """Stop taking work, wait for open synchronous deliveries (up to the registration's
        timeout), then release everything still held and stop answering callbacks.

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
        self._cancel_breaker_timer()
        open_ = list(self._deliveries.values())
        if open_:
            # Take no more work while the open deliveries finish.
            self.gateway.cap_concurrency(0)
            await asyncio.wait(open_, timeout=self.worker.timeout.total_seconds() + DRAIN_GRACE)
        for task in list(self._deliveries.values()):
            task.cancel()
        await self.gateway.close()
        for handle in self._parked_timers.values():
            handle.cancel()
        self._parked_timers.clear()
        self._parked.clear()
        if self._beat is not None:
            self._beat.cancel()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # the connection may be gone already
                logger.debug("webhook.unsubscribe_failed worker=%s error=%r", self.name, exc)
            self._sub = None
        pending = [*self._deliveries.values(), *self._tasks]
        if self._beat is not None:
            pending.append(self._beat)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        logger.info("webhook.gateway_drained worker=%s gateway=%s", self.name, self.id)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------- transport

    def _send(self, frame: service_pb2.ServerFrame) -> None:
        kind = frame.WhichOneof("frame")
        if kind == "dispatches":
            for env in frame.dispatches.tasks:
                self._open(env)
        elif kind == "dispatch":
            self._open(frame.dispatch.task)
        elif kind == "cancel":
            self._on_cancel(frame.cancel)
        else:
            logger.debug("webhook.frame_ignored worker=%s kind=%s", self.name, kind)

    def _open(self, env: task_pb2.TaskEnvelope) -> None:
        lease_id = env.lease_id
        task = asyncio.get_running_loop().create_task(self._deliver(env))
        self._deliveries[lease_id] = task

        def closed(done: asyncio.Task[None]) -> None:
            if self._deliveries.get(lease_id) is done:
                del self._deliveries[lease_id]
            if not done.cancelled() and done.exception() is not None:
                logger.error(
                    "webhook.delivery_crashed worker=%s task=%s",
                    self.name,
                    env.id,
                    exc_info=done.exception(),
                )
                # Fail the attempt rather than hold (and keep extending) its lease.
                crashed = Broken(f"webhook delivery failed: {done.exception()!r}")
                if not self.gateway.closed:
                    result = as_result(crashed, env.id, lease_id)
                    self.gateway.on_frame(service_pb2.WorkerFrame(result=result))

        task.add_done_callback(closed)
        if self._beat is None or self._beat.done():
            self._beat = asyncio.get_running_loop().create_task(self._beat_loop())

    def _on_cancel(self, cancel: service_pb2.Cancel) -> None:
        self._forget_parked(cancel.lease_id)
        task = self._deliveries.pop(cancel.lease_id, None)
        if task is not None:
            task.cancel()
            logger.info(
                "webhook.delivery_canceled worker=%s task=%s reason=%s",
                self.name,
                cancel.task_id,
                cancel.reason,
            )

    async def _beat_loop(self) -> None:
        # The bulk heartbeat extends every held lease that is not parked: exactly the
        # open synchronous deliveries.
        interval = self._config.gateway.lease_ttl.total_seconds() / 3
        heartbeat = service_pb2.WorkerFrame(heartbeat=service_pb2.Heartbeat())
        while self._deliveries:
            await asyncio.sleep(interval)
            if self._deliveries and not self.gateway.closed:
                self.gateway.on_frame(heartbeat)

    async def _deliver(self, env: task_pb2.TaskEnvelope) -> None:
        reply = await self._post(env, self.worker)
        self._record(reply)
        if isinstance(reply, Accepted):
            await self._park(env)
            return
        if isinstance(reply, Broken):
            logger.info(
                "webhook.delivery_failed worker=%s task=%s error=%s",
                self.name,
                env.id,
                reply.error,
            )
        result = as_result(reply, env.id, env.lease_id)
        self.gateway.on_frame(service_pb2.WorkerFrame(result=result))

    async def _post(self, env: task_pb2.TaskEnvelope, worker: WebhookWorker) -> Reply:
        secret = worker.secrets[0]
        body, _ = delivery_body(
            env, worker=worker.name, secret=secret, callback=self._config.callback_address
        )
        # Signature timestamps are wall time: the endpoint checks them against its clock.
        headers = delivery_headers(body, task_id=env.id, secret=secret, timestamp=int(time.time()))
        timeout = worker.timeout.total_seconds()
        try:
            async with asyncio.timeout(timeout):
                async with self._http.post(
                    worker.url, data=body, headers=headers, allow_redirects=False
                ) as response:
                    status = response.status
                    raw = await self._read(response)
        except TimeoutError:
            return transport_failure(f"endpoint did not answer within {timeout:g} s")
        except ResponseTooLarge:
            return Broken(f"endpoint response is larger than {self._max_body} bytes")
        except (aiohttp.ClientError, OSError) as exc:
            return transport_failure(f"could not reach the endpoint: {exc or type(exc).__name__}")
        return parse_response(status, raw, env.lease_id)

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        if response.content_length is not None and response.content_length > self._max_body:
            raise ResponseTooLarge
        chunks: list[bytes] = []
        size = 0
        while chunk := await response.content.readany():
            size += len(chunk)
            if size > self._max_body:
                raise ResponseTooLarge
            chunks.append(chunk)
        return b"".join(chunks)

    # -------------------------------------------------------- circuit breaker

    def _record(self, reply: Reply) -> None:
        now = asyncio.get_running_loop().time()
        if isinstance(reply, Broken) and reply.transport:
            self.breaker.record_failure(now)
        else:
            self.breaker.record_success(now)
        self._apply_breaker()

    def _apply_breaker(self) -> None:
        if self._draining:
            return
        loop = asyncio.get_running_loop()
        self.gateway.cap_concurrency(self.breaker.cap(loop.time()))
        self._cancel_breaker_timer()
        reopens_at = self.breaker.reopens_at()
        if reopens_at is not None:
            self._breaker_timer = loop.call_at(reopens_at, self._apply_breaker)

    def _cancel_breaker_timer(self) -> None:
        if self._breaker_timer is not None:
            self._breaker_timer.cancel()
            self._breaker_timer = None

    # --------------------------------------------------------- async (parked)

    async def _park(self, env: task_pb2.TaskEnvelope) -> None:
        if not self.gateway.park(env.lease_id):
            return  # finished (by a callback) or canceled meanwhile
        # The endpoint gets a full lease from the moment it accepted.
        try:
            expires = await self.gateway.extend_held(env.id, env.lease_id)
        except LeaseLost:
            return  # the Gateway dropped it
        except Exception:
            logger.exception("webhook.park_extend_failed worker=%s task=%s", self.name, env.id)
            expires = (
                codec.from_timestamp(env.lease_expires_at)
                if env.HasField("lease_expires_at")
                else self._clock.now()
            )
        if expires is not None and self.gateway.is_parked(env.lease_id):
            self._watch_parked(env.lease_id, expires)
            logger.info("webhook.delivery_accepted worker=%s task=%s", self.name, env.id)

    def _watch_parked(self, lease_id: str, expires: datetime) -> None:
        self._parked[lease_id] = expires
        old = self._parked_timers.pop(lease_id, None)
        if old is not None:
            old.cancel()
        delay = max(0.0, (expires - self._clock.now()).total_seconds())
        self._parked_timers[lease_id] = asyncio.get_running_loop().call_later(
            delay, self._check_parked, lease_id
        )

    def _forget_parked(self, lease_id: str) -> None:
        self._parked.pop(lease_id, None)
        handle = self._parked_timers.pop(lease_id, None)
        if handle is not None:
            handle.cancel()

    def _check_parked(self, lease_id: str) -> bool:
        expires = self._parked.get(lease_id)
        if expires is None:
            return False
        if not self.gateway.is_parked(lease_id):
            self._forget_parked(lease_id)
            return False
        if self._clock.now() < expires:
            self._watch_parked(lease_id, expires)
            return False
        self._forget_parked(lease_id)
        return self.gateway.drop_parked(lease_id)

    def sweep_lapsed(self) -> int:
        """Drop every parked delivery whose last known lease expiry has passed (timers do
        this on their own); how many were dropped."""
        return sum(self._check_parked(lease_id) for lease_id in list(self._parked))

    # -------------------------------------------------------------- callbacks

    async def _on_callback(self, msg: Msg) -> None:
        # One task per callback: a slow broker call must not hold up the others.
        self._spawn(self._answer(msg))

    async def _answer(self, msg: Msg) -> None:
        try:
            callback = cluster_pb2.WebhookCallback.FromString(msg.data)
        except DecodeError:
            reply = _reply(_Status.STATUS_INVALID, "malformed callback")
        else:
            try:
                reply = await self.handle_callback(callback)
            except Exception:
                # No answer: the api tells the endpoint to retry.
                logger.exception("webhook.callback_failed worker=%s", self.name)
                return
        if msg.reply:
            try:
                await msg.respond(reply.SerializeToString())
            except Exception as exc:
                logger.warning("webhook.callback_reply_failed worker=%s error=%r", self.name, exc)

    async def handle_callback(
        self, callback: cluster_pb2.WebhookCallback
    ) -> cluster_pb2.WebhookCallbackReply:
        """Apply one endpoint callback (Heartbeat or ReportResult) and say how it went."""
        if callback.worker and callback.worker != self.name:
            return _reply(
                _Status.STATUS_INVALID,
                f"callback for webhook worker {callback.worker!r} reached {self.name!r}",
            )
        if not callback.task_id or not callback.lease_id:
            return _reply(_Status.STATUS_INVALID, "callback needs a task id and a lease id")
        kind = callback.WhichOneof("kind")
        try:
            if kind == "heartbeat":
                return await self._on_beat(callback)
            if kind == "result":
                return await self._on_outcome(callback)
        except (LeaseLost, TaskNotFound):
            return _reply(_Status.STATUS_LEASE_LOST, "lease lost")
        except InvalidTask as exc:
            return _reply(_Status.STATUS_INVALID, str(exc))
        return _reply(_Status.STATUS_INVALID, "callback carries neither a heartbeat nor a result")

    async def _on_beat(self, callback: cluster_pb2.WebhookCallback) -> _Status:
        task_id, lease_id = callback.task_id, callback.lease_id
        expires = await self.gateway.extend_held(task_id, lease_id)
        if expires is None:
            # Not ours (made before a restart, say): the lease-scoped call is still safe.
            expires = await self._broker.extend_lease(
                task_id, lease_id, self._config.gateway.lease_ttl
            )
        elif self.gateway.is_parked(lease_id):
            self._watch_parked(lease_id, expires)
        if callback.heartbeat.progress:
            await self._broker.set_progress(task_id, lease_id, callback.heartbeat.progress)
        return _reply(_Status.STATUS_OK, expires=expires.timestamp())

    async def _on_outcome(self, callback: cluster_pb2.WebhookCallback) -> _Status:
        outcome = callback.result
        if outcome.outcome not in _FINAL_OUTCOMES:
            return _reply(_Status.STATUS_INVALID, f"outcome {outcome.outcome} is not final")
        result = service_pb2.Result(
            task_id=callback.task_id,
            lease_id=callback.lease_id,
            outcome=outcome.outcome,
            result=outcome.result,
            error=outcome.error,
        )
        _set_retry_after(result, outcome.retry_after)
        self._forget_parked(callback.lease_id)
        try:
            applied = await self.gateway.resolve(result, queue=callback.queue)
        except ValueError as exc:
            return _reply(_Status.STATUS_INVALID, str(exc))
        # A synchronous request still open for this delivery has nothing left to say.
        open_ = self._deliveries.pop(callback.lease_id, None)
        if open_ is not None:
            open_.cancel()
        if not applied:
            return _reply(_Status.STATUS_LEASE_LOST, "lease lost")
        logger.info(
            "webhook.callback_result worker=%s task=%s outcome=%s",
            self.name,
            callback.task_id,
            service_pb2.Outcome.Name(outcome.outcome),
        )
        return _reply(_Status.STATUS_OK)
