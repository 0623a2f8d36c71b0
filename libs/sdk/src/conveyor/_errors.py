"""SDK exceptions: errors the server reports, and the signals a handler raises."""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import grpc

#: Trailing-metadata key under which the server names the live task holding a unique key.
EXISTING_ID_KEY = "conveyor-existing-id"


class ConveyorError(Exception):
    """Base class of every error the SDK raises on purpose.

    ``code`` is the gRPC status code name the server answered with (``"NOT_FOUND"``...),
    or ``None`` for errors detected by the SDK itself.
    """

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class InvalidArgument(ConveyorError, ValueError):
    """The request is malformed (bad queue name, negative timeout...). Nothing was stored."""


class TaskNotFound(ConveyorError, LookupError):
    """No task has this id. ``task_id`` is the id asked for, when the SDK knows it."""

    def __init__(
        self, message: str, *, code: str | None = "NOT_FOUND", task_id: str | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.task_id = task_id


class WebhookWorkerNotFound(ConveyorError, LookupError):
    """No webhook worker is registered under this name. ``name`` is the name asked for."""

    def __init__(
        self, message: str, *, code: str | None = "NOT_FOUND", name: str | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.name = name


class _PatternNotFound(ConveyorError, LookupError):
    """Nothing is stored for this queue and pattern (``queue``, ``pattern``: those asked
    for)."""

    def __init__(
        self,
        message: str,
        *,
        code: str | None = "NOT_FOUND",
        queue: str | None = None,
        pattern: str | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.queue = queue
        self.pattern = pattern


class RateLimitNotFound(ConveyorError, LookupError):
    """The queue has no rate limit. ``queue`` is the queue asked for."""

    def __init__(
        self, message: str, *, code: str | None = "NOT_FOUND", queue: str | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.queue = queue


class GroupConfigNotFound(_PatternNotFound):
    """No group config is stored for this queue and pattern (``queue``, ``pattern``:
    those asked for)."""


class ConcurrencyLimitNotFound(_PatternNotFound):
    """The queue has no concurrency limit for this key pattern (``queue``, ``pattern``:
    those asked for)."""


class BreakerConfigNotFound(_PatternNotFound):
    """The queue has no circuit breaker config for this type pattern (``queue``,
    ``pattern``: those asked for)."""


class CronEntryNotFound(ConveyorError, LookupError):
    """No cron entry has this name. ``name`` is the name asked for."""

    def __init__(
        self, message: str, *, code: str | None = "NOT_FOUND", name: str | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.name = name


class AlreadyExists(ConveyorError):
    """A live task already holds the unique key; ``existing_id`` names it when known."""

    def __init__(
        self, message: str, *, code: str | None = "ALREADY_EXISTS", existing_id: str | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.existing_id = existing_id


class FailedPrecondition(ConveyorError):
    """The server refused the request in its current state (e.g. incompatible versions)."""


class PermissionDenied(ConveyorError):
    """The credentials are valid but not allowed to do this (e.g. read-only mode)."""


class Unauthenticated(ConveyorError):
    """The bearer token is missing or wrong."""


class Unavailable(ConveyorError):
    """The server cannot be reached or is shutting down; the call may be retried."""


class DeadlineExceeded(ConveyorError, TimeoutError):
    """The call did not complete within the client's timeout."""


class ResourceExhausted(ConveyorError):
    """A size or rate limit was hit (payload too large, too many items...)."""


class Unimplemented(ConveyorError):
    """The server does not do this yet (say, a task option whose feature is not built):
    nothing was stored."""


class CodecError(ConveyorError):
    """Stored bytes could not be decoded with the client's codec."""


_BY_CODE: dict[str, type[ConveyorError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "OUT_OF_RANGE": InvalidArgument,
    "NOT_FOUND": TaskNotFound,
    "ALREADY_EXISTS": AlreadyExists,
    "FAILED_PRECONDITION": FailedPrecondition,
    "PERMISSION_DENIED": PermissionDenied,
    "UNAUTHENTICATED": Unauthenticated,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "UNIMPLEMENTED": Unimplemented,
}


def error_from_status(
    code: str, message: str, *, existing_id: str | None = None, task_id: str | None = None
) -> ConveyorError:
    """The SDK exception for a status code name and message (unknown codes: the base)."""
    cls = _BY_CODE.get(code, ConveyorError)
    if cls is AlreadyExists:
        return AlreadyExists(message, code=code, existing_id=existing_id or None)
    if cls is TaskNotFound:
        return TaskNotFound(message, code=code, task_id=task_id)
    return cls(message, code=code)


def _metadata_value(metadata: Iterable[Any] | None, key: str) -> str | None:
    for item in metadata or ():
        k, v = item
        if k == key:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


_VERIFY_FAILED = re.compile(r"CERTIFICATE_VERIFY_FAILED:\s*([^:]+)", re.IGNORECASE)


def transport_hint(details: str, *, tls: bool | None) -> str | None:
    """What an UNAVAILABLE status's ``details`` most likely mean for TLS, or None.

    gRPC words a TLS mismatch as a low-level error (``Socket closed``,
    ``WRONG_VERSION_NUMBER``...); this says which side to change. ``tls`` is whether the
    client used TLS (None: unknown).
    """
    low = details.lower()
    if "wrong_version_number" in low or "http_request" in low or "packet_length_too_long" in low:
        return (
            "TLS handshake failed: the server does not speak TLS; use a plain 'host:port' "
            "target (no https://, no tls=True, no TLS files)"
        )
    verify = _VERIFY_FAILED.search(details)
    if verify is not None:
        return (
            f"TLS handshake failed: the server's certificate is not trusted "
            f"({verify.group(1).strip()}): pass tls_ca= with the CA bundle that signed it"
        )
    if "hostname verification" in low or "peer name" in low:
        return (
            "TLS handshake failed: the server's certificate does not name this host; "
            "connect by a name the certificate lists"
        )
    if "handshake" in low and "failed" in low:
        return f"TLS handshake failed: {details.rsplit(': ', 1)[-1]}"
    closed = any(
        marker in low for marker in ("socket closed", "connection reset", "end of tcp stream")
    )
    if closed and tls is False:
        return (
            "the server closed the connection at once: if it speaks TLS, use an "
            "'https://host:port' target (or tls=True), with tls_ca= for a private CA"
        )
    if closed and tls:
        return (
            "the server closed the connection during the TLS handshake: if it requires a "
            "client certificate (mutual TLS), pass tls_cert= and tls_key= with one its CA "
            "signed"
        )
    if closed:
        return (
            "the server closed the connection at once: if it speaks TLS, use an "
            "https:// target (or tls=True); if it requires a client certificate, pass "
            "tls_cert= and tls_key="
        )
    return None


def error_from_rpc(
    exc: grpc.RpcError, *, task_id: str | None = None, tls: bool | None = None
) -> ConveyorError:
    """Map a failed gRPC call (sync or asyncio) to the matching SDK exception.

    ``tls`` is whether the channel used TLS (None: unknown): an UNAVAILABLE that looks
    like a TLS mismatch says what to change first (see :func:`transport_hint`)."""
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    trailing_fn = getattr(exc, "trailing_metadata", None)
    status = code_fn() if callable(code_fn) else None
    name = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
    details = details_fn() if callable(details_fn) else None
    message = details or name.lower().replace("_", " ")
    if name == "UNAVAILABLE" and details:
        hint = transport_hint(details, tls=tls)
        if hint:
            message = f"{hint} ({details})"
    existing_id = _metadata_value(trailing_fn() if callable(trailing_fn) else None, EXISTING_ID_KEY)
    return error_from_status(name, message, existing_id=existing_id, task_id=task_id)


class SkipRetry(Exception):
    """Raise from a handler to fail the task for good: it is archived at once.

    The message becomes the task's last error.
    """

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message


class RetryAfter(Exception):
    """Raise from a handler to fail this attempt and retry after ``delay``.

    ``delay`` is a ``timedelta`` or seconds. The retry still counts against the task's
    ``max_retry``. Any exception with a ``retry_after`` attribute (timedelta or seconds)
    has the same effect.
    """

    def __init__(self, delay: timedelta | float, message: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = delay if isinstance(delay, timedelta) else timedelta(seconds=delay)
        if self.retry_after < timedelta(0):
            raise ValueError(f"retry delay must be >= 0, got {delay!r}")
