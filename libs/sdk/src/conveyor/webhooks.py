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
import re
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
    header: str | bytes | None,
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

    Whatever the header holds (it comes from the network: missing, empty, not ASCII,
    huge, a timestamp that is not a number), the answer is False, never an exception, so
    an endpoint answers 401. ``header`` may also be the raw header bytes. TypeError only
    for a ``body`` that is not bytes (a parsed body cannot be verified).
    """
    if not isinstance(body, bytes | bytearray | memoryview):
        raise TypeError("body must be the raw request body as bytes")
    parsed = _parse_signature(header)
    if parsed is None:
        return False
    timestamp, given = parsed
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        return False
    keys = [secrets] if isinstance(secrets, str) else list(secrets)
    signed = f"{timestamp}.".encode() + bytes(body)
    for secret in keys:
        expected = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
        if any(hmac.compare_digest(expected, candidate) for candidate in given):
            return True
    return False


#: The longest header worth parsing (a real one is about 80 characters).
_MAX_HEADER_LEN = 4096
#: Unix seconds, in ASCII digits (int() would also take other scripts' digits, signs,
#: underscores and spaces).
_TIMESTAMP_RE = re.compile(r"[0-9]{1,12}")
#: A v1 signature: a lower-case hex SHA-256.
_MAC_RE = re.compile(r"[0-9a-f]{64}")


def _parse_signature(header: object) -> tuple[int, list[str]] | None:
    """The timestamp and the well-formed v1 signatures of a header, or None when it has
    no valid timestamp (or is no header at all)."""
    if isinstance(header, bytes | bytearray):
        try:
            header = header.decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(header, str) or len(header) > _MAX_HEADER_LEN or not header.isascii():
        return None
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        key, sep, value = part.strip().partition("=")
        if sep:
            fields.setdefault(key, []).append(value)
    stamps = fields.get("t", [])
    if not stamps or not _TIMESTAMP_RE.fullmatch(stamps[0]):
        return None
    return int(stamps[0]), [mac for mac in fields.get("v1", []) if _MAC_RE.fullmatch(mac)]
