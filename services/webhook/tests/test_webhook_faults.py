"""A webhook gateway when its broker fails: callbacks are still answered at once, and a
failed lease extension at park time keeps the latest expiry the gateway knows.

The broker is a MemoryBroker that raises on the calls a test names (a real broker
otherwise), with a real dispatcher, endpoint and nats-server (the ``rig`` of
:mod:`conveyor_testkit.fixtures`, on that broker).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from conveyor_broker import FakeClock, Task, TaskState
from conveyor_broker.memory import MemoryBroker
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_testkit.fixtures import (  # noqa: F401  (pytest fixtures)
    dispatcher_fixture,
    endpoint_fixture,
    managers_fixture,
    rig_fixture,
)
from conveyor_testkit.polling import wait_until
from conveyor_testkit.webhooks import Rig, rpc

Reply = cluster_pb2.WebhookCallbackReply


class BrokerDown(Exception):
    """What a failing broker call raises."""


class FlakyBroker(MemoryBroker):
    """A MemoryBroker whose methods named in ``failing`` raise BrokerDown."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.failing: set[str] = set()

    def _check(self, name: str) -> None:
        if name in self.failing:
            raise BrokerDown(f"{name}: connection refused")

    async def extend_lease(self, task_id: str, lease_id: str, ttl: timedelta) -> datetime:
        self._check("extend_lease")
        return await super().extend_lease(task_id, lease_id, ttl)

    async def get_task(self, task_id: str) -> Task:
        self._check("get_task")
        return await super().get_task(task_id)

    async def ack_batch(self, items: Any) -> list[bool]:
        self._check("ack_batch")
        return await super().ack_batch(items)


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[FlakyBroker]:
    """Overrides the root fixture: a memory broker that fails on demand."""
    b = FlakyBroker(clock)
    try:
        yield b
    finally:
        await b.close()


def outcome(kind: service_pb2.Outcome) -> cluster_pb2.WebhookOutcome:
    return cluster_pb2.WebhookOutcome(outcome=kind, retry_after=-1)


async def test_a_broker_failure_during_a_callback_is_answered_at_once(
    broker: FlakyBroker, rig: Rig
) -> None:
    _, delivery = await rig.accepted_delivery()
    task_id = delivery.task_id

    async def call(lease_id: str, **kind: Any) -> cluster_pb2.WebhookCallbackReply:
        # Well within the api's 5 s: a reply, not silence.
        async with asyncio.timeout(1.0):
            return await rig.callback(delivery, lease_id=lease_id, **kind)

    broker.failing |= {"extend_lease", "get_task", "ack_batch"}
    beat = await call(delivery.lease_id)
    assert (beat.status, beat.message) == (Reply.STATUS_INVALID, "broker unavailable: retry")
    # A lease this gateway does not hold needs the broker too.
    stranger = await call("01HZZZZZZZZZZZZZZZZZZZZZZB")
    assert (stranger.status, stranger.message) == (
        Reply.STATUS_INVALID,
        "broker unavailable: retry",
    )
    result = await call(delivery.lease_id, outcome=outcome(service_pb2.OUTCOME_SUCCESS))
    assert (result.status, result.message) == (Reply.STATUS_INVALID, "broker unavailable: retry")

    broker.failing.clear()
    # The endpoint retries: it works once the broker is back.
    beat = await call(delivery.lease_id)
    assert beat.status == Reply.STATUS_OK
    done = await call(delivery.lease_id, outcome=outcome(service_pb2.OUTCOME_SUCCESS))
    assert done.status == Reply.STATUS_OK
    assert (await broker.get_task(task_id)).state == TaskState.COMPLETED


async def test_a_failed_extension_at_park_time_keeps_the_latest_known_expiry(
    broker: FlakyBroker, clock: FakeClock, rig: Rig
) -> None:
    rig.endpoint.hold(rpc("accepted"))
    gateway = await rig.start_gateway()
    task_id = await rig.submit()
    # Open, and arrived (the request is sent a moment after the delivery opens).
    await wait_until(lambda: gateway.open_deliveries == 1 and len(rig.endpoint.deliveries) == 1)
    (delivery,) = rig.endpoint.deliveries
    dispatched = (await broker.get_task(task_id)).lease_expires_at
    assert dispatched is not None

    # The gateway's own heartbeat extends the open delivery's lease...
    clock.advance(timedelta(seconds=10))
    gateway.gateway.on_heartbeat()
    beaten = dispatched + timedelta(seconds=10)
    await rig.wait_lease(task_id, beaten)
    # ...then the endpoint accepts while the single-lease extension fails.
    broker.failing.add("extend_lease")
    rig.endpoint.release.set()
    await wait_until(lambda: gateway.parked == 1)

    assert gateway.parked_until(delivery.lease_id) == beaten
    clock.advance(timedelta(seconds=25))  # past the dispatch's expiry, not the heartbeat's
    assert await gateway.sweep_lapsed() == 0
    assert gateway.parked == 1
    assert (await broker.get_task(task_id)).state == TaskState.ACTIVE
