"""WebhookService on the wire for the webhook callbacks: how a delivery ended
(:class:`Outcome`) and the requests that report it. Proto types stay in here."""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum
from typing import Any

from conveyor_protos.v1 import service_pb2 as svc

from conveyor._errors import InvalidArgument
from conveyor._payload import Codec, encode_value
from conveyor._types import DurationLike, to_timedelta
from conveyor._wire_time import duration_to_wire

WEBHOOK_SERVICE = "/conveyor.v1.WebhookService/"


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


def heartbeat_request(codec: Codec, lease_token: str, progress: Any) -> svc.WebhookHeartbeatRequest:
    """A WebhookService.Heartbeat request, ``progress`` encoded with ``codec``."""
    return svc.WebhookHeartbeatRequest(
        lease_token=_token(lease_token), progress=_encode(codec, "progress", progress)
    )


def report_request(
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
