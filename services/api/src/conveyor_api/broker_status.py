"""How broker errors (and unexpected ones) surface as gRPC statuses."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import grpc
from conveyor_broker import (
    BreakerConfigNotFound,
    BrokerClosed,
    BrokerError,
    ConcurrencyLimitNotFound,
    CronEntryNotFound,
    DatabaseUnavailable,
    DuplicateTask,
    GroupConfigNotFound,
    InvalidState,
    InvalidTask,
    LeaseLost,
    NotSupported,
    QueueFull,
    RateLimitNotFound,
    TaskNotFound,
    WebhookWorkerNotFound,
)
from conveyor_broker.keyring import DecryptionError

logger = logging.getLogger(__name__)

#: Trailing-metadata key carrying the id of the live task that holds a unique key.
EXISTING_ID_KEY = "conveyor-existing-id"
#: The most UTF-8 bytes of a status message (and of an EnqueueBatch item's error). gRPC
#: sends the message percent-encoded in a trailer, and a client refuses trailers past 16
#: KiB: a message quoting a huge input (a queue name of 70,000 characters) reached the
#: client as RESOURCE_EXHAUSTED "metadata size exceeds hard limit" instead of its status.
MAX_STATUS_MESSAGE = 1024


def status_message(text: str) -> str:
    """``text``, cut to MAX_STATUS_MESSAGE bytes of UTF-8 (saying how long it was)."""
    data = text.encode(errors="replace")
    if len(data) <= MAX_STATUS_MESSAGE:
        return text
    kept = data[: MAX_STATUS_MESSAGE - 40].decode(errors="ignore")
    return f"{kept}... (cut: {len(text)} characters)"


_CODES: tuple[tuple[type[BrokerError], grpc.StatusCode], ...] = (
    (InvalidTask, grpc.StatusCode.INVALID_ARGUMENT),
    (TaskNotFound, grpc.StatusCode.NOT_FOUND),
    (InvalidState, grpc.StatusCode.FAILED_PRECONDITION),
    (DuplicateTask, grpc.StatusCode.ALREADY_EXISTS),
    (LeaseLost, grpc.StatusCode.FAILED_PRECONDITION),
    (BrokerClosed, grpc.StatusCode.UNAVAILABLE),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (WebhookWorkerNotFound, grpc.StatusCode.NOT_FOUND),
    (CronEntryNotFound, grpc.StatusCode.NOT_FOUND),
    (GroupConfigNotFound, grpc.StatusCode.NOT_FOUND),
    (RateLimitNotFound, grpc.StatusCode.NOT_FOUND),
    (ConcurrencyLimitNotFound, grpc.StatusCode.NOT_FOUND),
    (BreakerConfigNotFound, grpc.StatusCode.NOT_FOUND),
    (NotSupported, grpc.StatusCode.UNIMPLEMENTED),
    # A stored value this server has no key for: its configuration must change.
    (DecryptionError, grpc.StatusCode.FAILED_PRECONDITION),
)


def status_code_of(exc: BrokerError) -> grpc.StatusCode:
    """The gRPC status code for a broker error (INTERNAL for one we do not know)."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with_broker_error(
    context: grpc.aio.ServicerContext[Any, Any], exc: BrokerError
) -> NoReturn:
    """End the call with the status that matches ``exc``.

    A DuplicateTask also carries the holder's id in the ``conveyor-existing-id`` trailer,
    so a client can act on it without parsing the message.
    """
    trailers: tuple[tuple[str, str], ...] = ()
    if isinstance(exc, DuplicateTask):
        trailers = ((EXISTING_ID_KEY, exc.existing_id),)
    await context.abort(status_code_of(exc), status_message(str(exc)), trailing_metadata=trailers)


async def abort_for_error(context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> NoReturn:
    """End the call for any error a handler caught.

    Broker errors map as in :func:`status_code_of`. An unavailable database, a lost
    connection (OSError, timeout) is UNAVAILABLE, which clients retry; anything else is a bug here and INTERNAL.
    """
    if isinstance(exc, BrokerError):
        await abort_with_broker_error(context, exc)
    if isinstance(exc, DatabaseUnavailable):
        # Its message is clean (the driver's text was logged where it happened).
        logger.warning("rpc.failed error=%s", exc)
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    logger.exception("rpc.failed error=%r", exc)
    if isinstance(exc, OSError | TimeoutError):
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"temporarily unavailable: {exc!r}")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
