"""Webhook signing: delivery signatures and per-delivery lease tokens.

Both use HMAC-SHA256 with a registration's secrets (newest first). Signing always uses
the newest secret; verifying accepts any of them, so secrets rotate without downtime:
add the new one in front, wait for in-flight deliveries to finish, drop the old one.

- **Delivery signature** (the ``Conveyor-Signature`` HTTP header of every delivery):
  ``t=<unix seconds>,v1=<hex HMAC of "<t>." + body>``. An endpoint recomputes it over the
  raw body and rejects a stale ``t`` (replay protection).
- **Lease token** (``params.lease_token`` of a delivery): authenticates the endpoint's
  WebhookService callbacks for that one delivery. ``v1.<claims>.<mac>``, both parts
  unpadded base64url; claims are JSON ``{"w": worker, "t": task id, "l": lease id,
  "q": queue}``. It stays good exactly as long as the lease it names (the broker checks).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass

SIGNATURE_HEADER = "Conveyor-Signature"
#: Seconds a delivery signature's timestamp may differ from the verifier's clock.
DEFAULT_TOLERANCE = 300
_TOKEN_VERSION = "v1"
MAX_TOKEN_LEN = 4096


class InvalidToken(ValueError):
    """A lease token that is malformed or not signed by any of the secrets."""


@dataclass(frozen=True, slots=True)
class LeaseClaims:
    """What a lease token names: one delivery of one task to one webhook worker."""

    worker: str
    task_id: str
    lease_id: str
    queue: str


def _mac(secret: str, data: bytes) -> bytes:
    return hmac.new(secret.encode(), data, hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# ------------------------------------------------------------------ signatures


def sign_delivery(secret: str, body: bytes, timestamp: int) -> str:
    """The ``Conveyor-Signature`` header value for ``body`` sent at ``timestamp``."""
    digest = _mac(secret, f"{timestamp}.".encode() + body).hex()
    return f"t={timestamp},v1={digest}"


def verify_delivery(
    header: str,
    body: bytes,
    secrets: Sequence[str],
    now: float,
    tolerance: float = DEFAULT_TOLERANCE,
) -> bool:
    """True when ``header`` signs ``body`` with one of ``secrets`` within ``tolerance``
    seconds of ``now``. What an endpoint runs on every delivery."""
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        key, sep, value = part.strip().partition("=")
        if sep:
            fields.setdefault(key, []).append(value)
    try:
        timestamp = int(fields["t"][0])
    except (KeyError, ValueError):
        return False
    if abs(now - timestamp) > tolerance:
        return False
    for secret in secrets:
        expected = _mac(secret, f"{timestamp}.".encode() + body).hex()
        if any(hmac.compare_digest(expected, given) for given in fields.get("v1", [])):
            return True
    return False


# ---------------------------------------------------------------- lease tokens


def mint_lease_token(secret: str, claims: LeaseClaims) -> str:
    """A token that authenticates callbacks for the delivery ``claims`` names."""
    body = json.dumps(
        {"w": claims.worker, "t": claims.task_id, "l": claims.lease_id, "q": claims.queue},
        separators=(",", ":"),
    ).encode()
    signed = f"{_TOKEN_VERSION}.{_b64(body)}"
    return f"{signed}.{_b64(_mac(secret, signed.encode()))}"


def read_lease_token(token: str) -> LeaseClaims:
    """The claims of ``token`` WITHOUT checking its signature (to find whose secrets
    verify it). Raises InvalidToken when it is malformed."""
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_LEN:
        raise InvalidToken("lease token is missing or too long")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != _TOKEN_VERSION:
        raise InvalidToken("lease token is malformed")
    try:
        raw = json.loads(_unb64(parts[1]))
        claims = LeaseClaims(worker=raw["w"], task_id=raw["t"], lease_id=raw["l"], queue=raw["q"])
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidToken("lease token is malformed") from exc
    if not all(
        isinstance(v, str) and v
        for v in (claims.worker, claims.task_id, claims.lease_id, claims.queue)
    ):
        raise InvalidToken("lease token is malformed")
    return claims


def verify_lease_token(token: str, secrets: Sequence[str]) -> LeaseClaims:
    """The claims of ``token`` when one of ``secrets`` signed it; else InvalidToken."""
    claims = read_lease_token(token)
    signed, _, mac = token.rpartition(".")
    try:
        given = _unb64(mac)
    except ValueError as exc:
        raise InvalidToken("lease token is malformed") from exc
    for secret in secrets:
        if hmac.compare_digest(_mac(secret, signed.encode()), given):
            return claims
    raise InvalidToken("lease token signature does not match")
