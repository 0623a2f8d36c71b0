"""AdminService aggregation group RPCs over a real gRPC socket: set, list and delete
configs, group stats, and clear errors for bad input."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import grpc
from conveyor_broker import FakeClock, NewTask
from conveyor_broker.types import DEFAULT_GROUP_CONFIG
from conveyor_protos.v1 import service_pb2
from conveyor_runtime import wire
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.stream import refused
from google.protobuf.duration_pb2 import Duration


def config(**fields: Any) -> service_pb2.SetGroupConfigRequest:
    fields.setdefault("queue", "emails")
    return service_pb2.SetGroupConfigRequest(config=service_pb2.GroupConfig(**fields))


async def test_set_list_and_delete(admin: Any, broker: CountingBroker) -> None:
    set_ = await admin.SetGroupConfig(
        config(
            pattern="digest:*",
            max_size=50,
            max_delay=Duration(seconds=60),
            grace_period=Duration(seconds=5),
        )
    )
    assert set_.config.pattern == "digest:*"
    assert set_.config.max_size == 50
    assert wire.from_duration(set_.config.max_delay) == timedelta(seconds=60)
    assert wire.from_duration(set_.config.grace_period) == timedelta(seconds=5)
    # Unset fields take the defaults; an empty pattern is every group.
    default = await admin.SetGroupConfig(config(queue="reports"))
    assert default.config.pattern == "*"
    assert default.config.max_size == DEFAULT_GROUP_CONFIG.max_size
    assert wire.from_duration(default.config.max_delay) == DEFAULT_GROUP_CONFIG.max_delay

    listed = await admin.ListGroupConfigs(service_pb2.ListGroupConfigsRequest())
    assert [(c.queue, c.pattern) for c in listed.configs] == [
        ("emails", "digest:*"),
        ("reports", "*"),
    ]
    only = await admin.ListGroupConfigs(service_pb2.ListGroupConfigsRequest(queue="emails"))
    assert [c.queue for c in only.configs] == ["emails"]
    stored = await broker.list_group_configs("emails")
    assert stored[0].max_size == 50

    await admin.DeleteGroupConfig(
        service_pb2.DeleteGroupConfigRequest(queue="emails", pattern="digest:*")
    )
    await admin.DeleteGroupConfig(service_pb2.DeleteGroupConfigRequest(queue="reports"))
    listed = await admin.ListGroupConfigs(service_pb2.ListGroupConfigsRequest())
    assert list(listed.configs) == []


async def test_bad_input_is_invalid_argument(admin: Any) -> None:
    code, message = await refused(admin.SetGroupConfig, service_pb2.SetGroupConfigRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "config is required" in message
    for bad in (
        config(queue="a b"),
        config(queue=""),
        config(max_size=-1),
        config(max_delay=Duration(seconds=-1)),
        config(grace_period=Duration(seconds=-5)),
        config(pattern="x\n"),
    ):
        code, message = await refused(admin.SetGroupConfig, bad)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert message
    code, _ = await refused(admin.GetGroupStats, service_pb2.GetGroupStatsRequest(queue="a b"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = await refused(admin.GetGroupStats, service_pb2.GetGroupStatsRequest(limit=5000))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = await refused(
        admin.ListGroupConfigs, service_pb2.ListGroupConfigsRequest(queue="a b")
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def test_delete_missing_is_not_found(admin: Any) -> None:
    code, message = await refused(
        admin.DeleteGroupConfig, service_pb2.DeleteGroupConfigRequest(queue="emails")
    )
    assert code == grpc.StatusCode.NOT_FOUND
    assert "emails" in message


async def test_group_stats(admin: Any, broker: CountingBroker, clock: FakeClock) -> None:
    first = clock.now()
    for i in range(3):
        await broker.enqueue(NewTask(type="digest", queue="emails", group="g1"))
        if i == 0:
            clock.advance(timedelta(seconds=10))
    await broker.enqueue(NewTask(type="digest", queue="reports", group="g2"))
    response = await admin.GetGroupStats(service_pb2.GetGroupStatsRequest())
    assert [(g.queue, g.group, g.size) for g in response.groups] == [
        ("emails", "g1", 3),
        ("reports", "g2", 1),
    ]
    g1 = response.groups[0]
    assert wire.from_timestamp(g1.oldest_at) == first
    assert wire.from_timestamp(g1.newest_at) == first + timedelta(seconds=10)
    one = await admin.GetGroupStats(service_pb2.GetGroupStatsRequest(queue="reports"))
    assert [g.group for g in one.groups] == ["g2"]
    limited = await admin.GetGroupStats(service_pb2.GetGroupStatsRequest(limit=1))
    assert len(limited.groups) == 1
