"""The WebhookManager: reconcile against stored registrations, draining, leadership.

Reconciles are driven by calling :meth:`WebhookManager.reconcile` (the tick is a minute),
with a real dispatcher, endpoint, broker and nats-server.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from conveyor_broker import Broker, FakeClock, TaskState
from conveyor_dispatcher import Dispatcher
from conveyor_runtime.nats_connect import NatsClient
from conveyor_runtime.ownership import KeyLease, open_lease_bucket
from conveyor_runtime.settings import DispatcherSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.testing import eventually
from conveyor_runtime.webhook_auth import verify_lease_token
from conveyor_webhook import ROLE, WebhookGateway
from conveyor_webhook.testing import Endpoint, Managers, register, rpc, running_gateway, submit

QUEUE = "hooks"
NAME = "billing"
memory_only = pytest.mark.parametrize("broker_dsn", ["memory"], indirect=True)


# ----------------------------------------------------------------- fixtures


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


async def state_of(broker: Broker, task_id: str) -> TaskState:
    return (await broker.get_task(task_id)).state


async def wait_state(broker: Broker, task_id: str, state: TaskState) -> None:
    async def reached() -> bool:
        return await state_of(broker, task_id) == state

    await eventually(reached)


def closed(gateway: WebhookGateway) -> bool:
    return gateway.gateway.closed


def forgotten(dispatcher: Dispatcher, gateway_id: str, queue: str = QUEUE) -> bool:
    qd = dispatcher.queue(queue)
    return qd is None or gateway_id not in qd.book


async def test_pausing_stops_deliveries_and_resuming_starts_them_again(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    await register(broker, endpoint.url, NAME)
    manager = await managers()
    gateway = await running_gateway(manager, dispatcher, NAME, QUEUE)
    first = await submit(broker, nc, subjects, QUEUE)
    await wait_state(broker, first, TaskState.COMPLETED)

    await broker.set_webhook_worker_paused(NAME, True)
    await manager.reconcile()
    assert manager.gateways == {}
    await manager.settled()
    assert gateway.gateway.closed
    # Its closing registration took it out of the dispatcher's book: nothing is sent.
    await eventually(lambda: forgotten(dispatcher, gateway.id))
    second = await submit(broker, nc, subjects, QUEUE)
    assert await state_of(broker, second) == TaskState.PENDING

    await broker.set_webhook_worker_paused(NAME, False)
    resumed = await running_gateway(manager, dispatcher, NAME, QUEUE)
    assert resumed.id != gateway.id
    await wait_state(broker, second, TaskState.COMPLETED)
    assert [d.task_id for d in endpoint.deliveries] == [first, second]


@memory_only
async def test_deleting_a_registration_drains_its_gateway(
    broker: Broker,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    await register(broker, endpoint.url, NAME)
    manager = await managers()
    gateway = await running_gateway(manager, dispatcher, NAME, QUEUE)

    await broker.delete_webhook_worker(NAME)
    await manager.reconcile()
    assert manager.gateways == {}
    await manager.settled()
    await eventually(lambda: forgotten(dispatcher, gateway.id))


@memory_only
async def test_a_registration_without_a_secret_gets_no_gateway(
    broker: Broker, endpoint: Endpoint, managers: Managers
) -> None:
    await register(broker, endpoint.url, NAME, secrets=())
    await register(broker, endpoint.url, "paused-one", paused=True)
    await register(broker, endpoint.url, "signed")
    manager = await managers()
    await eventually(lambda: manager.leading)
    await manager.reconcile()
    assert set(manager.gateways) == {"signed"}


@memory_only
async def test_url_timeout_and_secrets_change_in_place(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    await register(broker, "http://127.0.0.1:9/unused", NAME)
    manager = await managers()
    gateway = await running_gateway(manager, dispatcher, NAME, QUEUE)

    await register(
        broker, endpoint.url, NAME, timeout=timedelta(seconds=3), secrets=("rotated", "old")
    )
    await manager.reconcile()
    assert manager.gateways[NAME] is gateway
    assert gateway.worker.url == endpoint.url
    assert gateway.worker.timeout == timedelta(seconds=3)
    task_id = await submit(broker, nc, subjects, QUEUE)
    await wait_state(broker, task_id, TaskState.COMPLETED)
    verify_lease_token(endpoint.deliveries[0].token, ["rotated"])


@memory_only
async def test_changed_queues_restart_the_gateway(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    await register(broker, endpoint.url, NAME)
    manager = await managers()
    old = await running_gateway(manager, dispatcher, NAME, QUEUE)

    await register(broker, endpoint.url, NAME, queues={"invoices": 1}, concurrency=2)
    new = await running_gateway(manager, dispatcher, NAME, "invoices")
    assert new.id != old.id
    assert old.gateway.closed
    assert dict(new.gateway.spec.queues) == {"invoices": 1}
    assert new.gateway.spec.concurrency == 2
    await eventually(lambda: forgotten(dispatcher, old.id))
    task_id = await submit(broker, nc, subjects, "invoices")
    await wait_state(broker, task_id, TaskState.COMPLETED)


@memory_only
async def test_a_drain_waits_for_open_deliveries_and_releases_parked_ones(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    await register(broker, endpoint.url, NAME)
    manager = await managers()
    gateway = await running_gateway(manager, dispatcher, NAME, QUEUE)
    endpoint.answer = rpc("accepted")
    parked = await submit(broker, nc, subjects, QUEUE)
    await eventually(lambda: gateway.parked == 1)
    endpoint.hold(rpc("success", result=b"finished during the drain"))
    running = await submit(broker, nc, subjects, QUEUE)
    await eventually(lambda: gateway.open_deliveries == 1)

    await broker.set_webhook_worker_paused(NAME, True)
    await manager.reconcile()  # the drain goes on in the background
    assert manager.draining == {NAME}
    await eventually(lambda: gateway.gateway.concurrency == 0)  # takes no more work
    assert not closed(gateway)  # waiting for the open delivery
    endpoint.release.set()
    await manager.settled()
    assert closed(gateway)

    task = await broker.get_task(running)
    assert (task.state, task.result) == (TaskState.COMPLETED, b"finished during the drain")
    assert await state_of(broker, parked) == TaskState.PENDING  # released


@memory_only
async def test_a_slow_drain_does_not_hold_up_other_registrations(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    async with Endpoint() as slow, Endpoint() as other:
        await register(broker, slow.url, NAME)
        manager = await managers()
        gateway = await running_gateway(manager, dispatcher, NAME, QUEUE)
        slow.hold(rpc("success"))
        await submit(broker, nc, subjects, QUEUE)
        await eventually(lambda: gateway.open_deliveries == 1)
        await broker.set_webhook_worker_paused(NAME, True)
        await manager.reconcile()
        assert manager.draining == {NAME}

        await register(broker, other.url, "other", queues={"other": 1})
        await manager.reconcile()
        assert set(manager.gateways) == {"other"}
        assert manager.draining == {NAME}  # still waiting for its open delivery
        task_id = await submit(broker, nc, subjects, "other")
        await wait_state(broker, task_id, TaskState.COMPLETED)
        slow.release.set()
        await manager.settled()
        assert manager.draining == frozenset()


# ---------------------------------------------------------------- leadership


async def test_a_second_manager_runs_no_gateway_while_the_first_leads(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    await register(broker, endpoint.url, NAME)
    first = await managers(instance_id="first", leader_ttl=1.0)
    await running_gateway(first, dispatcher, NAME, QUEUE)
    second = await managers(instance_id="second", leader_ttl=1.0)

    await second.reconcile()
    assert not second.leading
    assert second.gateways == {}
    kv = await open_lease_bucket(nc, subjects.leaders_bucket, 1.0)
    assert await KeyLease(kv, ROLE, "anyone").holder() == "first"

    # The first one stops (giving the role up): the second takes over.
    await first.stop()
    assert first.gateways == {}
    await eventually(lambda: second.leading and NAME in second.gateways)
    task_id = await submit(broker, nc, subjects, QUEUE)
    await wait_state(broker, task_id, TaskState.COMPLETED)


@memory_only
async def test_losing_leadership_drains_every_gateway(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    await register(broker, endpoint.url, NAME)
    manager = await managers(leader_ttl=3.0)
    gateway = await running_gateway(manager, dispatcher, NAME, QUEUE)

    # Someone else takes the key (as after a partition): the next refresh is refused.
    kv = await open_lease_bucket(nc, subjects.leaders_bucket, 3.0)
    await kv.delete(ROLE)
    assert await KeyLease(kv, ROLE, "usurper").claim()

    await eventually(lambda: not manager.leading and gateway.gateway.closed)
    assert manager.gateways == {}
    await eventually(lambda: forgotten(dispatcher, gateway.id))
