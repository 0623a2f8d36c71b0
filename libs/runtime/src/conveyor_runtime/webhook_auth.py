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
import re
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor_broker.ids import is_ulid
from conveyor_broker.validation import QUEUE_RE

SIGNATURE_HEADER = "Conveyor-Signature"
#: Seconds a delivery signature's timestamp may differ from the verifier's clock.
DEFAULT_TOLERANCE = 300
_TOKEN_VERSION = "v1"
MAX_TOKEN_LEN = 4096
#: Unpadded base64url, what both parts of a token after the version are.
_B64URL_RE = re.compile(r"[A-Za-z0-9_-]*")
#: A lease id as brokers make them (ULIDs), loosely.
_LEASE_ID_RE = re.compile(r"[0-9A-Za-z]{1,64}")


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
    seconds of ``now``. What an endpoint runs on every delivery; False (never an
    exception) for a header of any other shape."""
    parsed = _parse_signature(header)
    if parsed is None:
        return False
    timestamp, given = parsed
    if abs(now - timestamp) > tolerance:
        return False
    for secret in secrets:
        expected = _mac(secret, f"{timestamp}.".encode() + body).hex()
        if any(hmac.compare_digest(expected, candidate) for candidate in given):
            return True
    return False


#: The longest signature header worth parsing (a real one is about 80 characters).
_MAX_HEADER_LEN = 4096
#: Unix seconds, in ASCII digits (int() would also take other scripts' digits, signs,
#: underscores and spaces).
_TIMESTAMP_RE = re.compile(r"[0-9]{1,12}")
#: A v1 signature: a lower-case hex SHA-256.
_MAC_RE = re.compile(r"[0-9a-f]{64}")


def _parse_signature(header: object) -> tuple[int, list[str]] | None:
    """The timestamp and the well-formed v1 signatures of a header, or None when it has
    no valid timestamp (or is no header at all)."""
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
    verify it). Raises InvalidToken when it is malformed, whatever its shape: nothing
    else (a token comes from the network)."""
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_LEN:
        raise InvalidToken("lease token is missing or too long")
    parts = token.split(".")
    if (
        len(parts) != 3
        or parts[0] != _TOKEN_VERSION
        or not all(_B64URL_RE.fullmatch(part) for part in parts[1:])
    ):
        raise InvalidToken("lease token is malformed")
    try:
        raw = json.loads(_unb64(parts[1]))
    except (ValueError, RecursionError) as exc:
        # RecursionError: JSON nested deeper than the parser goes ("[[[[...").
        raise InvalidToken("lease token is malformed") from exc
    if not isinstance(raw, dict):
        raise InvalidToken("lease token is malformed")
    worker, task_id, lease_id, queue = (raw.get(key) for key in ("w", "t", "l", "q"))
    if not (
        isinstance(worker, str)
        and isinstance(queue, str)
        and isinstance(task_id, str)
        and isinstance(lease_id, str)
        and QUEUE_RE.fullmatch(worker)
        and QUEUE_RE.fullmatch(queue)
        and is_ulid(task_id)
        and _LEASE_ID_RE.fullmatch(lease_id)
    ):
        raise InvalidToken("lease token is malformed")
    return LeaseClaims(worker=worker, task_id=task_id, lease_id=lease_id, queue=queue)


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
