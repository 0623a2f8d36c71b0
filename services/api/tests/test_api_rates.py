"""AdminService rate-limit RPCs over a real gRPC socket: set, list and delete, the Control
that tells the queue's owner, and clear errors for bad input with nothing stored lost."""

from __future__ import annotations

from typing import Any

import grpc
from conveyor_broker import RateLimit
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime.bus import Bus
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.stream import Recorder, refused


def limit(**fields: Any) -> service_pb2.SetRateLimitRequest:
    fields.setdefault("queue", "calls")
    return service_pb2.SetRateLimitRequest(limit=service_pb2.RateLimit(**fields))


async def test_set_list_and_delete_tell_the_owner(
    admin: Any, broker: CountingBroker, bus: Bus
) -> None:
    controls = await Recorder(cluster_pb2.Control).start(bus, queue="calls")
    set_ = await admin.SetRateLimit(limit(per_second=50, burst=5))
    assert (set_.limit.queue, set_.limit.per_second, set_.limit.burst) == ("calls", 50, 5)
    assert await broker.get_rate_limit("calls") == RateLimit("calls", 50.0, 5)
    await controls.wait_for(lambda m: m.reason == "rate_limit")
    # Burst 0 is one second of tokens, at least one.
    default = await admin.SetRateLimit(limit(queue="slow", per_second=0.2))
    assert default.limit.burst == 1
    assert (await admin.SetRateLimit(limit(per_second=2.5))).limit.burst == 3

    listed = await admin.ListRateLimits(service_pb2.ListRateLimitsRequest())
    assert [(r.queue, r.per_second, r.burst) for r in listed.limits] == [
        ("calls", 2.5, 3),
        ("slow", 0.2, 1),
    ]
    controls.messages.clear()
    await admin.DeleteRateLimit(service_pb2.DeleteRateLimitRequest(queue="calls"))
    assert await broker.get_rate_limit("calls") is None
    await controls.wait_for(lambda m: m.reason == "rate_limit")
    listed = await admin.ListRateLimits(service_pb2.ListRateLimitsRequest())
    assert [r.queue for r in listed.limits] == ["slow"]


async def test_bad_input_is_invalid_argument_and_keeps_the_stored_limit(
    admin: Any, broker: CountingBroker
) -> None:
    await admin.SetRateLimit(limit(per_second=10, burst=10))
    code, message = await refused(admin.SetRateLimit, service_pb2.SetRateLimitRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "limit is required" in message
    for bad in (
        limit(queue="a b", per_second=1),
        limit(queue="", per_second=1),
        limit(per_second=0),
        limit(per_second=-3),
        limit(per_second=float("inf")),
        limit(per_second=float("nan")),
        limit(per_second=5_000_000),
        limit(per_second=1, burst=-1),
        limit(per_second=1, burst=2_000_000),
    ):
        code, message = await refused(admin.SetRateLimit, bad)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert message
    assert await broker.list_rate_limits() == [RateLimit("calls", 10.0, 10)]


async def test_delete_missing_is_not_found(admin: Any) -> None:
    code, message = await refused(
        admin.DeleteRateLimit, service_pb2.DeleteRateLimitRequest(queue="calls")
    )
    assert code == grpc.StatusCode.NOT_FOUND
    assert "calls" in message
    code, _ = await refused(admin.DeleteRateLimit, service_pb2.DeleteRateLimitRequest(queue="a b"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
