"""Helpers for webhook endpoints written in Python.

A webhook worker is an HTTP endpoint the server POSTs tasks to (see docs/protocol.md,
"Webhook workers"). This module gives such an endpoint what it needs from Conveyor:

- :func:`verify_signature` checks the ``Conveyor-Signature`` header of a delivery
  against the registration's secrets (do it on the raw body, before parsing it);
- :class:`Callbacks` (blocking) and :class:`AsyncCallbacks` (asyncio) call the server's
  WebhookService for a delivery the endpoint answered ``accepted``: ``heartbeat`` keeps
  its lease alive, ``report_result`` finishes it.

::

    from conveyor.webhooks import AsyncCallbacks, verify_signature

    if not verify_signature(request.headers.get("Conveyor-Signature"), raw_body, SECRETS):
        return 401
    params = json.loads(raw_body)["params"]
    ...  # answer {"outcome": "accepted"} now, then, later:
    async with AsyncCallbacks(params["callback"]) as callbacks:
        await callbacks.heartbeat(params["lease_token"], progress={"pct": 50})
        await callbacks.report_result(params["lease_token"], "success", result={"ok": True})
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from conveyor_protos.v1 import service_pb2 as svc

from conveyor._clients.transport import AsyncRpcClient, SyncRpcClient
from conveyor._errors import InvalidArgument
from conveyor._payload import Codec, JsonCodec, encode_value
from conveyor._types import DurationLike, to_timedelta
from conveyor._wire_time import duration_to_wire, timestamp_from_wire

__all__ = [
    "DEFAULT_TOLERANCE",
    "SIGNATURE_HEADER",
    "AsyncCallbacks",
    "Callbacks",
    "Outcome",
    "verify_signature",
]

#: The HTTP header of every delivery that carries its signature.
SIGNATURE_HEADER = "Conveyor-Signature"
#: Seconds a delivery's signing time may differ from the endpoint's clock.
DEFAULT_TOLERANCE = 300
WEBHOOK_SERVICE = "/conveyor.v1.WebhookService/"


def verify_signature(
    header: str | None,
    body: bytes | bytearray | memoryview,
    secrets: str | Iterable[str],
    *,
    now: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> bool:
    """True when the ``Conveyor-Signature`` header value ``header`` signs ``body`` (the
    raw request body, exactly as received) with one of ``secrets``, and was made within
    ``tolerance`` seconds of ``now`` (Unix seconds; default: the current time).

    The header is ``t=<unix seconds>,v1=<hex HMAC-SHA256>``, the HMAC keyed with a secret
    over ``"<t>." + body``. Accepting any of several secrets is what lets secrets rotate
    with no downtime; refusing an old ``t`` is what makes a captured delivery useless to
    replay. Comparisons take constant time.
    """
    if not isinstance(body, bytes | bytearray | memoryview):
        raise TypeError("body must be the raw request body as bytes")
    if header is None:
        return False
    keys = [secrets] if isinstance(secrets, str) else list(secrets)
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        key, sep, value = part.strip().partition("=")
        if sep:
            fields.setdefault(key, []).append(value)
    try:
        timestamp = int(fields["t"][0])
    except (KeyError, ValueError):
        return False
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        return False
    signed = f"{timestamp}.".encode() + bytes(body)
    given = fields.get("v1", [])
    for secret in keys:
        expected = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
        if any(hmac.compare_digest(expected, candidate) for candidate in given):
            return True
    return False


class Outcome(StrEnum):
    """How an ``accepted`` delivery ended, for :meth:`AsyncCallbacks.report_result`."""

    #: The task completed; ``result`` is stored.
    SUCCESS = "success"
    #: The attempt failed: retry (after ``retry_after`` or the backoff), or archive
    #: when retries are exhausted.
    FAILURE = "failure"
    #: Fail for good: archive at once, whatever retries remain.
    SKIP_RETRY = "skip_retry"
    #: Give the task back untouched (it is delivered again, to anyone).
    RELEASE = "release"


_OUTCOMES: dict[Outcome, svc.Outcome] = {
    Outcome.SUCCESS: svc.OUTCOME_SUCCESS,
    Outcome.FAILURE: svc.OUTCOME_FAILURE,
    Outcome.SKIP_RETRY: svc.OUTCOME_SKIP_RETRY,
    Outcome.RELEASE: svc.OUTCOME_RELEASE,
}


def _token(lease_token: str) -> str:
    if not isinstance(lease_token, str) or not lease_token:
        raise InvalidArgument("lease_token must be the delivery's params.lease_token")
    return lease_token


def _encode(codec: Codec, what: str, value: Any) -> bytes:
    try:
        return encode_value(codec, value)
    except Exception as exc:
        raise InvalidArgument(f"cannot encode the {what}: {exc}") from exc


def _heartbeat_request(
    codec: Codec, lease_token: str, progress: Any
) -> svc.WebhookHeartbeatRequest:
    """A WebhookService.Heartbeat request, ``progress`` encoded with ``codec``."""
    return svc.WebhookHeartbeatRequest(
        lease_token=_token(lease_token), progress=_encode(codec, "progress", progress)
    )


def _report_request(
    codec: Codec,
    lease_token: str,
    outcome: Outcome | str,
    result: Any,
    error: str | None,
    retry_after: DurationLike | None,
) -> svc.WebhookReportResultRequest:
    """A WebhookService.ReportResult request, checked; ``result`` encoded with ``codec``."""
    try:
        wire_outcome = _OUTCOMES[Outcome(outcome)]
    except ValueError:
        raise InvalidArgument(
            f"outcome must be one of {', '.join(o.value for o in Outcome)}, got {outcome!r}"
        ) from None
    if error is not None and not isinstance(error, str):
        raise InvalidArgument(f"error must be a string, got {error!r}")
    request = svc.WebhookReportResultRequest(
        lease_token=_token(lease_token),
        outcome=wire_outcome,
        result=_encode(codec, "result", result),
        error=error or "",
    )
    delay = to_timedelta("retry_after", retry_after)
    if delay is not None:
        if delay < timedelta(0):
            raise InvalidArgument(f"retry_after must be >= 0, got {retry_after!r}")
        request.retry_after.CopyFrom(duration_to_wire(delay))
    return request


class AsyncCallbacks(AsyncRpcClient):
    """The server's WebhookService, from asyncio code: callbacks for deliveries a webhook
    endpoint answered ``accepted``.

    ``address`` is the delivery's ``params.callback`` (the api's gRPC address). No bearer
    token: each call is authenticated by the delivery's ``lease_token``. ``codec`` encodes
    progress and results (JSON by default, like the rest of the SDK). Errors are the SDK's
    exceptions: :class:`~conveyor.Unauthenticated` for a bad token,
    :class:`~conveyor.FailedPrecondition` when the lease is lost (the task was reaped,
    canceled or delivered again: stop working on it), :class:`~conveyor.Unavailable` when
    the webhook worker is not running right now (retry), :class:`~conveyor.InvalidArgument`
    for a bad request.
    """

    _service = WEBHOOK_SERVICE

    def __init__(
        self,
        address: str,
        *,
        codec: Codec | None = None,
        timeout: DurationLike | None = 30.0,
    ) -> None:
        super().__init__(address, token=None, codec=codec or JsonCodec(), timeout=timeout)

    async def heartbeat(self, lease_token: str, progress: Any = None) -> datetime | None:
        """Extend the delivery's lease (by the server's lease TTL) and store ``progress``
        if given; returns the new lease expiry. Beat well within the TTL: a delivery that
        stops beating is reclaimed and delivered again."""
        request = _heartbeat_request(self._codec, lease_token, progress)
        response = await self._call("Heartbeat", request, svc.WebhookHeartbeatResponse)
        return timestamp_from_wire(response, "lease_expires_at")

    async def report_result(
        self,
        lease_token: str,
        outcome: Outcome | str,
        result: Any = None,
        error: str | None = None,
        retry_after: DurationLike | None = None,
    ) -> None:
        """Finish the delivery with ``outcome`` (an :class:`Outcome` or its value):
        ``result`` is stored on success, ``error`` becomes the task's last error on a
        failure, ``retry_after`` (seconds or timedelta) overrides the retry backoff."""
        request = _report_request(self._codec, lease_token, outcome, result, error, retry_after)
        await self._call("ReportResult", request, svc.WebhookReportResultResponse)


class Callbacks(SyncRpcClient):
    """The blocking twin of :class:`AsyncCallbacks`, with the same methods."""

    _service = WEBHOOK_SERVICE

    def __init__(
        self,
        address: str,
        *,
        codec: Codec | None = None,
        timeout: DurationLike | None = 30.0,
    ) -> None:
        super().__init__(address, token=None, codec=codec or JsonCodec(), timeout=timeout)

    def heartbeat(self, lease_token: str, progress: Any = None) -> datetime | None:
        """Extend the delivery's lease (see :meth:`AsyncCallbacks.heartbeat`)."""
        request = _heartbeat_request(self._codec, lease_token, progress)
        response = self._call("Heartbeat", request, svc.WebhookHeartbeatResponse)
        return timestamp_from_wire(response, "lease_expires_at")

    def report_result(
        self,
        lease_token: str,
        outcome: Outcome | str,
        result: Any = None,
        error: str | None = None,
        retry_after: DurationLike | None = None,
    ) -> None:
        """Finish the delivery (see :meth:`AsyncCallbacks.report_result`)."""
        request = _report_request(self._codec, lease_token, outcome, result, error, retry_after)
        self._call("ReportResult", request, svc.WebhookReportResultResponse)
