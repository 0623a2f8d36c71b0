"""Semantic version checks for the worker handshake."""

from __future__ import annotations

import re

# ASCII digits only (``\d`` also takes other scripts' digits), matched with fullmatch.
_SEMVER_RE = re.compile(r"v?([0-9]{1,9})\.([0-9]{1,9})\.([0-9]{1,9})(?:[-+][0-9A-Za-z.+-]*)?")


def parse_version(text: str) -> tuple[int, int, int]:
    """``"X.Y.Z"`` (an optional pre-release or build suffix is ignored) as a tuple.

    Raises ValueError when ``text`` is not a semantic version.
    """
    match = _SEMVER_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a semantic version: {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch)


def at_least(version: str, minimum: str) -> bool:
    """True when ``version >= minimum``; an empty ``minimum`` accepts anything.

    Raises ValueError when either version cannot be parsed.
    """
    if not minimum:
        parse_version(version)
        return True
    return parse_version(version) >= parse_version(minimum)
