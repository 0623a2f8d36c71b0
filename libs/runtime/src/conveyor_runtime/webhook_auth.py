"""Webhook signing: delivery signatures and per-delivery lease tokens.

Both use HMAC-SHA256 keyed with a registration's secrets (newest first). Signing always
uses the newest secret; verifying accepts any of them, so secrets rotate without downtime:
add the new one in front, wait for in-flight deliveries to finish, drop the old one.

**Secrets and keys.** A secret is either ``whsec_<base64>`` (the Standard Webhooks form:
the key is the decoded bytes) or any other text (the key is its UTF-8 bytes, and the
same key in the Standard Webhooks form is ``whsec_`` + the base64 of those bytes:
:func:`standard_secret`). Every MAC below uses that key.

- **Delivery signature** (Standard Webhooks): the headers ``webhook-id`` (the delivery id:
  the lease id, unique per attempt), ``webhook-timestamp`` (Unix seconds) and
  ``webhook-signature: v1,<base64 HMAC of "<id>.<timestamp>." + body>``. An endpoint
  recomputes it over the raw body, rejects a stale timestamp and an id it has seen
  (replays).
- **Deprecated** ``Conveyor-Signature`` header (kept for one release):
  ``t=<unix seconds>,v1=<hex HMAC of "<t>." + body>``.
- **Lease token** (``params.lease_token`` of a delivery): authenticates the endpoint's
  WebhookService callbacks for that one delivery. ``v1.<claims>.<mac>``, both parts
  unpadded base64url; claims are JSON ``{"w": worker, "t": task id, "l": lease id,
  "q": queue}``. It stays good exactly as long as the lease it names (the broker checks).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from conveyor_broker.ids import is_ulid
from conveyor_broker.validation import QUEUE_RE

#: The deprecated signature header (kept for one release): use the Standard Webhooks ones.
SIGNATURE_HEADER = "Conveyor-Signature"
#: The Standard Webhooks headers of every delivery.
ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
STANDARD_SIGNATURE_HEADER = "webhook-signature"
#: The prefix of a secret in the Standard Webhooks form.
WHSEC_PREFIX = "whsec_"
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


def secret_key(secret: str) -> bytes:
    """The HMAC key of ``secret``: the decoded bytes of a ``whsec_<base64>`` secret, the
    UTF-8 bytes of any other. Raises ValueError for a ``whsec_`` secret whose rest is not
    base64 (registration refuses those)."""
    if secret.startswith(WHSEC_PREFIX):
        try:
            return base64.b64decode(secret[len(WHSEC_PREFIX) :], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("a whsec_ secret is whsec_ followed by standard base64") from None
    return secret.encode()


def standard_secret(secret: str) -> str:
    """``secret`` in the Standard Webhooks form ``whsec_<base64 of its key>`` (a
    ``whsec_`` secret: itself), what a Standard Webhooks verifier takes."""
    if secret.startswith(WHSEC_PREFIX):
        return secret
    return WHSEC_PREFIX + base64.b64encode(secret.encode()).decode("ascii")


def _mac(secret: str, data: bytes) -> bytes:
    return hmac.new(secret_key(secret), data, hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# ------------------------------------------------------------------ signatures


def sign_standard(secret: str, delivery_id: str, body: bytes, timestamp: int) -> str:
    """The ``webhook-signature`` header value (``v1,<base64>``) for ``body`` sent as
    delivery ``delivery_id`` at ``timestamp``."""
    digest = _mac(secret, f"{delivery_id}.{timestamp}.".encode() + body)
    return "v1," + base64.b64encode(digest).decode("ascii")


def signed_headers(secret: str, delivery_id: str, body: bytes, timestamp: int) -> dict[str, str]:
    """Every signature header of a delivery sent at ``timestamp``: the Standard Webhooks
    ones and the deprecated ``Conveyor-Signature``."""
    return {
        ID_HEADER: delivery_id,
        TIMESTAMP_HEADER: str(timestamp),
        STANDARD_SIGNATURE_HEADER: sign_standard(secret, delivery_id, body, timestamp),
        SIGNATURE_HEADER: sign_delivery(secret, body, timestamp),
    }


def sign_delivery(secret: str, body: bytes, timestamp: int) -> str:
    """The deprecated ``Conveyor-Signature`` header value for ``body`` sent at
    ``timestamp``."""
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
        try:
            expected = _mac(secret, f"{timestamp}.".encode() + body).hex()
        except ValueError:
            continue
        if any(hmac.compare_digest(expected, candidate) for candidate in given):
            return True
    return False


def verify_standard(
    headers: Mapping[str, str],
    body: bytes,
    secrets: Sequence[str],
    now: float,
    tolerance: float = DEFAULT_TOLERANCE,
) -> bool:
    """True when the Standard Webhooks headers of a delivery (``headers``, keys in any
    case) sign ``body`` with one of ``secrets`` within ``tolerance`` seconds of ``now``;
    False (never an exception) for headers of any other shape."""
    lowered = {str(k).lower(): v for k, v in headers.items()}
    delivery_id = lowered.get(ID_HEADER)
    stamp = lowered.get(TIMESTAMP_HEADER)
    signature = lowered.get(STANDARD_SIGNATURE_HEADER)
    if not (
        isinstance(delivery_id, str)
        and isinstance(stamp, str)
        and isinstance(signature, str)
        and 0 < len(delivery_id) <= _MAX_ID_LEN
        and _ID_RE.fullmatch(delivery_id)
        and _TIMESTAMP_RE.fullmatch(stamp)
        and len(signature) <= _MAX_HEADER_LEN
    ):
        return False
    timestamp = int(stamp)
    if abs(now - timestamp) > tolerance:
        return False
    given = []
    for part in signature.split(" "):
        version, sep, encoded = part.partition(",")
        if version == "v1" and sep and _B64_SIG_RE.fullmatch(encoded):
            given.append(base64.b64decode(encoded))
    signed = f"{delivery_id}.{timestamp}.".encode() + body
    for secret in secrets:
        try:
            expected = _mac(secret, signed)
        except ValueError:
            continue
        if any(hmac.compare_digest(expected, candidate) for candidate in given):
            return True
    return False


#: A delivery id: printable ASCII without separators, as ours (lease ids) are.
_ID_RE = re.compile(r"[!-~]+")
_MAX_ID_LEN = 256
#: A v1 Standard Webhooks signature: the padded base64 of a SHA-256.
_B64_SIG_RE = re.compile(r"[A-Za-z0-9+/]{43}=")


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
        try:
            expected = _mac(secret, signed.encode())
        except ValueError:
            continue
        if hmac.compare_digest(expected, given):
            return claims
    raise InvalidToken("lease token signature does not match")
