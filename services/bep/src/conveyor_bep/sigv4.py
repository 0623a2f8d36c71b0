"""AWS Signature Version 4, as S3-compatible object stores (AWS S3, MinIO, Ceph RGW,
Cloudflare R2) check it: the request signed in an ``Authorization`` header.

The canonical request is the method, the URI path as sent (S3 paths are encoded once and
never normalized), the sorted query, the signed headers (lower-case names, values trimmed
with inner runs of spaces collapsed) and the payload's SHA-256. The string to sign names
the algorithm, the time and the credential scope ``<date>/<region>/<service>/aws4_request``
and hashes the canonical request; the key is the secret HMAC-chained through the scope.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import quote

ALGORITHM = "AWS4-HMAC-SHA256"
#: The payload hash of a request without a body.
EMPTY_PAYLOAD_SHA256 = hashlib.sha256(b"").hexdigest()
#: What ``x-amz-content-sha256`` says when the body is left out of the signature.
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


@dataclass(frozen=True, slots=True)
class Credentials:
    """An access key and where it signs for."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    region: str = "us-east-1"
    service: str = "s3"


def encode_path(path: str) -> str:
    """``path`` URI-encoded the way S3 signs it: every byte but the unreserved characters
    and ``/`` percent-encoded, once."""
    return quote(path, safe="/")


def _encode(value: str) -> str:
    return quote(value, safe="")


def _hmac(key: bytes, message: str) -> bytes:
    return hmac.new(key, message.encode(), hashlib.sha256).digest()


def canonical_request(
    method: str,
    path: str,
    query: Sequence[tuple[str, str]],
    headers: Mapping[str, str],
    payload_sha256: str,
) -> tuple[str, str]:
    """The canonical request and its signed-headers list. ``path`` is already encoded (as
    on the wire); ``headers`` are the ones to sign, ``host`` among them."""
    normalized = {name.lower(): " ".join(value.split()) for name, value in headers.items()}
    names = sorted(normalized)
    signed_headers = ";".join(names)
    canonical_query = "&".join(
        f"{k}={v}" for k, v in sorted((_encode(k), _encode(v)) for k, v in query)
    )
    lines = [
        method.upper(),
        path or "/",
        canonical_query,
        "".join(f"{name}:{normalized[name]}\n" for name in names),
        signed_headers,
        payload_sha256,
    ]
    return "\n".join(lines), signed_headers


def string_to_sign(amz_date: str, scope: str, request: str) -> str:
    """What the signing key signs: the algorithm, the time, the scope, the request's hash."""
    digest = hashlib.sha256(request.encode()).hexdigest()
    return f"{ALGORITHM}\n{amz_date}\n{scope}\n{digest}"


def signing_key(secret_access_key: str, date: str, region: str, service: str) -> bytes:
    """The secret chained through the scope: date, region, service, ``aws4_request``."""
    key = _hmac(f"AWS4{secret_access_key}".encode(), date)
    key = _hmac(key, region)
    key = _hmac(key, service)
    return _hmac(key, "aws4_request")


def sign(
    credentials: Credentials,
    *,
    method: str,
    host: str,
    path: str,
    payload_sha256: str,
    now: datetime,
    query: Sequence[tuple[str, str]] = (),
    headers: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The headers to send: ``headers`` plus ``host``, ``x-amz-date``,
    ``x-amz-content-sha256`` and ``Authorization``, all of them signed. ``host`` is the
    request's host as the ``Host`` header carries it (``name[:port]``); ``path`` is encoded
    (:func:`encode_path`); ``payload_sha256`` is the body's hex SHA-256 (or
    :data:`UNSIGNED_PAYLOAD`)."""
    amz_date = now.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    date = amz_date[:8]
    scope = f"{date}/{credentials.region}/{credentials.service}/aws4_request"
    signed = {name.lower(): value for name, value in (headers or {}).items()}
    signed |= {"host": host, "x-amz-date": amz_date, "x-amz-content-sha256": payload_sha256}
    request, signed_headers = canonical_request(method, path, query, signed, payload_sha256)
    key = signing_key(credentials.secret_access_key, date, credentials.region, credentials.service)
    signature = hmac.new(
        key, string_to_sign(amz_date, scope, request).encode(), hashlib.sha256
    ).hexdigest()
    signed["authorization"] = (
        f"{ALGORITHM} Credential={credentials.access_key_id}/{scope},"
        f"SignedHeaders={signed_headers},Signature={signature}"
    )
    return signed
