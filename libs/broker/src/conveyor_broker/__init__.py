"""Conveyor's broker: the durable task store, its implementations and conformance suite."""

from __future__ import annotations

from conveyor_broker.backoff import Backoff
from conveyor_broker.clock import Clock, FakeClock, SystemClock
from conveyor_broker.errors import (
    BrokerClosed,
    BrokerError,
    DuplicateTask,
    InvalidState,
    InvalidTask,
    LeaseLost,
    TaskNotFound,
    WebhookWorkerNotFound,
)
from conveyor_broker.interface import DEFAULT_MAX_RETRY, MAX_BATCH, Broker, EventSink
from conveyor_broker.types import (
    INCOMPLETE_STATES,
    LEASABLE_STATES,
    TERMINAL_STATES,
    WAITING_STATES,
    AckItem,
    BrokerInfo,
    EnqueueResult,
    LeaseRef,
    NewTask,
    OnFailure,
    QueueStats,
    ReapedTask,
    Task,
    TaskEvent,
    TaskPage,
    TaskState,
    WebhookWorker,
    WebhookWorkerSpec,
)

__all__ = [
    "DEFAULT_MAX_RETRY",
    "INCOMPLETE_STATES",
    "LEASABLE_STATES",
    "MAX_BATCH",
    "TERMINAL_STATES",
    "WAITING_STATES",
    "AckItem",
    "Backoff",
    "Broker",
    "BrokerClosed",
    "BrokerError",
    "BrokerInfo",
    "Clock",
    "DuplicateTask",
    "EnqueueResult",
    "EventSink",
    "FakeClock",
    "InvalidState",
    "InvalidTask",
    "LeaseLost",
    "LeaseRef",
    "NewTask",
    "OnFailure",
    "QueueStats",
    "ReapedTask",
    "SystemClock",
    "Task",
    "TaskEvent",
    "TaskNotFound",
    "TaskPage",
    "TaskState",
    "WebhookWorker",
    "WebhookWorkerNotFound",
    "WebhookWorkerSpec",
]
