"""ULID task and lease ids, timestamped from an injected clock."""

from __future__ import annotations

import re
from datetime import datetime

from ulid import ULID

_ULID_RE = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}$")


def new_id(now: datetime) -> str:
    """A new ULID string whose timestamp part is ``now``."""
    return str(ULID.from_datetime(now))


def is_ulid(value: str) -> bool:
    """True when ``value`` is a canonical 26-character ULID string."""
    return bool(_ULID_RE.match(value))
