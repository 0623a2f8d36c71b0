"""Aggregation groups: which config applies to a group, and when a group is due.

Both brokers decide with these functions (the Postgres broker's statement computes the
same in SQL, and the conformance suite holds them to each other).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime

from conveyor_broker.types import DEFAULT_GROUP_CONFIG, GroupConfig, GroupStats, GroupTrigger


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """The regular expression of a group glob: ``*`` any text, ``?`` one character."""
    parts = (".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.compile("".join(parts), re.DOTALL)


def pattern_like(pattern: str) -> str:
    """A group glob as a SQL LIKE pattern (backslash escapes)."""
    out: list[str] = []
    for c in pattern:
        if c == "*":
            out.append("%")
        elif c == "?":
            out.append("_")
        elif c in "%_\\":
            out.append("\\" + c)
        else:
            out.append(c)
    return "".join(out)


def config_for(group: str, configs: Iterable[GroupConfig]) -> GroupConfig:
    """The config that applies to ``group`` among its queue's ``configs``: the longest
    matching pattern, then the first in code point order; the defaults with none."""
    matching = [c for c in configs if pattern_regex(c.pattern).fullmatch(group)]
    if not matching:
        return DEFAULT_GROUP_CONFIG
    return min(matching, key=lambda c: (-len(c.pattern), c.pattern))


def trigger(stats: GroupStats, config: GroupConfig, now: datetime) -> GroupTrigger | None:
    """Why the group is due at ``now`` under ``config``, or None when it is not."""
    if stats.size >= config.max_size:
        return GroupTrigger.SIZE
    delay_at = stats.oldest_at + config.max_delay
    grace_at = stats.newest_at + config.grace_period
    if delay_at <= now and (grace_at > now or delay_at <= grace_at):
        return GroupTrigger.MAX_DELAY
    if grace_at <= now:
        return GroupTrigger.GRACE_PERIOD
    return None
