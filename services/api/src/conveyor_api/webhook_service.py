"""WebhookService: the callbacks of webhook endpoints that answered a delivery "accepted".

A callback carries no bearer token: its delivery's lease token authenticates it. The api
reads the token's claims, looks up the webhook worker they name, verifies the token with
that registration's secrets (any of them, so a rotated-out secret that is still listed
works; stored sealed, opened with the server's keyring), then routes the callback over NATS request/reply to the worker's gateway, which
applies it to the lease it holds (or, for a lease it does not hold, straight to the broker,
which checks the lease). The gateway's reply becomes the call's status.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import grpc
from conveyor_broker import Broker, InvalidTask, WebhookWorkerNotFound
from conveyor_broker.validation import check_webhook_name
from conveyor_gateway.outcomes import BROKER_UNAVAILABLE, FINAL_OUTCOMES
from conveyor_protos.v1 import cluster_pb2, service_pb2, service_pb2_grpc
from conveyor_runtime import wire
from conveyor_runtime.bus import Bus
from conveyor_runtime.webhook_auth import (
    InvalidToken,
    LeaseClaims,
    read_lease_token,
    verify_lease_token,
)
from conveyor_runtime.webhook_secrets import SecretKeyError, SecretKeyring
from google.protobuf.message import DecodeError
from nats import errors as nats_errors

from conveyor_api.broker_status import abort_for_error

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    _Context = grpc.aio.ServicerContext[Any, Any]

#: Seconds the api waits for the webhook gateway to answer a routed callback.
CALLBACK_TIMEOUT = 5.0
#: The one message for every token problem: it says nothing about which check failed.
INVALID_TOKEN = "invalid lease token"
#: Longest retry_after a ReportResult may ask for.
MAX_RETRY_AFTER = timedelta(days=30)
_NANOS = 1_000_000_000
_Reply = cluster_pb2.WebhookCallbackReply


class WebhookService(service_pb2_grpc.WebhookServiceServicer):
    """Heartbeat and ReportResult for asynchronous webhook deliveries.

    ``max_result`` bounds a reported result and a heartbeat's progress (bytes); a larger
    one is INVALID_ARGUMENT and nothing changes, so the endpoint can report a failure
    instead. So is a ``retry_after`` that is negative, not a valid Duration, or longer
    than :data:`MAX_RETRY_AFTER`. A gateway whose broker call failed answers
    :data:`~conveyor_gateway.outcomes.BROKER_UNAVAILABLE`: the call ends UNAVAILABLE (retry).
    """

    def __init__(
        self,
        *,
        broker: Broker,
        bus: Bus,
        max_result: int,
        timeout: float = CALLBACK_TIMEOUT,
        keyring: SecretKeyring | None = None,
    ) -> None:
        self._broker = broker
        self._keyring = keyring or SecretKeyring()
        self._bus = bus
        self._max_result = max_result
        self._timeout = timeout

    async def Heartbeat(
        self, request: service_pb2.WebhookHeartbeatRequest, context: _Context
    ) -> service_pb2.WebhookHeartbeatResponse:
        """Extend the delivery's lease by the lease TTL (and store ``progress``, if any)."""
        claims = await self._authenticate(request.lease_token, context)
        if len(request.progress) > self._max_result:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"progress is {len(request.progress)} bytes; the limit is {self._max_result}",
            )
        callback = wire.webhook_heartbeat(claims, request.progress)
        reply = await self._route(claims, callback, context)
        return wire.heartbeat_response(reply)

    async def ReportResult(
        self, request: service_pb2.WebhookReportResultRequest, context: _Context
    ) -> service_pb2.WebhookReportResultResponse:
        """Finish the delivery: success (ack), failure (retry or archive), skip_retry
        (archive) or release (give the task back)."""
        claims = await self._authenticate(request.lease_token, context)
        problem = _check_result(request, self._max_result)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        await self._route(claims, wire.webhook_result(claims, request), context)
        return service_pb2.WebhookReportResultResponse()

    async def _authenticate(self, token: str, context: _Context) -> LeaseClaims:
        """The claims of a lease token one of its worker's secrets signed; else the call
        ends UNAUTHENTICATED (a broker outage: UNAVAILABLE)."""
        try:
            claims = read_lease_token(token)
            check_webhook_name(claims.worker)
            worker = await self._broker.get_webhook_worker(claims.worker)
            secrets = self._keyring.open_all(worker.name, worker.secrets)
            return verify_lease_token(token, secrets)
        except (InvalidToken, InvalidTask, WebhookWorkerNotFound) as exc:
            logger.info("webhook.callback_rejected reason=%r", exc)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, INVALID_TOKEN)
        except SecretKeyError as exc:
            # The server's configuration, not the caller: retry once an operator fixed it.
            logger.error("webhook.secret_unreadable worker=%s error=%s", claims.worker, exc)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the server cannot read the secrets of webhook worker {claims.worker}; retry",
            )
        except Exception as exc:
            await abort_for_error(context, exc)

    async def _route(
        self, claims: LeaseClaims, callback: cluster_pb2.WebhookCallback, context: _Context
    ) -> cluster_pb2.WebhookCallbackReply:
        """Ask the worker's gateway to apply ``callback``; its reply as a status."""
        try:
            reply = await self._bus.webhook_callback(callback, within=self._timeout)
        except (nats_errors.NoRespondersError, nats_errors.TimeoutError):
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"webhook worker {claims.worker} is not running; retry",
            )
        except nats_errors.MaxPayloadError:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the callback is {callback.ByteSize()} bytes, more than the cluster's "
                "message limit",
            )
        except nats_errors.Error as exc:
            logger.warning("webhook.callback_route_failed worker=%s error=%r", claims.worker, exc)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot reach webhook worker {claims.worker}: {type(exc).__name__}; retry",
            )
        except DecodeError:
            logger.warning("webhook.bad_callback_reply worker=%s", claims.worker)
            await context.abort(grpc.StatusCode.INTERNAL, "malformed reply from the webhook worker")
        if reply.status == _Reply.STATUS_OK:
            return reply
        if reply.status == _Reply.STATUS_LEASE_LOST:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "lease lost")
        if reply.status == _Reply.STATUS_INVALID and reply.message == BROKER_UNAVAILABLE:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"webhook worker {claims.worker} could not reach its broker; retry",
            )
        if reply.status == _Reply.STATUS_INVALID:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, reply.message or "invalid callback"
            )
        logger.warning(
            "webhook.unknown_reply_status worker=%s status=%d", claims.worker, reply.status
        )
        await context.abort(
            grpc.StatusCode.INTERNAL, f"unknown reply status {reply.status} from the webhook worker"
        )


def _check_result(request: service_pb2.WebhookReportResultRequest, max_result: int) -> str | None:
    """What is wrong with a ReportResult's fields, or None."""
    if request.outcome not in FINAL_OUTCOMES:
        return (
            "outcome must be OUTCOME_SUCCESS, OUTCOME_FAILURE, OUTCOME_SKIP_RETRY or "
            f"OUTCOME_RELEASE, got {request.outcome}"
        )
    if request.HasField("retry_after"):
        retry_after = request.retry_after
        if retry_after.seconds < 0 or retry_after.nanos < 0:
            return "retry_after must be >= 0"
        if retry_after.nanos >= _NANOS:
            return "retry_after is not a valid Duration (nanos must be below 1e9)"
        longest = int(MAX_RETRY_AFTER.total_seconds())
        if retry_after.seconds > longest or (retry_after.seconds == longest and retry_after.nanos):
            return f"retry_after must be at most {MAX_RETRY_AFTER.days} days"
    if len(request.result) > max_result:
        return f"result is {len(request.result)} bytes; the limit is {max_result}"
    return None
