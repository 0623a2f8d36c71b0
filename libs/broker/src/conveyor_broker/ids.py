"""ULID task and lease ids, timestamped from an injected clock."""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime, timedelta

from ulid import ULID

_ULID_RE = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
# Maps a random byte to a character by its low five bits (uniform: 32 divides 256).
_BYTE_TO_CROCKFORD = bytes(ord(_CROCKFORD[b & 31]) for b in range(256))
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def new_id(now: datetime) -> str:
    """A new ULID string whose timestamp part is ``now``."""
    return str(ULID.from_datetime(now))


def is_ulid(value: str) -> bool:
    """True when ``value`` is a canonical 26-character ULID string."""
    return bool(_ULID_RE.fullmatch(value))


def new_ids(now: datetime, count: int) -> list[str]:
    """``count`` new ULID strings whose timestamp part is ``now``.

    The same as ``[new_id(now) for _ in range(count)]``, many times faster: the timestamp
    is encoded once, and the 80 random bits of every id (16 characters of 5 bits) are
    drawn and encoded in one go.
    """
    millis = (now - _EPOCH) // timedelta(milliseconds=1)
    stamp = "".join(_CROCKFORD[(millis >> shift) & 31] for shift in range(45, -5, -5))
    noise = os.urandom(16 * count).translate(_BYTE_TO_CROCKFORD).decode("ascii")
    return [stamp + noise[i : i + 16] for i in range(0, 16 * count, 16)]
