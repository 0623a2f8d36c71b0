"""Conveyor's Python SDK: enqueue tasks with a Client, run them with a Worker, operate
the queues with an AdminClient; :mod:`conveyor.webhooks` helps webhook endpoints (verify
a delivery's signature, call back for asynchronous deliveries).

::

    from conveyor import AsyncClient, Worker

    async with AsyncClient("127.0.0.1:50051") as client:
        await client.enqueue("email.send", {"to": "a@example.com"}, queue="emails")

    worker = Worker("127.0.0.1:50051", queues={"emails": 1})

    @worker.task("email.send")
    async def send(payload, ctx):
        ...

    @worker.batch_task("digest.send")      # an aggregation group's tasks, together
    async def digest(payloads, batch):
        ...

    worker.run_forever()
"""

from __future__ import annotations

from conveyor import webhooks
from conveyor._clients.admin import AsyncAdminClient
from conveyor._clients.admin_sync import AdminClient
from conveyor._clients.admin_types import (
    BatchActionResult,
    Breaker,
    BreakerConfig,
    BreakerScope,
    BreakerState,
    ClusterInfo,
    ClusterNode,
    ConcurrencyLimit,
    CronEntry,
    CronMisfire,
    CronSpec,
    DependencyOutcome,
    DependencyPage,
    GroupConfig,
    GroupStats,
    QueueInfo,
    QueuePage,
    RateLimit,
    TaskDependency,
    TaskEvent,
    TaskPage,
    WebhookGateway,
    WebhookWorker,
    WhoAmI,
    WorkerSession,
    cron,
)
from conveyor._clients.events import AsyncEventStream, EventStream
from conveyor._clients.producer import AsyncClient
from conveyor._clients.producer_sync import Client
from conveyor._errors import (
    AlreadyExists,
    BreakerConfigNotFound,
    CodecError,
    ConcurrencyLimitNotFound,
    ConveyorError,
    CronEntryNotFound,
    DeadlineExceeded,
    FailedPrecondition,
    GroupConfigNotFound,
    InvalidArgument,
    PermissionDenied,
    RateLimitNotFound,
    ResourceExhausted,
    RetryAfter,
    SkipRetry,
    TaskNotFound,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    WebhookWorkerNotFound,
)
from conveyor._ids import new_task_id
from conveyor._payload import Codec, JsonCodec, RawCodec
from conveyor._types import (
    EnqueueResult,
    OnFailure,
    TaskInfo,
    TaskOptions,
    TaskSpec,
    TaskState,
    spec,
)
from conveyor._version import __version__
from conveyor._worker.context import BatchContext, TaskContext
from conveyor._worker.dependencies import DependencyResult
from conveyor._worker.reconnect import ReconnectBackoff
from conveyor._worker.worker import Worker

__all__ = [
    "AdminClient",
    "AlreadyExists",
    "AsyncAdminClient",
    "AsyncClient",
    "AsyncEventStream",
    "BatchActionResult",
    "BatchContext",
    "Breaker",
    "BreakerConfig",
    "BreakerConfigNotFound",
    "BreakerScope",
    "BreakerState",
    "Client",
    "ClusterInfo",
    "ClusterNode",
    "Codec",
    "CodecError",
    "ConcurrencyLimit",
    "ConcurrencyLimitNotFound",
    "ConveyorError",
    "CronEntry",
    "CronEntryNotFound",
    "CronMisfire",
    "CronSpec",
    "DeadlineExceeded",
    "DependencyOutcome",
    "DependencyPage",
    "DependencyResult",
    "EnqueueResult",
    "EventStream",
    "FailedPrecondition",
    "GroupConfig",
    "GroupConfigNotFound",
    "GroupStats",
    "InvalidArgument",
    "JsonCodec",
    "OnFailure",
    "PermissionDenied",
    "QueueInfo",
    "QueuePage",
    "RateLimit",
    "RateLimitNotFound",
    "RawCodec",
    "ReconnectBackoff",
    "ResourceExhausted",
    "RetryAfter",
    "SkipRetry",
    "TaskContext",
    "TaskDependency",
    "TaskEvent",
    "TaskInfo",
    "TaskNotFound",
    "TaskOptions",
    "TaskPage",
    "TaskSpec",
    "TaskState",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "WebhookGateway",
    "WebhookWorker",
    "WebhookWorkerNotFound",
    "WhoAmI",
    "Worker",
    "WorkerSession",
    "__version__",
    "cron",
    "new_task_id",
    "spec",
    "webhooks",
]
