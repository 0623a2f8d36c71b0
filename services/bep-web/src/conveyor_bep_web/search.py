"""The build search's input: filters, tag syntax and keyset cursors, checked.

A cursor is opaque to clients: URL-safe base64 of a JSON array holding the sort key of
the last row of a page (for builds ``[created_at, invocation_id]``). Anything malformed
raises :class:`BadInput`, which the API answers with 400 and its message.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

#: Builds a page shows unless told otherwise, and at most.
DEFAULT_LIMIT = 50
MAX_LIMIT = 500
#: Builds the facets count at most (the newest of the filtered set), and values per facet.
FACET_SCAN = 10_000
FACET_VALUES = 20
BUILD_STATUSES = ("running", "success", "failed", "aborted", "incomplete")


class BadInput(ValueError):
    """A query parameter the API cannot use (answered with 400 and this message)."""


@dataclass(frozen=True, slots=True)
class BuildSearch:
    """One search of a project's builds: every filter optional."""

    status: str | None = None
    user: str | None = None
    branch: str | None = None
    tags: tuple[tuple[str, str], ...] = ()
    text: str | None = None

    def params(self) -> tuple[Any, ...]:
        """The filter's SQL parameters ``$3..$7`` of :data:`~conveyor_bep_web.queries.BUILDS`."""
        tags = [json.dumps({k: v}) for k, v in self.tags] or None
        return (self.status, self.user, self.branch, tags, like_pattern(self.text))

    def query_string(self) -> list[tuple[str, str]]:
        """The search as query parameters (for links to the next page and facets)."""
        out: list[tuple[str, str]] = []
        for name, value in (("status", self.status), ("user", self.user), ("branch", self.branch)):
            if value is not None:
                out.append((name, value))
        out += [("tag", f"{k}:{v}") for k, v in self.tags]
        if self.text is not None:
            out.append(("q", self.text))
        return out


def _blank(value: str | None) -> str | None:
    return value if value else None


def build_search(
    *,
    status: str | None,
    user: str | None,
    branch: str | None,
    tag: list[str] | None,
    q: str | None,
) -> BuildSearch:
    """A :class:`BuildSearch` of the request's parameters (empty ones: no filter);
    :class:`BadInput` for an unknown status or a tag not written ``key:value``."""
    status = _blank(status)
    if status is not None and status not in BUILD_STATUSES:
        raise BadInput(f"unknown status {status!r}: one of {', '.join(BUILD_STATUSES)}")
    return BuildSearch(
        status=status,
        user=_blank(user),
        branch=_blank(branch),
        tags=tuple(parse_tag(t) for t in tag or () if t),
        text=_blank(q.strip() if q else None),
    )


def parse_tag(value: str) -> tuple[str, str]:
    """``key:value`` as a pair (the value may hold more colons; it may be empty)."""
    key, sep, rest = value.partition(":")
    if not sep or not key:
        raise BadInput(f"bad tag filter {value!r}: write it key:value")
    return key, rest


def like_pattern(text: str | None) -> str | None:
    """A case-insensitive substring pattern for ``ILIKE`` (``%``, ``_`` and ``\\`` in
    ``text`` match themselves)."""
    if text is None:
        return None
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def check_limit(limit: int, *, maximum: int = MAX_LIMIT) -> int:
    """``limit`` if it is 1..``maximum``, else :class:`BadInput`."""
    if not 1 <= limit <= maximum:
        raise BadInput(f"limit must be between 1 and {maximum}, not {limit}")
    return limit


def encode_cursor(*key: Any) -> str:
    """An opaque cursor of a sort key (datetimes as ISO 8601)."""
    values = [k.isoformat() if isinstance(k, datetime) else k for k in key]
    raw = json.dumps(values, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, shape: tuple[type, ...]) -> tuple[Any, ...]:
    """The sort key in ``cursor``, checked against ``shape`` (``datetime`` entries
    parsed); :class:`BadInput` for anything else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        values = json.loads(raw)
    except (binascii.Error, ValueError) as exc:
        raise BadInput(f"bad cursor {cursor[:40]!r}: not one this API gave out") from exc
    if not isinstance(values, list) or len(values) != len(shape):
        raise BadInput(f"bad cursor {cursor[:40]!r}: not one this API gave out")
    out: list[Any] = []
    for value, kind in zip(values, shape, strict=True):
        if kind is datetime:
            try:
                parsed = datetime.fromisoformat(value) if isinstance(value, str) else None
            except ValueError:
                parsed = None
            if parsed is None or parsed.tzinfo is None:
                raise BadInput(f"bad cursor {cursor[:40]!r}: not one this API gave out")
            out.append(parsed)
        elif kind is int:
            if not isinstance(value, int) or isinstance(value, bool):
                raise BadInput(f"bad cursor {cursor[:40]!r}: not one this API gave out")
            out.append(value)
        else:
            if not isinstance(value, kind):
                raise BadInput(f"bad cursor {cursor[:40]!r}: not one this API gave out")
            out.append(value)
    return tuple(out)
