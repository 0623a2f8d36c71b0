"""Aggregation group configs and stats between the broker and the wire."""

from __future__ import annotations

from conveyor_broker import GroupConfig, GroupStats
from conveyor_broker.types import DEFAULT_GROUP_CONFIG
from conveyor_protos.v1 import service_pb2

from conveyor_runtime.wire.time import duration, from_duration, set_timestamp


def group_config_from_proto(config: service_pb2.GroupConfig) -> GroupConfig:
    """A config from the wire: an empty pattern is ``*``; an unset size, delay or grace
    takes the server default (a zero delay or grace must be sent as a zero duration)."""
    return GroupConfig(
        queue=config.queue,
        pattern=config.pattern or "*",
        max_size=config.max_size or DEFAULT_GROUP_CONFIG.max_size,
        max_delay=(
            from_duration(config.max_delay)
            if config.HasField("max_delay")
            else DEFAULT_GROUP_CONFIG.max_delay
        ),
        grace_period=(
            from_duration(config.grace_period)
            if config.HasField("grace_period")
            else DEFAULT_GROUP_CONFIG.grace_period
        ),
    )


def group_config_to_proto(config: GroupConfig) -> service_pb2.GroupConfig:
    """A stored config on the wire."""
    return service_pb2.GroupConfig(
        queue=config.queue,
        pattern=config.pattern,
        max_size=config.max_size,
        max_delay=duration(config.max_delay),
        grace_period=duration(config.grace_period),
    )


def group_stats_to_proto(stats: GroupStats) -> service_pb2.GroupStats:
    """A group's waiting members on the wire."""
    out = service_pb2.GroupStats(queue=stats.queue, group=stats.group, size=stats.size)
    set_timestamp(out.oldest_at, stats.oldest_at)
    set_timestamp(out.newest_at, stats.newest_at)
    return out
