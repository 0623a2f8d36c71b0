"""Answering webhook callbacks: the endpoint's Heartbeat and ReportResult calls, which the
api's WebhookService verifies and routes here over NATS as a ``WebhookCallback``
(:meth:`conveyor_runtime.bus.Bus.webhook_callback`, queue group ``webhook``).

The leading manager answers for every stored registration: through its running
:class:`~conveyor_webhook.gateway.WebhookGateway` when there is one, else through a
:class:`CallbackResponder`, which makes only lease-scoped broker calls (a registration
that is paused or restarting still has asynchronous deliveries in flight). Every
callback gets a reply, a broker failure included, so the api never waits for a timeout:

- ``STATUS_OK`` (a heartbeat: with the new lease expiry);
- ``STATUS_LEASE_LOST``: the task is gone, not ACTIVE, or under another lease;
- ``STATUS_INVALID`` with the reason: a malformed callback (one that does not even decode
  is answered by the bus, :data:`~conveyor_runtime.bus.MALFORMED_CALLBACK`), an outcome
  that is not final, a result over this service's ``max_result``, a task on a queue the
  registration does not serve; and :data:`~conveyor_gateway.outcomes.BROKER_UNAVAILABLE`
  when the broker failed (the api turns that one into UNAVAILABLE: retry).

Each answer counts in ``conveyor_webhook_callbacks_total`` by registration, kind
(heartbeat, result) and status (ok, lease_lost, invalid).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Container
from datetime import timedelta
from typing import Protocol

from conveyor_broker import (
    Broker,
    InvalidTask,
    LeaseLost,
    Task,
    TaskNotFound,
    TaskState,
    WebhookWorker,
)
from conveyor_gateway.outcomes import BROKER_UNAVAILABLE
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime import metrics, wire

from conveyor_webhook.config import Wiring
from conveyor_webhook.response import OUTCOMES

logger = logging.getLogger(__name__)

__all__ = [
    "CallbackResponder",
    "Handler",
    "NotServed",
    "Resolve",
    "Status",
    "answer",
    "apply_result",
    "live_task",
    "outcome_result",
    "reply",
    "set_retry_after",
]

Status = cluster_pb2.WebhookCallbackReply
#: Longest retry_after a callback may ask for (the api refuses longer ones already).
MAX_RETRY_AFTER = timedelta(days=30)
_FINAL_OUTCOMES = frozenset(OUTCOMES.values())


class NotServed(Exception):
    """The callback's task is on a queue the registration does not serve."""


def reply(status: Status.Status, message: str = "", expires: float = 0.0) -> Status:
    """A WebhookCallbackReply."""
    return Status(status=status, message=message, lease_expires_at=expires)


def set_retry_after(
    result: service_pb2.Result, seconds: float | None, limit: timedelta = MAX_RETRY_AFTER
) -> None:
    """Put ``seconds`` (None or negative: none) on ``result`` as its retry_after; more
    than ``limit`` is left to the server's backoff."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return
    if seconds <= limit.total_seconds():
        result.retry_after.CopyFrom(wire.duration(timedelta(seconds=seconds)))


def outcome_result(callback: cluster_pb2.WebhookCallback) -> service_pb2.Result:
    """The stream Result a ReportResult callback stands for."""
    outcome = callback.result
    result = service_pb2.Result(
        task_id=callback.task_id,
        lease_id=callback.lease_id,
        outcome=outcome.outcome,
        result=outcome.result,
        error=outcome.error,
    )
    set_retry_after(result, outcome.retry_after)
    return result


def result_problem(callback: cluster_pb2.WebhookCallback, max_result: int) -> Status | None:
    """Why a ReportResult callback cannot be applied as it is (None: it can)."""
    outcome = callback.result
    if outcome.outcome not in _FINAL_OUTCOMES:
        return reply(Status.STATUS_INVALID, f"outcome {outcome.outcome} is not final")
    if outcome.outcome == service_pb2.OUTCOME_SUCCESS and len(outcome.result) > max_result:
        return reply(
            Status.STATUS_INVALID,
            f"result is {len(outcome.result)} bytes; the limit is {max_result}",
        )
    return None


class Resolve(Protocol):
    """Applies a stream Result of a task on ``queue``: False when the lease is lost,
    ValueError when the queue is not served (:meth:`conveyor_gateway.gateway.Gateway.resolve`)."""

    def __call__(self, result: service_pb2.Result, *, queue: str) -> Awaitable[bool]: ...


async def apply_result(
    name: str,
    callback: cluster_pb2.WebhookCallback,
    resolve: Resolve,
    max_result: int,
    *,
    via: str = "",
) -> Status:
    """Apply the ReportResult ``callback`` of registration ``name`` with ``resolve`` and
    say how it went: INVALID for a result :func:`result_problem` refuses or a task on a
    queue not served (``resolve`` raises ValueError), LEASE_LOST when it was not applied.
    ``via`` names who applied it in the log line (none: the running gateway)."""
    problem = result_problem(callback, max_result)
    if problem is not None:
        return problem
    try:
        applied = await resolve(outcome_result(callback), queue=callback.queue)
    except ValueError as exc:  # a task on a queue it does not serve
        return reply(Status.STATUS_INVALID, str(exc))
    if not applied:
        return reply(Status.STATUS_LEASE_LOST, "lease lost")
    logger.info(
        "webhook.callback_result worker=%s task=%s outcome=%s%s",
        name,
        callback.task_id,
        service_pb2.Outcome.Name(callback.result.outcome),
        f" via={via}" if via else "",
    )
    return reply(Status.STATUS_OK)


async def live_task(
    broker: Broker, callback: cluster_pb2.WebhookCallback, queues: Container[str]
) -> Task:
    """The callback's task, ACTIVE under the callback's lease. Raises LeaseLost when it
    is not (TaskNotFound when it does not exist), NotServed when its queue is not in
    ``queues``."""
    task = await broker.get_task(callback.task_id)
    if task.state != TaskState.ACTIVE or task.lease_id != callback.lease_id:
        raise LeaseLost(callback.task_id, callback.lease_id)
    if task.queue not in queues:
        raise NotServed(f"task {task.id} is on queue {task.queue!r}, which is not served here")
    return task


#: Answers one callback (a ``handle_callback``).
Handler = Callable[[cluster_pb2.WebhookCallback], Awaitable[Status]]


#: The ``status`` label of each reply status.
_STATUS_LABELS = {
    Status.STATUS_OK: "ok",
    Status.STATUS_LEASE_LOST: "lease_lost",
    Status.STATUS_INVALID: "invalid",
}


async def answer(name: str, callback: cluster_pb2.WebhookCallback, handle: Handler) -> Status:
    """Check ``callback`` for registration ``name``, apply it with ``handle``, and say
    how it went (and count it). Never raises (but CancelledError)."""
    status = await _answer(name, callback, handle)
    kind = callback.WhichOneof("kind") or "none"
    label = _STATUS_LABELS.get(status.status, "invalid")
    metrics.WEBHOOK_CALLBACKS.labels(metrics.WORKER(name), kind, label).inc()
    return status


async def _answer(name: str, callback: cluster_pb2.WebhookCallback, handle: Handler) -> Status:
    if callback.worker and callback.worker != name:
        return reply(
            Status.STATUS_INVALID,
            f"callback for webhook worker {callback.worker!r} reached {name!r}",
        )
    if not callback.task_id or not callback.lease_id:
        return reply(Status.STATUS_INVALID, "callback needs a task id and a lease id")
    if callback.WhichOneof("kind") is None:
        return reply(Status.STATUS_INVALID, "callback carries neither a heartbeat nor a result")
    try:
        return await handle(callback)
    except (LeaseLost, TaskNotFound):
        return reply(Status.STATUS_LEASE_LOST, "lease lost")
    except (InvalidTask, NotServed) as exc:
        return reply(Status.STATUS_INVALID, str(exc))
    except Exception:
        logger.exception(
            "webhook.callback_failed worker=%s task=%s lease=%s",
            name,
            callback.task_id,
            callback.lease_id,
        )
        return reply(Status.STATUS_INVALID, BROKER_UNAVAILABLE)


class CallbackResponder:
    """Answers the callbacks of one registration while no gateway of it runs (paused,
    restarting, not started yet, left without a secret): a heartbeat extends the lease in
    the broker, a result gets the outcome mapping of a running gateway
    (:class:`~conveyor_gateway.outcomes.Outcomes`), both scoped to the callback's lease.
    It holds nothing and counts nothing.
    """

    def __init__(self, worker: WebhookWorker, wiring: Wiring) -> None:
        self.name = worker.name
        self._broker = wiring.broker
        self._config = wiring.config
        self._outcomes = wiring.outcomes(f"whcb-{worker.name}")
        self.worker = worker

    def refresh(self, worker: WebhookWorker) -> None:
        """Take the stored registration (its queues decide which tasks it answers for)."""
        self.worker = worker

    async def handle_callback(self, callback: cluster_pb2.WebhookCallback) -> Status:
        """Apply one callback and say how it went (never raises)."""
        return await answer(self.name, callback, self._apply)

    async def _apply(self, callback: cluster_pb2.WebhookCallback) -> Status:
        if callback.WhichOneof("kind") == "heartbeat":
            await live_task(self._broker, callback, dict(self.worker.queues))
            expires = await self._broker.extend_lease(
                callback.task_id, callback.lease_id, self._config.gateway.lease_ttl
            )
            if callback.heartbeat.progress:
                await self._broker.set_progress(
                    callback.task_id, callback.lease_id, callback.heartbeat.progress
                )
            return reply(Status.STATUS_OK, expires=expires.timestamp())
        return await apply_result(
            self.name,
            callback,
            self._resolve,
            self._config.gateway.max_result,
            via="responder",
        )

    async def _resolve(self, result: service_pb2.Result, *, queue: str) -> bool:
        return await self._outcomes.resolve(result, queue=queue, served=self.worker.queues)
