"""The WebhookManager: reconcile against stored registrations, draining, leadership.

Reconciles are driven by calling :meth:`WebhookManager.reconcile` (the tick is a minute),
with a real dispatcher, endpoint, broker and nats-server.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from conveyor_broker import Broker, FakeClock, TaskState
from conveyor_dispatcher import Dispatcher
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime.nats_connect import NatsClient, close_nats
from conveyor_runtime.ownership import KeyLease, open_lease_bucket
from conveyor_runtime.settings import DispatcherSettings, WebhookSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.testing import eventually
from conveyor_runtime.webhook_auth import verify_lease_token
from conveyor_webhook import ROLE, WebhookGateway, WebhookManager
from conveyor_webhook.testing import (
    Delivery,
    Endpoint,
    Managers,
    register,
    rpc,
    running_gateway,
    send_callback,
    submit,
)
from nats.errors import NoRespondersError

QUEUE = "hooks"
NAME = "billing"
memory_only = pytest.mark.parametrize("broker_dsn", ["memory"], indirect=True)
Reply = cluster_pb2.WebhookCallbackReply


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


def outcome(kind: service_pb2.Outcome, result: bytes = b"") -> cluster_pb2.WebhookOutcome:
    return cluster_pb2.WebhookOutcome(outcome=kind, result=result, retry_after=-1)


async def hook_callback(
    nc: NatsClient, subjects: Subjects, delivery: Delivery, **kind: Any
) -> cluster_pb2.WebhookCallbackReply:
    """A callback of ``delivery`` as the api routes it (a heartbeat unless ``outcome``)."""
    return await send_callback(
        nc,
        subjects,
        NAME,
        task_id=delivery.task_id,
        lease_id=delivery.lease_id,
        queue=delivery.call["params"]["queue"],
        **kind,
    )


async def park_one(
    broker: Broker, nc: NatsClient, subjects: Subjects, endpoint: Endpoint, gateway: WebhookGateway
) -> Delivery:
    """Submit a task the endpoint accepts; its delivery once parked."""
    answer = endpoint.answer
    endpoint.answer = rpc("accepted")
    task_id = await submit(broker, nc, subjects, QUEUE)
    await eventually(lambda: gateway.parked == 1)
    endpoint.answer = answer
    [delivery] = [d for d in endpoint.deliveries if d.task_id == task_id]
    return delivery


async def still_leased(broker: Broker, delivery: Delivery) -> bool:
    task = await broker.get_task(delivery.task_id)
    return task.state == TaskState.ACTIVE and task.lease_id == delivery.lease_id


@memory_only
async def test_a_drain_waits_for_open_deliveries_and_leaves_parked_ones_running(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    await register(broker, endpoint.url, NAME)
    manager = await managers()
    gateway = await running_gateway(manager, dispatcher, NAME, QUEUE)
    parked = await park_one(broker, nc, subjects, endpoint, gateway)
    endpoint.hold(rpc("success", result=b"finished during the drain"))
    running = await submit(broker, nc, subjects, QUEUE)
    await eventually(lambda: gateway.open_deliveries == 1)

    await broker.set_webhook_worker_paused(NAME, True)
    await manager.reconcile()  # the drain goes on in the background
    assert manager.draining == {NAME}
    assert gateway.gateway.concurrency == 0  # takes no more work
    assert gateway.parked == 0  # the parked one is let go at once
    assert not closed(gateway)  # waiting for the open delivery
    endpoint.release.set()
    await manager.settled()
    assert closed(gateway)
    assert gateway.http_closed

    task = await broker.get_task(running)
    assert (task.state, task.result) == (TaskState.COMPLETED, b"finished during the drain")
    # The parked delivery was not released: its endpoint is still working on it...
    assert await still_leased(broker, parked)
    # ...and its callbacks still work while the registration is paused.
    assert manager.gateways == {}
    clock.advance(timedelta(seconds=20))
    beat = await hook_callback(nc, subjects, parked, beat=b"half")
    assert beat.status == Reply.STATUS_OK, beat.message
    assert beat.lease_expires_at == (clock.now() + timedelta(seconds=30)).timestamp()
    assert (await broker.get_task(parked.task_id)).progress == b"half"
    done = await hook_callback(
        nc, subjects, parked, outcome=outcome(service_pb2.OUTCOME_SUCCESS, b"late")
    )
    assert done.status == Reply.STATUS_OK, done.message
    task = await broker.get_task(parked.task_id)
    assert (task.state, task.result) == (TaskState.COMPLETED, b"late")
    again = await hook_callback(nc, subjects, parked)
    assert again.status == Reply.STATUS_LEASE_LOST


@memory_only
async def test_a_restarted_gateway_adopts_a_parked_delivery_on_its_next_heartbeat(
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
    parked = await park_one(broker, nc, subjects, endpoint, old)

    await register(broker, endpoint.url, NAME, concurrency=3)
    new = await running_gateway(manager, dispatcher, NAME, QUEUE)
    assert new.id != old.id
    assert await still_leased(broker, parked)
    assert new.gateway.in_flight == 0

    beat = await hook_callback(nc, subjects, parked)
    assert beat.status == Reply.STATUS_OK, beat.message
    assert (new.gateway.in_flight, new.parked) == (1, 1)
    assert new.gateway.free(QUEUE) == 2
    done = await hook_callback(nc, subjects, parked, outcome=outcome(service_pb2.OUTCOME_SUCCESS))
    assert done.status == Reply.STATUS_OK, done.message
    assert await state_of(broker, parked.task_id) == TaskState.COMPLETED
    assert (new.gateway.in_flight, new.parked) == (0, 0)


@memory_only
async def test_a_deleted_registrations_callbacks_get_no_answer(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    await register(broker, endpoint.url, NAME)
    await register(broker, endpoint.url, "idle", paused=True)
    manager = await managers()
    gateway = await running_gateway(manager, dispatcher, NAME, QUEUE)
    parked = await park_one(broker, nc, subjects, endpoint, gateway)
    assert manager.answering == {NAME, "idle"}

    await broker.delete_webhook_worker(NAME)
    await manager.reconcile()
    await manager.settled()
    assert manager.answering == {"idle"}
    with pytest.raises(NoRespondersError):
        await hook_callback(nc, subjects, parked)
    assert await still_leased(broker, parked)  # the reaper takes it back at expiry


@memory_only
async def test_stopping_the_manager_leaves_parked_deliveries_leased(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    await register(broker, endpoint.url, NAME)
    first = await managers(instance_id="first", leader_ttl=1.0)
    gateway = await running_gateway(first, dispatcher, NAME, QUEUE)
    parked = await park_one(broker, nc, subjects, endpoint, gateway)

    await first.stop()
    assert gateway.gateway.closed
    assert gateway.http_closed
    assert await still_leased(broker, parked)
    assert first.answering == frozenset()

    # The next leader answers its callbacks (and adopts it).
    second = await managers(instance_id="second", leader_ttl=1.0)
    successor = await running_gateway(second, dispatcher, NAME, QUEUE)
    beat = await hook_callback(nc, subjects, parked)
    assert beat.status == Reply.STATUS_OK, beat.message
    assert successor.parked == 1


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
    parked = await park_one(broker, nc, subjects, endpoint, gateway)

    # Someone else takes the key (as after a partition): the next refresh is refused.
    kv = await open_lease_bucket(nc, subjects.leaders_bucket, 3.0)
    await kv.delete(ROLE)
    assert await KeyLease(kv, ROLE, "usurper").claim()

    await eventually(lambda: not manager.leading and gateway.gateway.closed)
    assert manager.gateways == {}
    await eventually(lambda: forgotten(dispatcher, gateway.id))
    # Not released: the parked delivery's endpoint is still working on it.
    assert await still_leased(broker, parked)
    # Only the leader answers callbacks.
    await eventually(lambda: manager.answering == frozenset())


class GatedNats(NatsClient):
    """A real NATS client that records every subject it subscribes to, and whose first
    ``flush`` after a subscription to a subject starting with ``gate`` waits until it is
    canceled."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.subscribed: list[str] = []
        self.held = asyncio.Event()
        self._gate = gate

    async def subscribe(self, subject: str, *args: Any, **kwargs: Any) -> Any:
        self.subscribed.append(subject)
        return await super().subscribe(subject, *args, **kwargs)

    async def flush(self, *args: Any, **kwargs: Any) -> None:
        if not self.held.is_set() and any(s.startswith(self._gate) for s in self.subscribed):
            self.held.set()
            await asyncio.Event().wait()  # until canceled
        await super().flush(*args, **kwargs)


@memory_only
async def test_stopping_while_a_gateway_starts_drains_the_half_started_gateway(
    broker: Broker,
    nc: NatsClient,
    clock: FakeClock,
    subjects: Subjects,
    nats_url: str,
    endpoint: Endpoint,
) -> None:
    await register(broker, endpoint.url, NAME)
    gated = GatedNats(gate=f"{subjects.prefix}.gw.wh-")
    await gated.connect(servers=[nats_url])
    try:
        settings = WebhookSettings(
            nats_url=nats_url,
            subject_prefix=subjects.prefix,
            broker="memory",
            instance_id="gated",
            leader_ttl=2.0,
            reconcile_tick=60.0,
        )
        manager = WebhookManager(settings, broker, gated, clock)
        # The gateway's start waits on its flush (after it subscribed to its dispatch
        # subject) when the manager is stopped.
        await manager.start()
        await asyncio.wait_for(gated.held.wait(), timeout=10)
        [dispatch] = [s for s in gated.subscribed if s.startswith(f"{subjects.prefix}.gw.wh-")]

        await manager.stop()
        assert manager.gateways == {}
        with pytest.raises(NoRespondersError):
            await nc.request(dispatch, cluster_pb2.DispatchRequest().SerializeToString(), 1.0)
    finally:
        await close_nats(gated)
