"""The WebhookManager: reconcile against stored registrations, draining, leadership.

Reconciles are driven by calling :meth:`WebhookManager.reconcile` (the tick is a minute),
with a real dispatcher, endpoint, broker and nats-server (the ``rig`` of
:mod:`conveyor_testkit.fixtures`).
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import nats.errors
import pytest
from conveyor_broker import Broker, FakeClock, TaskState
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.cluster_key import generate_key
from conveyor_runtime.nats_connect import NatsClient, close_nats
from conveyor_runtime.ownership import KeyLease, open_lease_bucket
from conveyor_runtime.settings import WebhookSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.webhook_auth import verify_lease_token
from conveyor_testkit.cluster_keys import TEST_CLUSTER_KEY, cluster_auth
from conveyor_testkit.fixtures import (  # noqa: F401  (pytest fixtures)
    dispatcher_fixture,
    endpoint_fixture,
    managers_fixture,
    rig_fixture,
)
from conveyor_testkit.polling import wait_until
from conveyor_testkit.webhooks import (
    LOCAL_ENDPOINTS,
    WEBHOOK_KEY,
    Delivery,
    Endpoint,
    Managers,
    Rig,
    register,
    rpc,
)
from conveyor_webhook import ROLE, WebhookGateway, WebhookManager
from nats.errors import NoRespondersError

QUEUE = "hooks"
NAME = "billing"
memory_only = pytest.mark.parametrize("broker_dsn", ["memory"], indirect=True)
Reply = cluster_pb2.WebhookCallbackReply


async def test_pausing_stops_deliveries_and_resuming_starts_them_again(rig: Rig) -> None:
    manager, gateway = await rig.start()
    first = await rig.submit()
    await rig.wait_state(first, TaskState.COMPLETED)

    await rig.broker.set_webhook_worker_paused(NAME, True)
    await manager.reconcile()
    assert manager.gateways == {}
    await manager.settled()
    assert gateway.gateway.closed
    # Its closing registration took it out of the dispatcher's book: nothing is sent.
    await wait_until(lambda: not rig.knows(gateway))
    second = await rig.submit()
    assert await rig.state_of(second) == TaskState.PENDING

    await rig.broker.set_webhook_worker_paused(NAME, False)
    resumed = await rig.running(manager)
    assert resumed.id != gateway.id
    await rig.wait_state(second, TaskState.COMPLETED)
    assert [d.task_id for d in rig.endpoint.deliveries] == [first, second]


@memory_only
async def test_deleting_a_registration_drains_its_gateway(rig: Rig) -> None:
    manager, gateway = await rig.start()

    await rig.broker.delete_webhook_worker(NAME)
    await manager.reconcile()
    assert manager.gateways == {}
    await manager.settled()
    await wait_until(lambda: not rig.knows(gateway))


@memory_only
async def test_a_registration_without_a_secret_gets_no_gateway(
    broker: Broker, endpoint: Endpoint, managers: Managers
) -> None:
    await register(broker, endpoint.url, NAME, secrets=())
    await register(broker, endpoint.url, "paused-one", paused=True)
    await register(broker, endpoint.url, "signed")
    manager = await managers()
    await wait_until(lambda: manager.leading)
    await manager.reconcile()
    assert set(manager.gateways) == {"signed"}


@memory_only
async def test_url_timeout_and_secrets_change_in_place(rig: Rig) -> None:
    await register(rig.broker, "http://127.0.0.1:9/unused", NAME)
    manager = await rig.managers()
    gateway = await rig.running(manager)

    await rig.register(timeout=timedelta(seconds=3), secrets=("rotated", "old"))
    await manager.reconcile()
    assert manager.gateways[NAME] is gateway
    assert gateway.worker.url == rig.endpoint.url
    assert gateway.worker.timeout == timedelta(seconds=3)
    task_id = await rig.submit()
    await rig.wait_state(task_id, TaskState.COMPLETED)
    verify_lease_token(rig.endpoint.deliveries[0].token, ["rotated"])


@memory_only
async def test_changed_queues_restart_the_gateway(rig: Rig) -> None:
    manager, old = await rig.start()

    await rig.register(queues={"invoices": 1}, concurrency=2)
    new = await rig.running(manager, "invoices")
    assert new.id != old.id
    assert old.gateway.closed
    assert dict(new.gateway.spec.queues) == {"invoices": 1}
    assert new.gateway.spec.concurrency == 2
    await wait_until(lambda: not rig.knows(old))
    task_id = await rig.submit("invoices")
    await rig.wait_state(task_id, TaskState.COMPLETED)


@memory_only
async def test_changed_batch_types_restart_the_gateway_which_announces_them(rig: Rig) -> None:
    manager, old = await rig.start(batch_types=("digest.send",))
    assert old.gateway.spec.batch_types == ("digest.send",)

    await rig.register(batch_types=("report.build", "digest.send"))
    await manager.reconcile()
    await manager.settled()
    new = await rig.running(manager)
    assert new.id != old.id
    assert old.gateway.closed
    assert set(new.gateway.spec.batch_types) == {"report.build", "digest.send"}
    # The same types in another order change nothing.
    await rig.register(batch_types=("digest.send", "report.build"))
    await manager.reconcile()
    assert manager.gateways[NAME] is new


def closed(gateway: WebhookGateway) -> bool:
    return gateway.gateway.closed


def outcome(kind: service_pb2.Outcome, result: bytes = b"") -> cluster_pb2.WebhookOutcome:
    return cluster_pb2.WebhookOutcome(outcome=kind, result=result, retry_after=-1)


async def still_leased(rig: Rig, delivery: Delivery) -> bool:
    task = await rig.broker.get_task(delivery.task_id)
    return task.state == TaskState.ACTIVE and task.lease_id == delivery.lease_id


@memory_only
async def test_a_drain_waits_for_open_deliveries_and_leaves_parked_ones_running(
    rig: Rig,
) -> None:
    manager, gateway = await rig.start()
    parked = await rig.park(gateway)
    rig.endpoint.hold(rpc("success", result=b"finished during the drain"))
    running = await rig.submit()
    await wait_until(lambda: gateway.open_deliveries == 1)

    await rig.broker.set_webhook_worker_paused(NAME, True)
    await manager.reconcile()  # the drain goes on in the background
    assert manager.draining == {NAME}
    assert gateway.gateway.concurrency == 0  # takes no more work
    assert gateway.parked == 0  # the parked one is let go at once
    assert not closed(gateway)  # waiting for the open delivery
    rig.endpoint.release.set()
    await manager.settled()
    assert closed(gateway)
    assert gateway.http_closed

    task = await rig.broker.get_task(running)
    assert (task.state, task.result) == (TaskState.COMPLETED, b"finished during the drain")
    # The parked delivery was not released: its endpoint is still working on it...
    assert await still_leased(rig, parked)
    # ...and its callbacks still work while the registration is paused.
    assert manager.gateways == {}
    rig.clock.advance(timedelta(seconds=20))
    beat = await rig.callback(parked, beat=b"half")
    assert beat.status == Reply.STATUS_OK, beat.message
    assert beat.lease_expires_at == (rig.clock.now() + timedelta(seconds=30)).timestamp()
    assert (await rig.broker.get_task(parked.task_id)).progress == b"half"
    done = await rig.callback(parked, outcome=outcome(service_pb2.OUTCOME_SUCCESS, b"late"))
    assert done.status == Reply.STATUS_OK, done.message
    task = await rig.broker.get_task(parked.task_id)
    assert (task.state, task.result) == (TaskState.COMPLETED, b"late")
    again = await rig.callback(parked)
    assert again.status == Reply.STATUS_LEASE_LOST


@memory_only
async def test_a_restarted_gateway_adopts_a_parked_delivery_on_its_next_heartbeat(
    rig: Rig,
) -> None:
    manager, old = await rig.start()
    parked = await rig.park(old)

    await rig.register(concurrency=3)
    new = await rig.running(manager)
    assert new.id != old.id
    assert await still_leased(rig, parked)
    assert new.gateway.in_flight == 0

    beat = await rig.callback(parked)
    assert beat.status == Reply.STATUS_OK, beat.message
    assert (new.gateway.in_flight, new.parked) == (1, 1)
    assert new.gateway.free(QUEUE) == 2
    done = await rig.callback(parked, outcome=outcome(service_pb2.OUTCOME_SUCCESS))
    assert done.status == Reply.STATUS_OK, done.message
    assert await rig.state_of(parked.task_id) == TaskState.COMPLETED
    assert (new.gateway.in_flight, new.parked) == (0, 0)


@memory_only
async def test_a_deleted_registrations_callbacks_get_no_answer(rig: Rig) -> None:
    await register(rig.broker, rig.endpoint.url, "idle", paused=True)
    manager, gateway = await rig.start()
    parked = await rig.park(gateway)
    assert manager.answering == {NAME, "idle"}

    await rig.broker.delete_webhook_worker(NAME)
    await manager.reconcile()
    await manager.settled()
    assert manager.answering == {"idle"}
    with pytest.raises(NoRespondersError):
        await rig.callback(parked)
    assert await still_leased(rig, parked)  # the reaper takes it back at expiry


@memory_only
async def test_stopping_the_manager_leaves_parked_deliveries_leased(rig: Rig) -> None:
    first, gateway = await rig.start(manager_options={"instance_id": "first", "leader_ttl": 1.0})
    parked = await rig.park(gateway)

    await first.stop()
    assert gateway.gateway.closed
    assert gateway.http_closed
    assert await still_leased(rig, parked)
    assert first.answering == frozenset()

    # The next leader answers its callbacks (and adopts it).
    second = await rig.managers(instance_id="second", leader_ttl=1.0)
    successor = await rig.running(second)
    beat = await rig.callback(parked)
    assert beat.status == Reply.STATUS_OK, beat.message
    assert successor.parked == 1


@memory_only
async def test_a_slow_drain_does_not_hold_up_other_registrations(rig: Rig) -> None:
    slow = rig.endpoint
    async with Endpoint() as other:
        manager, gateway = await rig.start()
        slow.hold(rpc("success"))
        await rig.submit()
        await wait_until(lambda: gateway.open_deliveries == 1)
        await rig.broker.set_webhook_worker_paused(NAME, True)
        await manager.reconcile()
        assert manager.draining == {NAME}

        await register(rig.broker, other.url, "other", queues={"other": 1})
        await manager.reconcile()
        assert set(manager.gateways) == {"other"}
        assert manager.draining == {NAME}  # still waiting for its open delivery
        task_id = await rig.submit("other")
        await rig.wait_state(task_id, TaskState.COMPLETED)
        slow.release.set()
        await manager.settled()
        assert manager.draining == frozenset()


# ---------------------------------------------------------------- leadership


async def test_a_second_manager_runs_no_gateway_while_the_first_leads(rig: Rig) -> None:
    first, _ = await rig.start(manager_options={"instance_id": "first", "leader_ttl": 1.0})
    second = await rig.managers(instance_id="second", leader_ttl=1.0)

    await second.reconcile()
    assert not second.leading
    assert second.gateways == {}
    kv = await open_lease_bucket(rig.bus.nc, rig.bus.subjects.leaders_bucket, 1.0)
    assert await KeyLease(kv, ROLE, "anyone").holder() == "first"

    # The first one stops (giving the role up): the second takes over.
    await first.stop()
    assert first.gateways == {}
    await wait_until(lambda: second.leading and NAME in second.gateways)
    task_id = await rig.submit()
    await rig.wait_state(task_id, TaskState.COMPLETED)


@memory_only
async def test_losing_leadership_drains_every_gateway(rig: Rig) -> None:
    manager, gateway = await rig.start(manager_options={"leader_ttl": 3.0})
    parked = await rig.park(gateway)

    # Someone else takes the key (as after a partition): the next refresh is refused.
    kv = await open_lease_bucket(rig.bus.nc, rig.bus.subjects.leaders_bucket, 3.0)
    await kv.delete(ROLE)
    assert await KeyLease(kv, ROLE, "usurper").claim()

    await wait_until(lambda: not manager.leading and gateway.gateway.closed)
    assert manager.gateways == {}
    await wait_until(lambda: not rig.knows(gateway))
    # Not released: the parked delivery's endpoint is still working on it.
    assert await still_leased(rig, parked)
    # Only the leader answers callbacks.
    await wait_until(lambda: manager.answering == frozenset())


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
            webhook_allow_networks=LOCAL_ENDPOINTS,
            webhook_secret_key=WEBHOOK_KEY,
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


@memory_only
async def test_a_forged_callback_is_not_answered_and_the_task_stays_as_it_was(
    rig: Rig, nc: NatsClient, subjects: Subjects
) -> None:
    """A client on NATS without the cluster key (or replaying what it captured a minute
    ago) cannot complete a parked delivery that never finished: the webhook gateway does
    not act on its callback, nor answer it."""
    manager, gateway = await rig.start()
    parked = await rig.park(gateway)
    forged = cluster_pb2.WebhookCallback(
        worker=NAME, task_id=parked.task_id, lease_id=parked.lease_id, queue=QUEUE
    )
    forged.result.CopyFrom(outcome(service_pb2.OUTCOME_SUCCESS, b"never ran"))
    intruders = {
        "another key": cluster_auth(generate_key()),
        "replayed": cluster_auth(TEST_CLUSTER_KEY, now=lambda: time.time() - 60),
    }
    for how, auth in intruders.items():
        with pytest.raises(nats.errors.TimeoutError):
            await Bus(nc, subjects, auth).webhook_callback(forged, within=0.5)
        assert await still_leased(rig, parked), how
    subject = subjects.webhook_callback(NAME)
    with pytest.raises(nats.errors.TimeoutError):
        await nc.request(subject, forged.SerializeToString(), 1.0)  # unsealed
    assert manager.bus.refusals.counts["WebhookCallback"] == 3
    assert await still_leased(rig, parked)
    assert gateway.parked == 1
    # The same callback through the api's path (sealed with the cluster key) completes it.
    done = await rig.callback(parked, outcome=outcome(service_pb2.OUTCOME_SUCCESS, b"ran"))
    assert done.status == Reply.STATUS_OK, done.message
    assert await rig.state_of(parked.task_id) == TaskState.COMPLETED
