"""The cluster key: every message between services carries a MAC the receiver checks.

NATS permissions (deploy/nats.conf) keep anyone without a service's credentials off the
services' subjects; the cluster key is the second wall: a service acts only on messages
sealed with a key the services share, so a client that reaches NATS some other way (a
leaked credential of another application, an open server, a misconfigured account) can
neither forge a dispatch, a cancel, a callback or a registration nor replay one it saw.

A seal is one NATS header, ``Conveyor-Seal: 1.<key id>.<sent ms>.<deadline ms>.<mac>``:

- ``mac`` is HMAC-SHA256, its first 128 bits in hex (truncated as RFC 4868 does), under
  the key named by ``key id`` (8 characters of the key's SHA-256) over the version, the subject,
  both times and the body: a sealed message cannot move to another subject (another
  gateway, another queue), be altered, or change its times;
- ``sent`` (Unix milliseconds): a receiver refuses a message sent more than
  :data:`MAX_AGE` seconds ago (or ahead: clocks may disagree that much, no more), so a
  captured message cannot be replayed later;
- ``deadline`` (Unix milliseconds, 0: none): a request carries the moment its sender
  stops waiting for the reply; the receiver refuses it past that (a dispatch that reaches
  its gateway after the dispatcher released its tasks must not run them as well).

Headers travel beside the body: the payloads stay what they were, and a receiver that does
not know seals (your own consumers of ``events.>``) reads them as before.

Several keys may be configured for rotation: the first signs, every one verifies. Without
a key, a service refuses to start unless ``allow_unsigned`` says it runs unsigned on
purpose (or during a rolling upgrade: see docs/operations.md); then it seals without a
MAC (the times still count) and accepts messages without one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor_runtime.settings import CommonSettings

__all__ = [
    "MAX_AGE",
    "MIN_KEY_BYTES",
    "SEAL_HEADER",
    "ClusterAuth",
    "ClusterKeyError",
    "generate_key",
    "key_id",
    "parse_keys",
    "read_key_file",
]

logger = logging.getLogger(__name__)

#: The NATS header that carries a message's seal.
SEAL_HEADER = "Conveyor-Seal"
#: Seconds a sealed message stays acceptable after it was sent (and before, for clocks
#: that disagree).
MAX_AGE = 30.0
#: The shortest key accepted (HMAC-SHA256 gains nothing from a longer one).
MIN_KEY_BYTES = 32
_VERSION = "1"
#: SHA-256's block size, the length an HMAC key is padded to.
_BLOCK = 64
#: Bytes of the MAC a seal carries: 128 bits leave a forger a 2**-128 chance per try.
_MAC_BYTES = 16
#: The most digits of a seal's times (Unix milliseconds have 13 until the year 2286).
_TIME_DIGITS = 16


def _is_time(text: str) -> bool:
    """True when ``text`` is what a seal's time is: 1 to 16 ASCII digits."""
    return 0 < len(text) <= _TIME_DIGITS and text.isascii() and text.isdigit()


class ClusterKeyError(ValueError):
    """A cluster key that cannot be used: not base64, too short, an unreadable file, or
    none at all where one is required."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


class _Mac:
    """HMAC-SHA256 under one key, with the key's inner and outer states computed once.

    What ``hmac.digest`` computes (RFC 2104), about five times faster per message: it
    sets the key up again on every call, which costs more than hashing a small message.
    """

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        if len(key) > _BLOCK:
            key = hashlib.sha256(key).digest()
        key = key.ljust(_BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def digest(self, data: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


def generate_key() -> str:
    """A new random cluster key, base64 (what ``CONVEYOR_CLUSTER_KEY`` takes)."""
    return base64.b64encode(secrets.token_bytes(MIN_KEY_BYTES)).decode("ascii")


def key_id(key: bytes) -> str:
    """The public name of ``key`` in a seal: 8 characters of its SHA-256."""
    return _b64(hashlib.sha256(key).digest())[:8]


def parse_keys(texts: Sequence[str], *, source: str = "CONVEYOR_CLUSTER_KEY") -> list[bytes]:
    """Decode base64 (standard or URL-safe, padded or not) keys of at least
    :data:`MIN_KEY_BYTES` bytes each; ClusterKeyError names the first bad one by position
    (never by value: it is a secret)."""
    keys: list[bytes] = []
    for n, text in enumerate(texts, 1):
        text = text.strip()
        padded = text + "=" * (-len(text) % 4)
        try:
            key = base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            raise ClusterKeyError(f"{source}: key {n} is not base64") from None
        if len(key) < MIN_KEY_BYTES:
            raise ClusterKeyError(
                f"{source}: key {n} is {len(key)} bytes; a cluster key is at least "
                f"{MIN_KEY_BYTES} random bytes, base64 (`conveyor cluster-key` makes one)"
            )
        keys.append(key)
    return keys


def read_key_file(path: str) -> list[str]:
    """The keys in ``path``: one per line, blank lines and ``#`` comments skipped."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError as exc:
        raise ClusterKeyError(
            f"CONVEYOR_CLUSTER_KEY_FILE: cannot read {path}: {exc.strerror or exc}"
        ) from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ClusterKeyError(f"CONVEYOR_CLUSTER_KEY_FILE: {path} holds no key")
    return keys


class ClusterAuth:
    """Seals what a service sends and checks what it receives, with the cluster keys.

    ``keys``: the first signs, every one verifies (rotation). ``allow_unsigned``: accept
    messages without a MAC (and, with no key at all, send them). ``now`` gives Unix
    seconds (the tests move it); ``max_age`` is :data:`MAX_AGE`.
    """

    __slots__ = ("_allow_unsigned", "_by_id", "_max_age_ms", "_now", "_signing", "_unsigned")

    def __init__(
        self,
        keys: Sequence[bytes],
        *,
        allow_unsigned: bool = False,
        now: Callable[[], float] = time.time,
        max_age: float = MAX_AGE,
    ) -> None:
        if not keys and not allow_unsigned:
            raise ClusterKeyError(
                "no cluster key: set CONVEYOR_CLUSTER_KEY or CONVEYOR_CLUSTER_KEY_FILE (the "
                "same on every service; `conveyor cluster-key` makes one) or, knowingly, "
                "CONVEYOR_ALLOW_UNSIGNED=true"
            )
        for key in keys:
            if len(key) < MIN_KEY_BYTES:
                raise ClusterKeyError(f"a cluster key is at least {MIN_KEY_BYTES} bytes")
        self._by_id: dict[str, _Mac] = {key_id(key): _Mac(key) for key in keys}
        self._signing: tuple[str, _Mac] | None = (
            (key_id(keys[0]), self._by_id[key_id(keys[0])]) if keys else None
        )
        self._allow_unsigned = allow_unsigned
        self._now = now
        self._max_age_ms = int(max_age * 1000)
        #: Unsigned messages accepted so far (allow_unsigned), for the logs.
        self._unsigned = 0

    @classmethod
    def from_settings(
        cls, settings: CommonSettings, *, now: Callable[[], float] = time.time
    ) -> ClusterAuth:
        """The keys ``settings`` name (``cluster_key`` or ``cluster_key_file``) and their
        ``allow_unsigned``. Raises ClusterKeyError for a bad key, or none without
        ``allow_unsigned``."""
        texts = (
            read_key_file(settings.cluster_key_file)
            if settings.cluster_key_file
            else settings.cluster_key
        )
        source = "CONVEYOR_CLUSTER_KEY_FILE" if settings.cluster_key_file else None
        keys = parse_keys(texts, source=source or "CONVEYOR_CLUSTER_KEY")
        auth = cls(keys, allow_unsigned=settings.allow_unsigned, now=now)
        if not keys:
            logger.warning(
                "cluster_key.NONE: no cluster key and allow_unsigned is set; ANY client that "
                "reaches NATS can act as a service (dispatch, cancel, complete tasks). Never "
                "do this outside development."
            )
        elif settings.allow_unsigned:
            logger.warning(
                "cluster_key.unsigned_accepted: messages without a MAC are accepted "
                "(allow_unsigned); unset it once every service has the key"
            )
        return auth

    @property
    def signs(self) -> bool:
        """True when this auth has a key to sign with."""
        return self._signing is not None

    @property
    def key_ids(self) -> list[str]:
        """The ids of the keys that verify, the signing one first."""
        return list(self._by_id)

    def seal(self, subject: str, body: bytes, *, within: float | None = None) -> dict[str, str]:
        """The headers that seal ``body`` on ``subject``; ``within``: seconds until the
        request's deadline (None: no deadline)."""
        sent = int(self._now() * 1000)
        deadline = sent + int(within * 1000) if within is not None else 0
        signing = self._signing
        if signing is None:
            return {SEAL_HEADER: f"{_VERSION}..{sent}.{deadline}."}
        kid, mac_of = signing
        mac = mac_of.digest(f"{_VERSION}\n{subject}\n{sent}\n{deadline}\n".encode() + body)
        return {SEAL_HEADER: f"{_VERSION}.{kid}.{sent}.{deadline}.{mac[:_MAC_BYTES].hex()}"}

    def check(self, subject: str, body: bytes, headers: Mapping[str, str] | None) -> str | None:
        """Why the message must be refused, or None when it may be acted on.

        A reason starts with its code (``unsealed``, ``malformed``, ``unknown-key``,
        ``bad-mac``, ``no-mac``, ``expired``, ``future``, ``late``), then a colon and
        the details, if any."""
        seal = headers.get(SEAL_HEADER) if headers else None
        if seal is None:
            if self._allow_unsigned:
                self._note_unsigned(subject)
                return None
            return "unsealed"
        parts = seal.split(".")
        if len(parts) != 5 or parts[0] != _VERSION:
            return "malformed"
        _, kid, sent_text, deadline_text, mac = parts
        # Unix milliseconds in ASCII digits, no more than 16 of them: int() also takes
        # signs, spaces, underscores, other scripts' digits and thousands of digits
        # (whose difference with now no float holds).
        if not (_is_time(sent_text) and _is_time(deadline_text)):
            return "malformed"
        sent, deadline = int(sent_text), int(deadline_text)
        if kid or mac:
            mac_of = self._by_id.get(kid)
            if mac_of is None:
                if not self._by_id and self._allow_unsigned:
                    pass  # no key here to check it with (a rolling upgrade's first step)
                else:
                    return f"unknown-key: {kid!r} is none of this service's keys"
            else:
                expected = mac_of.digest(
                    f"{_VERSION}\n{subject}\n{sent_text}\n{deadline_text}\n".encode() + body
                )
                # compare_digest raises for a str that is not ASCII (a header decodes as
                # UTF-8): such a MAC is no hex, so it is wrong.
                if not mac.isascii() or not hmac.compare_digest(mac, expected[:_MAC_BYTES].hex()):
                    return "bad-mac"
        elif not self._allow_unsigned:
            return "no-mac"
        else:
            self._note_unsigned(subject)
        now = int(self._now() * 1000)
        if now - sent > self._max_age_ms:
            return f"expired: sent {(now - sent) / 1000:.1f}s ago (replayed, or a clock is wrong)"
        if sent - now > self._max_age_ms:
            return f"future: sent {(sent - now) / 1000:.1f}s ahead (a clock is wrong)"
        if deadline and now > deadline:
            return (
                f"late: past its deadline by {(now - deadline) / 1000:.3f}s (the sender gave up; "
                "if this repeats, check that the services' clocks agree)"
            )
        return None

    def _note_unsigned(self, subject: str) -> None:
        self._unsigned += 1
        if self._unsigned == 1 or self._unsigned % 10_000 == 0:
            logger.warning(
                "cluster_key.unsigned_message subject=%s count=%d: accepted (allow_unsigned)",
                subject,
                self._unsigned,
            )
