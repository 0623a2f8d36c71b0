"""Webhook endpoints' callbacks on the wire: a WebhookService call as the
``WebhookCallback`` the api routes to the worker's gateway, and the gateway's reply as
the call's response.
"""

from __future__ import annotations

from datetime import UTC, datetime

from conveyor_protos.v1 import cluster_pb2, service_pb2

from conveyor_runtime.webhook_auth import LeaseClaims
from conveyor_runtime.wire.time import set_timestamp

_NANOS = 1_000_000_000


def _callback(claims: LeaseClaims) -> cluster_pb2.WebhookCallback:
    return cluster_pb2.WebhookCallback(
        worker=claims.worker,
        task_id=claims.task_id,
        lease_id=claims.lease_id,
        queue=claims.queue,
    )


def webhook_heartbeat(claims: LeaseClaims, progress: bytes) -> cluster_pb2.WebhookCallback:
    """The heartbeat callback of the delivery ``claims`` names (empty ``progress``: none
    to store)."""
    callback = _callback(claims)
    callback.heartbeat.progress = progress
    return callback


def webhook_result(
    claims: LeaseClaims, request: service_pb2.WebhookReportResultRequest
) -> cluster_pb2.WebhookCallback:
    """The result callback of the delivery ``claims`` names. ``retry_after`` travels as
    seconds, -1.0 when the endpoint chose none; the caller has checked the request."""
    callback = _callback(claims)
    outcome = callback.result
    outcome.outcome = request.outcome
    outcome.result = request.result
    outcome.error = request.error
    retry_after = request.retry_after
    outcome.retry_after = (
        retry_after.seconds + retry_after.nanos / _NANOS
        if request.HasField("retry_after")
        else -1.0
    )
    return callback


def heartbeat_response(
    reply: cluster_pb2.WebhookCallbackReply,
) -> service_pb2.WebhookHeartbeatResponse:
    """The Heartbeat response for the gateway's reply: the new lease expiry, if it gave
    one."""
    response = service_pb2.WebhookHeartbeatResponse()
    if reply.lease_expires_at > 0:
        set_timestamp(
            response.lease_expires_at, datetime.fromtimestamp(reply.lease_expires_at, UTC)
        )
    return response
