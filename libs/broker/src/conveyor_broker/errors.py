"""Errors raised by every Broker implementation."""

from __future__ import annotations


class BrokerError(Exception):
    """Base class of every error a broker raises on purpose."""


class InvalidTask(BrokerError, ValueError):
    """The request is malformed (bad queue name, negative TTL, ...). Nothing was stored."""


class TaskNotFound(BrokerError, LookupError):
    """No task has this id."""

    def __init__(self, task_id: str) -> None:
        super().__init__(f"task {task_id!r} not found")
        self.task_id = task_id


class DuplicateTask(BrokerError):
    """A live task already holds this (queue, unique_key) claim."""

    def __init__(self, queue: str, unique_key: str, existing_id: str) -> None:
        super().__init__(
            f"queue {queue!r} already has live task {existing_id!r} with unique key {unique_key!r}"
        )
        self.queue = queue
        self.unique_key = unique_key
        self.existing_id = existing_id


class LeaseLost(BrokerError):
    """The task is no longer active under this lease id (reaped, canceled, or re-leased)."""

    def __init__(self, task_id: str, lease_id: str) -> None:
        super().__init__(f"lease {lease_id!r} on task {task_id!r} is lost")
        self.task_id = task_id
        self.lease_id = lease_id


class InvalidState(BrokerError):
    """The task exists but is in a state that does not allow this operation."""

    def __init__(self, task_id: str, state: str, operation: str) -> None:
        super().__init__(f"cannot {operation} task {task_id!r} in state {state!r}")
        self.task_id = task_id
        self.state = state
        self.operation = operation


class NotSupported(BrokerError):
    """The request asks for something this server does not do yet (say, an option whose
    feature is not built). Nothing was stored: a task that could never move is refused
    rather than kept waiting forever."""


class QueueFull(BrokerError):
    """A queue's backlog is at its admission limit (the api's
    CONVEYOR_ENQUEUE_BACKLOG_LIMIT): nothing was stored; retry later."""


class BrokerClosed(BrokerError):
    """The broker was closed."""


class WebhookWorkerNotFound(BrokerError, LookupError):
    """No webhook worker registration has this name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no webhook worker named {name!r}")
        self.name = name


class DatabaseUnavailable(ConnectionError):
    """The database could not serve the call: unreachable, a connection lost or wedged
    (no answer within the command timeout), the pool exhausted past its acquire timeout.

    Not a :class:`BrokerError`: it is never the request's fault, and the call may be
    retried as it is. It is a :class:`ConnectionError` so that whatever already treats
    a lost link as transient (an ``OSError``) treats it so too. The message is a clean
    sentence; the driver's own text (which can be internal, like asyncpg's "cannot
    switch to state ...") is logged where it happens and kept as ``__cause__``.
    """


class CronEntryNotFound(BrokerError, LookupError):
    """No cron entry has this name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no cron entry named {name!r}")
        self.name = name


class RateLimitNotFound(BrokerError, LookupError):
    """No rate limit is stored for this queue."""

    def __init__(self, queue: str) -> None:
        super().__init__(f"no rate limit for queue {queue!r}")
        self.queue = queue


class BreakerConfigNotFound(BrokerError, LookupError):
    """No circuit breaker config is stored for this queue and type pattern."""

    def __init__(self, queue: str, pattern: str) -> None:
        super().__init__(f"no breaker config for queue {queue!r} and type pattern {pattern!r}")
        self.queue = queue
        self.pattern = pattern


class ConcurrencyLimitNotFound(BrokerError, LookupError):
    """No concurrency limit is stored for this queue and key pattern."""

    def __init__(self, queue: str, pattern: str) -> None:
        super().__init__(f"no concurrency limit for queue {queue!r} and key pattern {pattern!r}")
        self.queue = queue
        self.pattern = pattern


class GroupConfigNotFound(BrokerError, LookupError):
    """No group config is stored for this queue and pattern."""

    def __init__(self, queue: str, pattern: str) -> None:
        super().__init__(f"no group config for queue {queue!r} and pattern {pattern!r}")
        self.queue = queue
        self.pattern = pattern
