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

from conveyor._clients.callbacks import AsyncCallbacks
from conveyor._clients.callbacks_sync import Callbacks
from conveyor._clients.callbacks_wire import Outcome

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
