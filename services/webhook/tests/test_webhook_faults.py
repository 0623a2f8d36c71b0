"""A webhook gateway when its broker fails: callbacks are still answered at once, and a
failed lease extension at park time keeps the latest expiry the gateway knows.

The broker is a MemoryBroker that raises on the calls a test names (a real broker
otherwise), with a real dispatcher, endpoint and nats-server.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from conveyor_broker import Broker, FakeClock, Task, TaskState
from conveyor_broker.memory import MemoryBroker
from conveyor_dispatcher import Dispatcher
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime.nats_connect import NatsClient
from conveyor_runtime.settings import DispatcherSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.testing import eventually
from conveyor_webhook.testing import (
    Endpoint,
    Managers,
    register,
    rpc,
    running_gateway,
    send_callback,
    submit,
)

QUEUE = "hooks"
NAME = "billing"
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


@pytest.fixture
async def endpoint() -> AsyncIterator[Endpoint]:
    """A real HTTP endpoint on a free local port."""
    async with Endpoint() as ep:
        yield ep


@pytest.fixture
async def dispatcher(
    broker: Broker, nc: NatsClient, clock: FakeClock, subjects: Subjects, nats_url: str
) -> AsyncIterator[Dispatcher]:
    """A real dispatcher, in this process."""
    settings = DispatcherSettings(
        nats_url=nats_url,
        subject_prefix=subjects.prefix,
        broker="memory",
        instance_id=f"disp-{uuid.uuid4().hex[:6]}",
        owner_ttl=2.0,
        register_tick=5.0,
    )
    d = Dispatcher(settings, broker, nc, clock)
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


@pytest.fixture
async def managers(
    broker: Broker, nc: NatsClient, clock: FakeClock, subjects: Subjects, nats_url: str
) -> AsyncIterator[Managers]:
    """Start WebhookManagers (settings overrides as keywords); each is stopped after."""
    async with Managers(broker, nc, clock, nats_url, subjects) as make:
        yield make


def outcome(kind: service_pb2.Outcome) -> cluster_pb2.WebhookOutcome:
    return cluster_pb2.WebhookOutcome(outcome=kind, retry_after=-1)


async def test_a_broker_failure_during_a_callback_is_answered_at_once(
    broker: FlakyBroker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.answer = rpc("accepted")
    await register(broker, endpoint.url, NAME)
    gateway = await running_gateway(await managers(), dispatcher, NAME, QUEUE)
    task_id = await submit(broker, nc, subjects, QUEUE)
    await eventually(lambda: gateway.parked == 1)
    (delivery,) = endpoint.deliveries

    async def call(lease_id: str, **kind: Any) -> cluster_pb2.WebhookCallbackReply:
        # Well within the api's 5 s: a reply, not silence.
        async with asyncio.timeout(1.0):
            return await send_callback(
                nc, subjects, NAME, task_id=task_id, lease_id=lease_id, queue=QUEUE, **kind
            )

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
    broker: FlakyBroker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.hold(rpc("accepted"))
    await register(broker, endpoint.url, NAME)
    gateway = await running_gateway(await managers(), dispatcher, NAME, QUEUE)
    task_id = await submit(broker, nc, subjects, QUEUE)
    await eventually(lambda: gateway.open_deliveries == 1)
    (delivery,) = endpoint.deliveries
    dispatched = (await broker.get_task(task_id)).lease_expires_at
    assert dispatched is not None

    # The gateway's own heartbeat extends the open delivery's lease...
    clock.advance(timedelta(seconds=10))
    gateway.gateway.on_frame(service_pb2.WorkerFrame(heartbeat=service_pb2.Heartbeat()))
    beaten = dispatched + timedelta(seconds=10)

    async def extended() -> bool:
        return (await broker.get_task(task_id)).lease_expires_at == beaten

    await eventually(extended)
    # ...then the endpoint accepts while the single-lease extension fails.
    broker.failing.add("extend_lease")
    endpoint.release.set()
    await eventually(lambda: gateway.parked == 1)

    assert gateway.parked_until(delivery.lease_id) == beaten
    clock.advance(timedelta(seconds=25))  # past the dispatch's expiry, not the heartbeat's
    assert await gateway.sweep_lapsed() == 0
    assert gateway.parked == 1
    assert (await broker.get_task(task_id)).state == TaskState.ACTIVE
