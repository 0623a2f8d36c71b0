"""What the webhook service sends an endpoint: the JSON-RPC body and its HTTP headers.

Pure functions (no I/O), so the wire format is tested on its own. The format is the one
in docs (webhook contract): ``POST <url>`` with a JSON-RPC 2.0 call of method
``conveyor.task`` whose ``id`` is the lease id, signed with the registration's newest
secret over the exact body bytes the Standard Webhooks way (``webhook-id`` is the
delivery id: the lease id, new for every attempt), plus the deprecated
``Conveyor-Signature``. The task's W3C trace context (``traceparent``, ``tracestate``: the
webhook gateway's push span while it traces, else what the task carries) goes along as
HTTP headers of the same names, so a traced endpoint continues the task's trace.

An aggregation group's batch (:func:`batch_body`) is one call of method
``conveyor.batch`` carrying every member, under the batch's one lease (its ``id`` and
``webhook-id``). It carries no lease token and no callback address: a batch is finished
by its response alone (asynchronous completion is not supported for batches).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from datetime import UTC, datetime

from conveyor_protos.v1 import service_pb2, task_pb2
from conveyor_runtime import wire
from conveyor_runtime.tracing import TRACEPARENT, TRACESTATE
from conveyor_runtime.webhook_auth import (
    LeaseClaims,
    mint_lease_token,
    signed_headers,
)

from conveyor_webhook.version import __version__

#: The JSON-RPC method of a delivery.
METHOD = "conveyor.task"
#: The JSON-RPC method of an aggregation group's batch (every member in one call).
BATCH_METHOD = "conveyor.batch"
#: The header naming the task a delivery carries (stable across retries: dedupe on it).
#: The delivery id of one attempt is ``webhook-id`` (the lease id).
DELIVERY_HEADER = "Conveyor-Delivery"
USER_AGENT = f"conveyor-webhook/{__version__}"
#: The task headers a delivery also sends as HTTP headers: its trace context.
TRACE_HEADERS = (TRACEPARENT, TRACESTATE)
#: The longest trace header sent (W3C: a tracestate holds at most 32 members of 256 bytes;
#: anything longer than that is no trace context).
MAX_TRACE_HEADER = 8192


def rfc3339(value: datetime) -> str:
    """``value`` as an RFC 3339 UTC timestamp (``2030-01-01T00:00:00.5Z``)."""
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _time(env: task_pb2.TaskEnvelope, name: str) -> str | None:
    """The Timestamp field ``name`` of ``env`` in RFC 3339; None when it is unset, or not
    a valid Timestamp (only a forged offer carries one; protobuf refuses to convert it)."""
    if not env.HasField(name):
        return None
    try:
        return rfc3339(wire.from_timestamp(getattr(env, name)))
    except (ValueError, OverflowError):
        return None


def delivery_body(
    env: task_pb2.TaskEnvelope, *, worker: str, secret: str, callback: str
) -> tuple[bytes, str]:
    """The body of the delivery of ``env`` by webhook worker ``worker``, and the lease
    token it carries (minted with ``secret``, the registration's newest)."""
    token = mint_lease_token(
        secret, LeaseClaims(worker=worker, task_id=env.id, lease_id=env.lease_id, queue=env.queue)
    )
    params = {
        "task_id": env.id,
        "queue": env.queue,
        "type": env.type,
        "payload": base64.b64encode(env.payload).decode("ascii"),
        "headers": dict(env.headers),
        "attempt": env.attempt,
        "max_retry": env.max_retry,
        "lease_token": token,
        "lease_expires_at": _time(env, "lease_expires_at"),
        "deadline": _time(env, "deadline"),
        "callback": callback,
    }
    call = {"jsonrpc": "2.0", "id": env.lease_id, "method": METHOD, "params": params}
    return json.dumps(call, separators=(",", ":")).encode(), token


def _member(env: task_pb2.TaskEnvelope) -> dict[str, object]:
    """One member of a batch as the batch call presents it (the single call's fields
    that are the member's own)."""
    return {
        "task_id": env.id,
        "type": env.type,
        "payload": base64.b64encode(env.payload).decode("ascii"),
        "headers": dict(env.headers),
        "attempt": env.attempt,
        "max_retry": env.max_retry,
        "deadline": _time(env, "deadline"),
    }


def batch_body(batch: service_pb2.BatchDispatch) -> bytes:
    """The body of the delivery of aggregation group ``batch`` (at least one member,
    every one under the batch's lease): one ``conveyor.batch`` call whose ``id`` is that
    lease id, with the group's queue, name and type, the lease's expiry, and ``tasks``,
    the members in order."""
    first = batch.tasks[0]
    params = {
        "queue": batch.queue,
        "group": batch.group,
        "type": batch.type,
        "lease_expires_at": _time(first, "lease_expires_at"),
        "tasks": [_member(env) for env in batch.tasks],
    }
    call = {"jsonrpc": "2.0", "id": first.lease_id, "method": BATCH_METHOD, "params": params}
    return json.dumps(call, separators=(",", ":")).encode()


def delivery_headers(
    body: bytes,
    *,
    task_id: str | None,
    delivery_id: str,
    secret: str,
    timestamp: int,
    task_headers: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The HTTP headers of a delivery: content type, the signature headers (Standard
    Webhooks, with ``delivery_id``, and the deprecated one), the task id (None, for a
    batch: no ``Conveyor-Delivery``), user agent, and the trace context among
    ``task_headers`` (the envelope's, a batch's first member's: ``traceparent`` and
    ``tracestate``, when set)."""
    headers = {
        "Content-Type": "application/json",
        **signed_headers(secret, delivery_id, body, timestamp),
    }
    if task_id is not None:
        headers[DELIVERY_HEADER] = task_id
    headers["User-Agent"] = USER_AGENT
    if task_headers:
        for name in TRACE_HEADERS:
            value = task_headers.get(name)
            # Task headers hold any printable text; an HTTP header only some of it.
            if value and len(value) <= MAX_TRACE_HEADER and value.isascii() and value.isprintable():
                headers[name] = value
    return headers
