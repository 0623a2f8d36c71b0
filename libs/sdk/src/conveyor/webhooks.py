"""Helpers for webhook endpoints written in Python.

A webhook worker is an HTTP endpoint the server POSTs tasks to (see docs/protocol.md,
"Webhook workers"). This module gives such an endpoint what it needs from Conveyor:

- :func:`verify_webhook` checks the Standard Webhooks signature of a delivery (the
  ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature`` headers) against the
  registration's secrets (do it on the raw body, before parsing it); any Standard
  Webhooks library does the same with :func:`standard_secret` of each secret;
- :class:`ReplayGuard` remembers the delivery ids (``webhook-id``) it has seen, so that a
  captured delivery sent again within the signature's tolerance is refused;
- :class:`Callbacks` (blocking) and :class:`AsyncCallbacks` (asyncio) call the server's
  WebhookService for a delivery the endpoint answered ``accepted``: ``heartbeat`` keeps
  its lease alive, ``report_result`` finishes it;
- :func:`verify_signature` checks the older ``Conveyor-Signature`` header: **deprecated**,
  the server sends it for one more release.

::

    from conveyor.webhooks import AsyncCallbacks, ReplayGuard, verify_webhook

    replays = ReplayGuard()
    ...
    if not verify_webhook(request.headers, raw_body, SECRETS):
        return 401
    if not replays.first_time(request.headers["webhook-id"]):
        return 409  # a delivery seen before: answer nothing else
    params = json.loads(raw_body)["params"]
    ...  # answer {"outcome": "accepted"} now, then, later:
    async with AsyncCallbacks(params["callback"]) as callbacks:
        await callbacks.heartbeat(params["lease_token"], progress={"pct": 50})
        await callbacks.report_result(params["lease_token"], "success", result={"ok": True})
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from conveyor._clients.callbacks import AsyncCallbacks
from conveyor._clients.callbacks_sync import Callbacks
from conveyor._clients.callbacks_wire import Outcome

__all__ = [
    "DEFAULT_TOLERANCE",
    "ID_HEADER",
    "SIGNATURE_HEADER",
    "STANDARD_SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "WHSEC_PREFIX",
    "AsyncCallbacks",
    "Callbacks",
    "Outcome",
    "ReplayGuard",
    "delivery_id",
    "standard_secret",
    "verify_signature",
    "verify_webhook",
]

#: The Standard Webhooks headers of every delivery: its id (unique per delivery: the
#: same id twice is a replay), its signing time, and its signature.
ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
STANDARD_SIGNATURE_HEADER = "webhook-signature"
#: The older signature header. Deprecated: the server stops sending it after one release.
SIGNATURE_HEADER = "Conveyor-Signature"
#: Seconds a delivery's signing time may differ from the endpoint's clock.
DEFAULT_TOLERANCE = 300
#: The prefix of a secret in the Standard Webhooks form.
WHSEC_PREFIX = "whsec_"

Secrets = str | Iterable[str]
Body = bytes | bytearray | memoryview


def _key(secret: str) -> bytes:
    """The HMAC key of ``secret`` (see :func:`standard_secret`)."""
    if not isinstance(secret, str):
        raise TypeError("a secret is a str")
    if secret.startswith(WHSEC_PREFIX):
        try:
            return base64.b64decode(secret[len(WHSEC_PREFIX) :], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("a whsec_ secret is whsec_ followed by standard base64") from None
    return secret.encode()


def standard_secret(secret: str) -> str:
    """``secret`` as a Standard Webhooks library takes it: a ``whsec_<base64>`` secret is
    itself (its key is the decoded bytes); any other text is the key made of its UTF-8
    bytes, which is ``whsec_`` + their base64."""
    if secret.startswith(WHSEC_PREFIX):
        return secret
    return WHSEC_PREFIX + base64.b64encode(_key(secret)).decode("ascii")


def _keys(secrets: Secrets) -> list[bytes]:
    return [_key(secrets)] if isinstance(secrets, str) else [_key(s) for s in secrets]


def _check_body(body: object) -> bytes:
    if not isinstance(body, bytes | bytearray | memoryview):
        raise TypeError("body must be the raw request body as bytes")
    return bytes(body)


def _text(value: object) -> str | None:
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or len(value) > _MAX_HEADER_LEN or not value.isascii():
        return None
    return value


def _header(headers: object, name: str) -> str | None:
    """The header ``name`` of ``headers`` (any mapping, names in any case), or None."""
    if not isinstance(headers, Mapping):
        return None
    try:
        value = headers.get(name)
        if value is None:
            wanted = name.lower()
            value = next(
                (v for k, v in headers.items() if isinstance(k, str) and k.lower() == wanted),
                None,
            )
    except Exception:  # a mapping that misbehaves is as good as no header
        return None
    return _text(value)


def delivery_id(headers: Mapping[str, str]) -> str | None:
    """The delivery id (``webhook-id``) of a delivery's headers, None when it has no
    well-formed one."""
    value = _header(headers, ID_HEADER)
    return value if value is not None and _ID_RE.fullmatch(value) else None


def verify_webhook(
    headers: Mapping[str, str],
    body: Body,
    secrets: Secrets,
    *,
    now: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> bool:
    """True when the Standard Webhooks headers of a delivery sign ``body`` (the raw
    request body, exactly as received) with one of ``secrets`` and were made within
    ``tolerance`` seconds of ``now`` (Unix seconds; default: the current time).

    ``headers`` is the request's header mapping (names in any case; values str or
    bytes). The signature is ``webhook-signature: v1,<base64 HMAC-SHA256>`` (several
    space-separated are fine) over ``"<webhook-id>.<webhook-timestamp>." + body``, keyed
    with a secret's key (:func:`standard_secret`). Accepting any of several secrets lets
    them rotate with no downtime; refusing an old timestamp, and an id seen before
    (:class:`ReplayGuard`), makes a captured delivery useless to replay. Comparisons take
    constant time.

    Whatever the headers hold (they come from the network: missing, empty, not ASCII,
    huge, a timestamp that is not a number, a signature that is not base64), the answer is
    False, never an exception, so an endpoint answers 401. TypeError only for a ``body``
    that is not bytes (a parsed body cannot be verified), ValueError for a ``whsec_``
    secret of the endpoint's own that is not base64.
    """
    raw = _check_body(body)
    keys = _keys(secrets)
    ident = delivery_id(headers)
    stamp = _header(headers, TIMESTAMP_HEADER)
    signature = _header(headers, STANDARD_SIGNATURE_HEADER)
    if ident is None or stamp is None or signature is None:
        return False
    if not _TIMESTAMP_RE.fullmatch(stamp):
        return False
    timestamp = int(stamp)
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        return False
    given: list[bytes] = []
    for part in signature.split(" "):
        version, sep, encoded = part.partition(",")
        if version == "v1" and sep and _B64_SIG_RE.fullmatch(encoded):
            given.append(base64.b64decode(encoded))
    signed = f"{ident}.{timestamp}.".encode() + raw
    for key in keys:
        expected = hmac.new(key, signed, hashlib.sha256).digest()
        if any(hmac.compare_digest(expected, candidate) for candidate in given):
            return True
    return False


class ReplayGuard:
    """Remembers the delivery ids an endpoint has accepted, for ``window`` seconds (by
    default twice the signature tolerance: a delivery older than that fails
    :func:`verify_webhook` anyway), so that the same delivery sent again is refused.

    Call :meth:`first_time` after :func:`verify_webhook` said yes. In memory, per
    process: an endpoint that runs several processes shares one store instead (a cache
    with a TTL), keyed by the delivery id. At most ``capacity`` ids are kept; past that,
    the oldest are forgotten first (size it above the deliveries one window brings).
    Not thread-safe: guard it with a lock in a threaded server.
    """

    def __init__(self, *, window: float = 2 * DEFAULT_TOLERANCE, capacity: int = 100_000) -> None:
        if window <= 0 or capacity < 1:
            raise ValueError("window must be > 0 and capacity >= 1")
        self.window = window
        self.capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()

    def first_time(self, delivery: str, *, now: float | None = None) -> bool:
        """True the first time ``delivery`` (a ``webhook-id``) comes within the window,
        and remember it; False when it came before (a replay: refuse it)."""
        current = time.time() if now is None else now
        while self._seen:
            oldest, seen_at = next(iter(self._seen.items()))
            if current - seen_at < self.window and len(self._seen) < self.capacity:
                break
            del self._seen[oldest]
        if delivery in self._seen:
            return False
        self._seen[delivery] = current
        return True

    def __len__(self) -> int:
        return len(self._seen)


def verify_signature(
    header: str | bytes | None,
    body: Body,
    secrets: Secrets,
    *,
    now: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> bool:
    """Deprecated: use :func:`verify_webhook` (the server sends the ``Conveyor-Signature``
    header for one more release only).

    True when the ``Conveyor-Signature`` header value ``header`` signs ``body`` (the
    raw request body, exactly as received) with one of ``secrets``, and was made within
    ``tolerance`` seconds of ``now`` (Unix seconds; default: the current time).

    The header is ``t=<unix seconds>,v1=<hex HMAC-SHA256>``, the HMAC keyed with a
    secret's key (:func:`standard_secret`) over ``"<t>." + body``. Comparisons take
    constant time.

    Whatever the header holds (it comes from the network: missing, empty, not ASCII,
    huge, a timestamp that is not a number), the answer is False, never an exception, so
    an endpoint answers 401. ``header`` may also be the raw header bytes. TypeError only
    for a ``body`` that is not bytes (a parsed body cannot be verified).
    """
    warnings.warn(
        "verify_signature checks the deprecated Conveyor-Signature header: use "
        "verify_webhook (Standard Webhooks headers)",
        DeprecationWarning,
        stacklevel=2,
    )
    raw = _check_body(body)
    keys = _keys(secrets)
    parsed = _parse_signature(header)
    if parsed is None:
        return False
    timestamp, given = parsed
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        return False
    signed = f"{timestamp}.".encode() + raw
    for key in keys:
        expected = hmac.new(key, signed, hashlib.sha256).hexdigest()
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
#: A v1 Standard Webhooks signature: the padded base64 of a SHA-256.
_B64_SIG_RE = re.compile(r"[A-Za-z0-9+/]{43}=")
#: A delivery id: printable ASCII without spaces, at most 256 characters.
_ID_RE = re.compile(r"[!-~]{1,256}")


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
