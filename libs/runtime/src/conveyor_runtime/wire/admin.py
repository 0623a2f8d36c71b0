"""The AdminService's own messages: queue stats, dependency edges and webhook worker
registrations.

Task reads and task actions use :mod:`conveyor_runtime.wire.tasks`; this module holds what
only operators exchange with the api.
"""

from __future__ import annotations

from collections.abc import Iterable

from conveyor_broker.errors import InvalidTask
from conveyor_broker.types import (
    Breaker,
    DependencyLink,
    DependencyOutcome,
    QueueStats,
    TaskState,
    WebhookWorker,
    WebhookWorkerSpec,
)
from conveyor_broker.validation import (
    check_webhook_name,
    check_webhook_secret,
    check_webhook_worker,
    unique_batch_types,
)
from conveyor_protos.v1 import service_pb2

from conveyor_runtime.wire.breakers import breaker_to_proto
from conveyor_runtime.wire.tasks import state_to_proto
from conveyor_runtime.wire.time import duration, from_duration, set_timestamp

#: What an UpsertWebhookWorker that leaves a field unset (zero) gets.
DEFAULT_WEBHOOK_SPEC = WebhookWorkerSpec(name="", url="", queues={})


def stats_to_proto(stats: QueueStats, breakers: Iterable[Breaker] = ()) -> service_pb2.QueueStats:
    """Broker queue stats as the wire message (counts keyed by state name), with the
    queue's ``breakers`` that are not closed."""
    return service_pb2.QueueStats(
        queue=stats.queue,
        paused=stats.paused,
        counts={state.value: stats.count(state) for state in TaskState},
        breakers=[breaker_to_proto(b) for b in breakers],
    )


_OUTCOME_TO_PROTO = {
    DependencyOutcome.OPEN: service_pb2.DEPENDENCY_OUTCOME_OPEN,
    DependencyOutcome.SATISFIED: service_pb2.DEPENDENCY_OUTCOME_SATISFIED,
    DependencyOutcome.FAILED: service_pb2.DEPENDENCY_OUTCOME_FAILED,
}


def dependency_to_proto(link: DependencyLink) -> service_pb2.TaskDependency:
    """A dependency edge as the wire message (the other task's fields empty when it is
    gone)."""
    return service_pb2.TaskDependency(
        task_id=link.task_id,
        outcome=_OUTCOME_TO_PROTO[link.outcome],
        queue=link.queue or "",
        type=link.type or "",
        state=state_to_proto(link.state),
    )


def webhook_worker_to_proto(worker: WebhookWorker) -> service_pb2.WebhookWorker:
    """A stored registration as the wire message, WITHOUT its secrets (write-only)."""
    message = service_pb2.WebhookWorker(
        name=worker.name,
        url=worker.url,
        queues=dict(worker.queues),
        concurrency=worker.concurrency,
        timeout=duration(worker.timeout),
        paused=worker.paused,
        batch_types=worker.batch_types,
    )
    set_timestamp(message.created_at, worker.created_at)
    set_timestamp(message.updated_at, worker.updated_at)
    return message


def webhook_spec_from_proto(message: service_pb2.WebhookWorker) -> WebhookWorkerSpec:
    """An operator's registration as the broker's spec, checked.

    ``concurrency`` 0 and an unset ``timeout`` take the defaults (10, 30 s); no secrets
    keeps the stored ones; ``batch_types`` are kept once each, in order. The secrets are
    as the operator gave them (plaintext, each checked by
    :func:`~conveyor_broker.validation.check_webhook_secret`): the caller seals them
    before the broker stores them. Raises InvalidTask describing the first problem.
    """
    check_webhook_name(message.name)
    timeout = DEFAULT_WEBHOOK_SPEC.timeout
    if message.HasField("timeout"):
        try:
            timeout = from_duration(message.timeout)
        except (ValueError, OverflowError) as exc:
            raise InvalidTask(f"invalid webhook timeout: {exc}") from None
    spec = WebhookWorkerSpec(
        name=message.name,
        url=message.url,
        queues=dict(message.queues),
        concurrency=message.concurrency or DEFAULT_WEBHOOK_SPEC.concurrency,
        timeout=timeout,
        paused=message.paused,
        secrets=tuple(message.secrets),
        batch_types=unique_batch_types(message.batch_types),
    )
    check_webhook_worker(spec)
    for secret in spec.secrets:
        check_webhook_secret(secret)
    return spec
