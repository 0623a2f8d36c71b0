"""AdminService circuit-breaker RPCs over a real gRPC socket: configs set, listed and
deleted, the Control that tells the queue's owner, the breakers that are not closed in
ListBreakers and the queue stats, and clear errors for bad input with nothing stored
lost."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import grpc
import pytest
from conveyor_broker import (
    Breaker,
    BreakerConfig,
    BreakerScope,
    BreakerStatus,
    FakeClock,
    NewTask,
)
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime import wire
from conveyor_runtime.bus import Bus
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.stream import Recorder, refused
from google.protobuf.duration_pb2 import Duration

MINUTE = Duration(seconds=60)
HALF_MINUTE = Duration(seconds=30)


def config(**fields: Any) -> service_pb2.SetBreakerConfigRequest:
    fields.setdefault("queue", "calls")
    fields.setdefault("failures", 5)
    fields.setdefault("window", MINUTE)
    fields.setdefault("cooldown", HALF_MINUTE)
    return service_pb2.SetBreakerConfigRequest(config=service_pb2.BreakerConfig(**fields))


def described(c: service_pb2.BreakerConfig) -> tuple[Any, ...]:
    return (
        c.queue,
        c.pattern,
        c.failures,
        c.window.ToTimedelta(),
        c.cooldown.ToTimedelta(),
        c.scope,
    )


async def test_set_list_and_delete_tell_the_owner(
    admin: Any, broker: CountingBroker, bus: Bus
) -> None:
    controls = await Recorder(cluster_pb2.Control).start(bus, queue="calls")
    set_ = await admin.SetBreakerConfig(config())
    # An empty pattern is "*", scope UNSPECIFIED is WORKER.
    assert described(set_.config) == (
        "calls",
        "*",
        5,
        timedelta(seconds=60),
        timedelta(seconds=30),
        service_pb2.BREAKER_SCOPE_WORKER,
    )
    await controls.wait_for(lambda m: m.reason == "breakers")
    await admin.SetBreakerConfig(
        config(
            pattern="pay.*",
            failures=2,
            window=Duration(seconds=10),
            cooldown=Duration(nanos=250_000_000),
            scope=service_pb2.BREAKER_SCOPE_QUEUE,
        )
    )
    await admin.SetBreakerConfig(config(queue="other", failures=1))
    assert await broker.list_breaker_configs("calls") == [
        BreakerConfig("calls", "*", 5, timedelta(seconds=60), timedelta(seconds=30)),
        BreakerConfig(
            "calls",
            "pay.*",
            2,
            timedelta(seconds=10),
            timedelta(milliseconds=250),
            BreakerScope.QUEUE,
        ),
    ]
    listed = await admin.ListBreakerConfigs(service_pb2.ListBreakerConfigsRequest())
    assert [(c.queue, c.pattern, c.failures, c.scope) for c in listed.configs] == [
        ("calls", "*", 5, service_pb2.BREAKER_SCOPE_WORKER),
        ("calls", "pay.*", 2, service_pb2.BREAKER_SCOPE_QUEUE),
        ("other", "*", 1, service_pb2.BREAKER_SCOPE_WORKER),
    ]
    one = await admin.ListBreakerConfigs(service_pb2.ListBreakerConfigsRequest(queue="other"))
    assert [c.queue for c in one.configs] == ["other"]

    controls.messages.clear()
    await admin.DeleteBreakerConfig(service_pb2.DeleteBreakerConfigRequest(queue="calls"))
    await controls.wait_for(lambda m: m.reason == "breakers")
    await admin.DeleteBreakerConfig(
        service_pb2.DeleteBreakerConfigRequest(queue="calls", pattern="pay.*")
    )
    assert [c.queue for c in await broker.list_breaker_configs()] == ["other"]


async def test_bad_input_is_invalid_argument_and_keeps_the_stored_configs(
    admin: Any, broker: CountingBroker, bus: Bus
) -> None:
    await admin.SetBreakerConfig(config(failures=4))
    stored = await broker.list_breaker_configs()
    controls = await Recorder(cluster_pb2.Control).start(bus)
    code, message = await refused(admin.SetBreakerConfig, service_pb2.SetBreakerConfigRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "config is required" in message
    for bad, says in (
        (config(queue="a b"), "queue"),
        (config(queue=""), "queue"),
        (config(failures=0), "failures"),
        (config(failures=-3), "failures"),
        (config(failures=10_001), "failures"),
        (config(window=None), "window is required"),
        (config(cooldown=None), "cooldown is required"),
        (config(window=Duration(nanos=500_000_000)), "window"),
        (config(window=Duration(seconds=2 * 86_400)), "window"),
        (config(window=Duration(seconds=-60)), "window"),
        (config(window=Duration(seconds=10**14)), "window"),
        (config(cooldown=Duration(nanos=50_000_000)), "cooldown"),
        (config(cooldown=Duration(seconds=86_401)), "cooldown"),
        (config(pattern="x" * 300), "pattern"),
        (config(pattern="a\x01"), "pattern"),
        (config(scope=9), "scope"),
    ):
        code, message = await refused(admin.SetBreakerConfig, bad)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert says in message, (bad, message)
    assert await broker.list_breaker_configs() == stored
    # No refused call told any owner to reload: the first Control is the next good set's.
    await admin.SetBreakerConfig(config(queue="after"))
    [first, *_] = await controls.wait_for(lambda m: m.reason == "breakers")
    assert first.queue == "after"


async def test_delete_missing_is_not_found(admin: Any) -> None:
    code, message = await refused(
        admin.DeleteBreakerConfig,
        service_pb2.DeleteBreakerConfigRequest(queue="calls", pattern="pay.*"),
    )
    assert code == grpc.StatusCode.NOT_FOUND
    assert "pay.*" in message
    assert "calls" in message
    for bad in (
        service_pb2.DeleteBreakerConfigRequest(queue="a b"),
        service_pb2.DeleteBreakerConfigRequest(queue="calls", pattern="x" * 300),
    ):
        code, _ = await refused(admin.DeleteBreakerConfig, bad)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = await refused(
        admin.ListBreakerConfigs, service_pb2.ListBreakerConfigsRequest(queue="a b")
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = await refused(admin.ListBreakers, service_pb2.ListBreakersRequest(queue="a b"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def put_breakers(broker: CountingBroker, clock: FakeClock) -> list[Breaker]:
    now = clock.now()
    breakers = [
        Breaker(
            queue="calls",
            type="pay.charge",
            status=BreakerStatus.OPEN,
            opened_at=now,
            until=now + timedelta(seconds=30),
            failures=5,
            gateway="gw-1",
            worker_id="worker-1",
        ),
        Breaker(
            queue="calls",
            type="pay.refund",
            status=BreakerStatus.HALF_OPEN,
            opened_at=now - timedelta(seconds=40),
            until=now + timedelta(seconds=5),
            failures=3,
        ),
        Breaker(
            queue="mail",
            type="mail.send",
            status=BreakerStatus.OPEN,
            opened_at=now,
            until=now + timedelta(seconds=60),
            failures=2,
            gateway="gw-2",
            worker_id="worker-2",
        ),
    ]
    for breaker in breakers:
        await broker.put_breaker(breaker)
    return breakers


async def test_list_breakers_shows_the_ones_not_closed(
    admin: Any, broker: CountingBroker, clock: FakeClock
) -> None:
    assert list((await admin.ListBreakers(service_pb2.ListBreakersRequest())).breakers) == []
    breakers = await put_breakers(broker, clock)
    every = await admin.ListBreakers(service_pb2.ListBreakersRequest())
    assert list(every.breakers) == [wire.breaker_to_proto(b) for b in breakers]
    charge, refund, _ = every.breakers
    assert (charge.scope, charge.gateway, charge.worker_id, charge.state, charge.failures) == (
        service_pb2.BREAKER_SCOPE_WORKER,
        "gw-1",
        "worker-1",
        "open",
        5,
    )
    assert wire.from_timestamp(charge.until) == clock.now() + timedelta(seconds=30)
    assert (refund.scope, refund.gateway, refund.state) == (
        service_pb2.BREAKER_SCOPE_QUEUE,
        "",
        "half_open",
    )
    mail = await admin.ListBreakers(service_pb2.ListBreakersRequest(queue="mail"))
    assert [b.type for b in mail.breakers] == ["mail.send"]


async def test_queue_stats_carry_the_queues_breakers(
    admin: Any, broker: CountingBroker, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    for queue in ("calls", "mail", "quiet"):
        await broker.enqueue(NewTask(queue=queue, type="job"))
    await put_breakers(broker, clock)
    asked: list[str | None] = []
    list_breakers = broker.list_breakers

    async def counting(queue: str | None = None) -> list[Breaker]:
        asked.append(queue)
        return await list_breakers(queue)

    monkeypatch.setattr(broker, "list_breakers", counting)

    stats = (await admin.GetQueueStats(service_pb2.GetQueueStatsRequest(queue="calls"))).stats
    assert [(b.type, b.state) for b in stats.breakers] == [
        ("pay.charge", "open"),
        ("pay.refund", "half_open"),
    ]
    assert stats.counts["pending"] == 1
    quiet = (await admin.GetQueueStats(service_pb2.GetQueueStatsRequest(queue="quiet"))).stats
    assert list(quiet.breakers) == []
    assert asked == ["calls", "quiet"]

    asked.clear()
    page = await admin.ListQueues(service_pb2.ListQueuesRequest())
    assert {q.queue: [b.type for b in q.breakers] for q in page.queues} == {
        "calls": ["pay.charge", "pay.refund"],
        "mail": ["mail.send"],
        "quiet": [],
    }
    assert asked == [None]  # one query for the page, not one per queue
    asked.clear()
    first = await admin.ListQueues(service_pb2.ListQueuesRequest(limit=1))
    assert [q.queue for q in first.queues] == ["calls"]
    assert [b.type for b in first.queues[0].breakers] == ["pay.charge", "pay.refund"]
    assert asked == [None]
