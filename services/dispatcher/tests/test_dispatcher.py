"""The Dispatcher against a real nats-server and a real broker, with fake gateways.

A FakeGateway speaks the gateway side of the NATS contract: it registers, answers
DispatchRequests (accepting as many as its policy says), re-registers on owner_changed
and on a roll call, and publishes Done. It answers dispatch requests on the raw
connection, because it must be able to misbehave as no Bus user can (never answer,
publish a Done before its reply). Brokers run on a FakeClock, so leases never expire by themselves:
a task that goes back to PENDING was released on purpose.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from functools import partial
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from conveyor_broker.clock import FakeClock, SystemClock
from conveyor_broker.interface import Broker
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.postgres import PostgresBroker, migrate
from conveyor_broker.types import (
    Breaker,
    BreakerStatus,
    NewTask,
    RateLimit,
    TaskListParams,
    TaskState,
)
from conveyor_dispatcher import Dispatcher
from conveyor_dispatcher.peers import PeerWatch
from conveyor_dispatcher.queue import QueueDispatcher
from conveyor_protos.v1 import cluster_pb2, task_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.embedded_nats import EmbeddedNats
from conveyor_runtime.nats_connect import NatsClient, close_nats, connect_nats
from conveyor_runtime.ownership import KeyLease, open_lease_bucket
from conveyor_runtime.settings import DispatcherSettings
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.cluster_keys import cluster_auth
from conveyor_testkit.polling import wait_until
from conveyor_testkit.proxy import WedgeProxy
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

TIMEOUT = 10.0
QUEUE = "emails"


class FakeGateway:
    """The gateway side of the dispatcher contract, for one queue."""

    def __init__(
        self,
        nc: NatsClient,
        subjects: Subjects,
        *,
        queue: str = QUEUE,
        capacity: int = 10,
        weight: int = 1,
        accept: int | None = None,
        finish_at_once: bool = False,
        holder: str = "",
    ) -> None:
        self.id = f"gw-{uuid.uuid4().hex[:8]}"
        #: The process that holds this gateway's leases (its api process; "": none).
        self.holder = holder
        self.nc = nc
        self.subjects = subjects
        self.bus = Bus(nc, subjects, cluster_auth())
        self.queue = queue
        self.capacity = capacity
        self.weight = weight
        #: Accept at most this many per request (None: as many as there are free slots).
        self.accept = accept
        #: Finish every accepted task at once, publishing its Done before the reply (the
        #: order in which the dispatcher may well handle them anyway).
        self.finish_at_once = finish_at_once
        #: Take dispatch requests without ever answering (a hung api process).
        self.silent = False
        self.in_flight = 0
        #: Slots given back so far (the running total Done, replies and Register carry).
        self.returned = 0
        self.requests: list[cluster_pb2.DispatchRequest] = []
        self.received: list[task_pb2.TaskEnvelope] = []
        #: Owner hints heard (each makes it register again).
        self.owner_hints = 0
        #: Task types it announces it takes none of (its circuit breakers).
        self.blocked: list[str] = []
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        # By hand, not Bus.serve_dispatch: a silent gateway never answers, and one that
        # finishes at once publishes its Done before it replies.
        self._subs.append(
            await self.nc.subscribe(self.subjects.dispatch(self.id), cb=self._on_dispatch)
        )
        self._subs.append(await self.bus.subscribe_owner_changed(self._on_owner, queue=self.queue))
        self._subs.append(await self.bus.subscribe_roll_call(self.register))
        await self.nc.flush()
        await self.register()

    async def stop_answering(self) -> None:
        """Vanish without a word (a crashed api process)."""
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
        await self.nc.flush()

    async def register(self, *, closing: bool = False) -> None:
        msg = cluster_pb2.Register(
            gateway=self.id,
            queue=self.queue,
            capacity=self.capacity,
            weight=self.weight,
            in_flight=self.in_flight,
            closing=closing,
            returned=self.returned,
            holder=self.holder,
            blocked_types=self.blocked,
        )
        await self.bus.publish(msg)
        await self.nc.flush()

    async def done(self, n: int) -> None:
        self.in_flight -= n
        self.returned += n
        msg = cluster_pb2.Done(gateway=self.id, queue=self.queue, n=n, returned=self.returned)
        await self.bus.publish(msg)
        await self.nc.flush()

    @property
    def accepted_ids(self) -> list[str]:
        return [env.id for env in self.received]

    async def _on_owner(self, queue: str) -> None:
        self.owner_hints += 1
        await self.register()

    async def _on_dispatch(self, msg: Msg) -> None:
        request = cluster_pb2.DispatchRequest.FromString(msg.data)
        self.requests.append(request)
        if self.silent:
            return
        room = self.capacity - self.in_flight
        if self.accept is not None:
            room = min(room, self.accept)
        taken = list(request.tasks[: max(0, room)])
        self.received.extend(taken)
        self.in_flight += len(taken)
        reply = cluster_pb2.DispatchReply(
            accepted=[env.id for env in taken],
            credits=0 if self.accept is not None else self.capacity - self.in_flight,
            returned=self.returned,
            blocked_types=self.blocked,
        )
        if self.finish_at_once and taken:
            await self.done(len(taken))
        # Sealed for the dispatcher's inbox, as Bus.serve_dispatch would.
        body = reply.SerializeToString()
        await self.nc.publish(msg.reply, body, headers=self.bus.auth.seal(msg.reply, body))


# ------------------------------------------------------------------ fixtures


@pytest.fixture
def make_settings(nats_url: str, subjects: Subjects) -> Callable[..., DispatcherSettings]:
    def make(**overrides: Any) -> DispatcherSettings:
        fields: dict[str, Any] = {
            "nats_url": nats_url,
            "subject_prefix": subjects.prefix,
            "broker": "memory",
            "instance_id": f"disp-{uuid.uuid4().hex[:6]}",
            "owner_ttl": 2.0,
            "dispatch_timeout": 2.0,
            "register_tick": 5.0,
            "idle_timeout": 30.0,
        }
        fields.update(overrides)
        return DispatcherSettings(**fields)

    return make


@pytest.fixture
async def dispatchers(
    broker: Broker,
    nc: NatsClient,
    clock: FakeClock,
    make_settings: Callable[..., DispatcherSettings],
) -> AsyncIterator[Callable[..., Awaitable[Dispatcher]]]:
    started: list[Dispatcher] = []

    async def start(**overrides: Any) -> Dispatcher:
        d = Dispatcher(make_settings(**overrides), broker, nc, clock)
        await d.start()
        started.append(d)
        return d

    try:
        yield start
    finally:
        for d in started:
            await d.stop()


@pytest.fixture
def queue_name() -> str:
    # Unique per test so tests on the shared Postgres database never see each other.
    return f"q{uuid.uuid4().hex[:10]}"


async def enqueue(broker: Broker, queue: str, n: int) -> list[str]:
    results = await broker.enqueue_batch([NewTask(queue=queue, type="t") for _ in range(n)])
    return [r.task.id for r in results]


async def count(broker: Broker, queue: str, state: TaskState) -> int:
    (stats,) = await broker.queue_stats(queue)
    return stats.count(state)


async def wake(nc: NatsClient, subjects: Subjects, queue: str) -> None:
    await Bus(nc, subjects, cluster_auth()).publish(cluster_pb2.Wake(queue=queue))
    await nc.flush()


# --------------------------------------------------------------------- tests


async def test_a_wake_dispatches_leased_tasks_to_a_registered_gateway(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    d = await dispatchers()
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=10)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)

    ids = await enqueue(broker, queue_name, 3)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 3)

    assert sorted(gw.accepted_ids) == sorted(ids)
    assert len(gw.requests) == 1  # one DispatchRequest carried the whole batch
    assert gw.requests[0].queue == queue_name
    assert gw.requests[0].dispatcher == d.instance_id
    assert not gw.requests[0].more  # it asked for 10 and got all there was
    for env in gw.received:
        stored = await broker.get_task(env.id)
        assert stored.state is TaskState.ACTIVE
        assert stored.lease_id == env.lease_id
        assert env.attempt == 1
    qd = d.queue(queue_name)
    assert qd is not None
    # The gateway records a request before it replies: the dispatcher counts the tasks
    # once the reply is in.
    await wait_until(lambda: qd.dispatched == 3)
    assert qd.book.total == 7


async def test_an_offer_says_when_the_queue_probably_holds_more(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    """A gateway whose queues share its slots keeps a queue in its turns while its
    dispatcher has more: the offer says so when the lease got all it asked for."""
    d = await dispatchers()
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=2)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
    await enqueue(broker, queue_name, 3)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 2)
    assert [len(r.tasks) for r in gw.requests] == [2]
    assert gw.requests[0].more


async def test_a_starting_dispatcher_calls_the_roll_and_claims_the_served_queues(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    """The wake and the registration went out before any dispatcher listened: the new
    dispatcher's roll call makes the gateway register again at once (not at its next
    register tick, seconds away), so the queue is claimed and the task goes out with no
    further wake. A queue with due work that no gateway serves is not claimed."""
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=10)
    await gw.start()
    ids = await enqueue(broker, queue_name, 2)
    unserved = f"{queue_name}-unserved"
    await enqueue(broker, unserved, 1)
    await wake(nc, subjects, queue_name)
    await wake(nc, subjects, unserved)
    d = await dispatchers()
    await wait_until(lambda: len(gw.received) == 2)
    assert sorted(gw.accepted_ids) == sorted(ids)
    assert d.owned == {queue_name}


async def test_a_done_handled_before_the_reply_it_follows_keeps_its_credit(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    """A one-slot gateway finishes each task before its reply ("0 free") is read: had
    the reply overwritten the Done's refill, the slot would be lost and dispatch would
    stop until the gateway registered again (this one never does)."""
    d = await dispatchers()
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=1, finish_at_once=True)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
    ids = await enqueue(broker, queue_name, 6)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 6)
    assert sorted(gw.accepted_ids) == sorted(ids)
    assert [len(r.tasks) for r in gw.requests] == [1] * 6


async def test_tasks_the_gateway_does_not_accept_are_released_at_once(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    d = await dispatchers()
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=10, accept=2)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)

    await enqueue(broker, queue_name, 5)
    await wake(nc, subjects, queue_name)

    async def settled() -> bool:
        return (
            await count(broker, queue_name, TaskState.PENDING) == 3
            and await count(broker, queue_name, TaskState.ACTIVE) == 2
        )

    # The fake clock never moves, so these are explicit releases, not lease expiry.
    await wait_until(settled)
    assert len(gw.requests) == 1
    assert len(gw.requests[0].tasks) == 5
    assert len(gw.received) == 2
    page = await broker.list_tasks(TaskListParams(queue=queue_name, state=TaskState.PENDING))
    assert all(t.lease_id is None and t.retried == 0 for t in page.tasks)
    qd = d.queue(queue_name)
    assert qd is not None
    assert qd.book.total == 0  # credits come from the reply


async def test_done_refills_credits_and_dispatches_more(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    await dispatchers()
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=2)
    await gw.start()
    await enqueue(broker, queue_name, 5)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 2)
    assert await count(broker, queue_name, TaskState.PENDING) == 3

    for expected in (4, 5):
        for env in gw.received[-2:]:
            await broker.ack(env.id, env.lease_id)
        await gw.done(2)
        await wait_until(lambda expected=expected: len(gw.received) == expected)  # type: ignore[misc]
    assert await count(broker, queue_name, TaskState.PENDING) == 0
    assert len(set(gw.accepted_ids)) == 5


async def test_tasks_are_split_between_gateways_by_weight(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    d = await dispatchers()
    heavy = FakeGateway(nc, subjects, queue=queue_name, capacity=100, weight=3)
    light = FakeGateway(nc, subjects, queue=queue_name, capacity=100, weight=1)
    await heavy.start()
    await light.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and len(qd.book) == 2)

    await enqueue(broker, queue_name, 40)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(heavy.received) + len(light.received) == 40)

    assert (len(heavy.received), len(light.received)) == (30, 10)
    # Each gateway got its share in one request.
    assert (len(heavy.requests), len(light.requests)) == (1, 1)
    assert not set(heavy.accepted_ids) & set(light.accepted_ids)


async def test_each_task_is_leased_in_the_name_of_its_gateways_holder(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    """The slots are picked before the lease, so each task names the process that holds
    it: if that api process dies, the reaper releases exactly its tasks."""
    d = await dispatchers()
    gateways = [
        FakeGateway(nc, subjects, queue=queue_name, capacity=10, holder="api~A"),
        FakeGateway(nc, subjects, queue=queue_name, capacity=10, holder="api~A"),
        FakeGateway(nc, subjects, queue=queue_name, capacity=10, holder="api~B"),
        FakeGateway(nc, subjects, queue=queue_name, capacity=10),
    ]
    for gw in gateways:
        await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and len(qd.book) == 4)

    await enqueue(broker, queue_name, 14)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: sum(len(gw.received) for gw in gateways) == 14)
    for gw in gateways:
        assert gw.received, "fewer tasks than slots still go to every gateway by weight"
        for env in gw.received:
            assert (await broker.get_task(env.id)).holder == (gw.holder or None)


async def test_slots_taken_for_a_lease_that_finds_less_are_given_back(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    """Wakes with nothing (then less than the slots) due must not spend the gateway's
    credits: it registers once, and every later task still reaches it."""
    d = await dispatchers()
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=4, accept=1)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
    qd = d.queue(queue_name)
    assert qd is not None
    base = qd.wakes
    for n in range(1, 4):
        await wake(nc, subjects, queue_name)
        await wait_until(partial(lambda seen: qd.wakes >= seen and not qd.cycling, base + n))
    assert qd.book.total == 4
    await enqueue(broker, queue_name, 1)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 1)
    # It accepts one per request and answers "no credits": the rest waits for its Done.
    await wait_until(lambda: qd.dispatched == 1 and not qd.cycling)
    assert qd.book.total == 0
    await gw.done(1)
    await enqueue(broker, queue_name, 1)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 2)


async def test_pause_stops_dispatch_and_resume_restarts_it(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    d = await dispatchers()
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=10)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
    qd = d.queue(queue_name)
    assert qd is not None

    async def control() -> None:
        await Bus(nc, subjects, cluster_auth()).publish(
            cluster_pb2.Control(queue=queue_name, reason="test")
        )
        await nc.flush()

    await broker.set_queue_paused(queue_name, True)
    await control()
    await wait_until(lambda: qd.paused)

    await enqueue(broker, queue_name, 3)
    wakes = qd.wakes
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: qd.wakes > wakes)
    assert not qd.cycling
    assert gw.received == []
    assert await count(broker, queue_name, TaskState.PENDING) == 3

    await broker.set_queue_paused(queue_name, False)
    await control()
    await wait_until(lambda: len(gw.received) == 3)
    assert await count(broker, queue_name, TaskState.ACTIVE) == 3


async def test_a_gateway_that_vanished_is_forgotten_and_its_tasks_released(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    d = await dispatchers()
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=10)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
    qd = d.queue(queue_name)
    assert qd is not None
    await gw.stop_answering()

    await enqueue(broker, queue_name, 4)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: gw.id not in qd.book)
    await wait_until(lambda: qd.released == 4 and not qd.cycling)
    assert await count(broker, queue_name, TaskState.PENDING) == 4


async def test_a_gateway_that_does_not_answer_gets_nothing_more(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    """A dispatch that times out leaves the gateway with no credits until it registers
    or gives slots back, even one that had given slots back before (counted in its
    running total)."""
    d = await dispatchers(dispatch_timeout=0.3)
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=2, finish_at_once=True)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
    qd = d.queue(queue_name)
    assert qd is not None
    await enqueue(broker, queue_name, 2)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 2 and not qd.cycling)
    assert gw.returned == 2

    gw.silent = True
    await enqueue(broker, queue_name, 2)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: qd.released == 2 and not qd.cycling)
    asked = len(gw.requests)
    wakes = qd.wakes
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: qd.wakes > wakes and not qd.cycling)
    assert len(gw.requests) == asked
    assert qd.book.total == 0


async def test_a_closing_registration_is_forgotten(
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    d = await dispatchers()
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=10)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
    await gw.register(closing=True)
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and len(qd.book) == 0)


async def test_only_one_instance_owns_a_queue_and_the_other_takes_over_on_stop(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    # A long owner TTL: the takeover below must come from the graceful hand-over.
    first = await dispatchers(owner_ttl=60.0)
    second = await dispatchers(owner_ttl=60.0)
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=10)
    await gw.start()
    await wait_until(lambda: queue_name in first.owned | second.owned)
    owner, other = (first, second) if queue_name in first.owned else (second, first)
    assert queue_name not in other.owned
    await wait_until(lambda: other.claims_refused > 0 or queue_name in other.owned)
    assert queue_name not in other.owned

    await enqueue(broker, queue_name, 2)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 2)
    assert {r.dispatcher for r in gw.requests} == {owner.instance_id}
    assert other.peers is not None
    await wait_until(lambda: other.peers is not None and owner.instance_id in other.peers.peers)

    await owner.stop()
    await wait_until(lambda: queue_name in other.owned)
    # It said goodbye: a peer that left, not one that died.
    await wait_until(lambda: other.peers is not None and not other.peers.peers)
    assert (other.peers.deaths, other.taken_over) == (0, 0)
    await wait_until(lambda: (qd := other.queue(queue_name)) is not None and gw.id in qd.book)
    await enqueue(broker, queue_name, 2)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 4)
    assert gw.requests[-1].dispatcher == other.instance_id


async def test_an_owner_that_dies_is_replaced_once_its_key_expires(
    broker: Broker,
    nats_url: str,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    make_settings: Callable[..., DispatcherSettings],
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    doomed_nc = await connect_nats(nats_url, name="doomed")
    doomed = Dispatcher(make_settings(owner_ttl=1.0), broker, doomed_nc, clock)
    await doomed.start()
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=10)
    await gw.start()
    await wait_until(lambda: queue_name in doomed.owned)
    survivor = await dispatchers(owner_ttl=1.0)

    # The doomed instance's connection drops: no release, no owner_changed.
    await close_nats(doomed_nc, drain=False)

    async def survivor_took_over() -> bool:
        # What the maintenance sweep does every reap tick: wake queues with due work.
        await wake(nc, subjects, queue_name)
        await gw.register()
        return queue_name in survivor.owned

    await wait_until(survivor_took_over)
    await enqueue(broker, queue_name, 1)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 1)
    assert gw.requests[-1].dispatcher == survivor.instance_id
    await doomed.stop()


async def test_an_owner_that_dies_is_replaced_as_soon_as_its_beats_stop(
    broker: Broker,
    nats_url: str,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    make_settings: Callable[..., DispatcherSettings],
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    """No wake, no registration, and a key that lives a minute: only the dead owner's
    silence can bring the queue to the survivor, and it does within a second or two."""
    fast = {"owner_ttl": 60.0, "peer_beat": 0.1, "peer_silence": 0.5, "register_tick": 60.0}
    doomed_nc = await connect_nats(nats_url, name="doomed")
    doomed = Dispatcher(make_settings(**fast), broker, doomed_nc, clock)
    await doomed.start()
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=10)
    await gw.start()
    other_queue = f"{queue_name}x"
    other_gw = FakeGateway(nc, subjects, queue=other_queue, capacity=10)
    await other_gw.start()
    await wait_until(lambda: {queue_name, other_queue} <= doomed.owned)
    survivor = await dispatchers(**fast)
    await wait_until(
        lambda: survivor.peers is not None and doomed.instance_id in survivor.peers.peers
    )

    loop = asyncio.get_running_loop()
    died = loop.time()
    await close_nats(doomed_nc, drain=False)  # no release, no owner_changed, no goodbye
    await wait_until(lambda: {queue_name, other_queue} <= survivor.owned)
    assert loop.time() - died < 5.0  # well before the keys could expire (60 s)
    # Taken over, not claimed (the keys live a minute): a claim refused meanwhile (the
    # answers to the survivor's roll call can come late) changes nothing.
    assert survivor.taken_over == 2
    # The gateways heard of the new owner and re-registered: it dispatches at once.
    await wait_until(lambda: (qd := survivor.queue(queue_name)) is not None and gw.id in qd.book)
    await enqueue(broker, queue_name, 1)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 1)
    assert gw.requests[-1].dispatcher == survivor.instance_id
    await doomed.stop()


async def test_peer_watch_reports_a_silent_peer_once_and_judges_nobody_while_deaf(
    nc: NatsClient,
    subjects: Subjects,
) -> None:
    """PeerWatch on its own: a silent peer is reported once; one heard again is alive
    again; one that leaves is forgotten; an instance that does not hear its own beats
    judges nobody, and once it hears them again it waits a silence before judging."""
    bus = Bus(nc, subjects, cluster_auth())
    dead: list[str] = []
    watch = PeerWatch(bus, "me", beat=0.05, silence=0.3, on_dead=dead.append)
    await watch.start()
    other = Bus(nc, subjects, cluster_auth())
    for _ in range(3):
        await other.publish(cluster_pb2.DispatcherBeat(instance="peer"))
    await wait_until(lambda: "peer" in watch.peers)
    await wait_until(lambda: dead == ["peer"])
    assert "peer" not in watch.peers
    await other.publish(cluster_pb2.DispatcherBeat(instance="peer"))
    await wait_until(lambda: "peer" in watch.peers)
    await other.publish(cluster_pb2.DispatcherBeat(instance="peer", leaving=True))
    await wait_until(lambda: "peer" not in watch.peers)
    await watch.stop()
    assert dead == ["peer"]

    # Driven by hand (not started): times set as they would have come.
    now = asyncio.get_running_loop().time()
    judge = PeerWatch(bus, "judge", beat=0.05, silence=0.3, on_dead=dead.append)
    judge._peers["quiet"] = now - 1.0
    judge._self_heard = judge._self_since = now - 1.0  # its own beats are not coming back
    assert judge.check() == []
    judge._on_beat(cluster_pb2.DispatcherBeat(instance="judge"))  # heard again, just now
    assert judge.check() == []  # not before it has heard itself for a silence
    judge._self_since -= 0.3
    assert judge.check() == ["quiet"]
    assert dead == ["peer", "quiet"]
    # A blip shorter than the silence (its own beats came back 0.2 s late) starts the
    # silence over too: the peers' beats may not have caught up yet.
    now = asyncio.get_running_loop().time()
    judge._peers["late"] = now - 1.0
    judge._self_heard = now - 0.2
    judge._on_beat(cluster_pb2.DispatcherBeat(instance="judge"))
    assert judge.check() == []
    judge._self_since -= 0.3
    assert judge.check() == ["late"]


async def test_losing_the_key_stops_dispatch_at_once(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    d = await dispatchers(owner_ttl=1.5)
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=10)
    await gw.start()
    await wait_until(lambda: queue_name in d.owned)

    # Someone else takes the key (as if ours had expired during a partition).
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=1.5)
    await kv.delete(queue_name)
    intruder = KeyLease(kv, queue_name, "intruder")
    assert await intruder.claim()
    await wait_until(lambda: queue_name not in d.owned)

    await enqueue(broker, queue_name, 2)
    refused = d.claims_refused
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: d.claims_refused > refused)
    assert gw.received == []
    assert await count(broker, queue_name, TaskState.PENDING) == 2


async def test_an_idle_queue_is_given_up(
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    d = await dispatchers(idle_timeout=0.3, register_tick=0.1)
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=10)
    await gw.start()
    await wait_until(lambda: queue_name in d.owned)
    # The gateway never re-registers: its registration expires, then the queue idles out.
    await wait_until(lambda: queue_name not in d.owned)
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=2.0)

    async def released() -> bool:
        # The key is given up right after the queue leaves d.owned (a NATS round trip).
        return await KeyLease(kv, queue_name, "someone").holder() is None

    await wait_until(released)


async def owner_key(nc: NatsClient, subjects: Subjects, queue: str) -> str | None:
    """Who holds ``queue``'s ownership key (None: nobody)."""
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=2.0)
    return await KeyLease(kv, queue, "someone").holder()


async def test_wakes_of_a_queue_nobody_serves_claim_nothing_until_a_worker_comes(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    """Work in a queue no gateway serves can go nowhere: its wakes (the api's, the
    reaper's) cost no claim, no ownership key and no lease. The first registration of a
    gateway for it brings the queue a dispatcher, and the task goes out at once."""
    d = await dispatchers()
    lonely = [f"{queue_name}-{n}" for n in range(20)]
    for queue in lonely:
        await enqueue(broker, queue, 1)
    bus = Bus(nc, subjects, cluster_auth())
    for _ in range(3):
        for queue in lonely:
            await bus.publish(cluster_pb2.Wake(queue=queue))
        # An owner change (another dispatcher let a queue go) is no reason either.
        await bus.publish_owner_changed(lonely[0])
    # A served queue's wake, after theirs on the same subscription: handled once they are.
    served = FakeGateway(nc, subjects, queue=queue_name, capacity=10)
    await served.start()
    await wait_until(lambda: queue_name in d.owned)
    await enqueue(broker, queue_name, 1)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(served.received) == 1)
    assert d.owned == {queue_name}
    assert d.claims_refused == 0
    for queue in lonely:
        assert await owner_key(nc, subjects, queue) is None
        assert await count(broker, queue, TaskState.PENDING) == 1

    gw = FakeGateway(nc, subjects, queue=lonely[7], capacity=10)
    await gw.start()
    await wait_until(lambda: len(gw.received) == 1, within=2.0)
    assert d.owned == {queue_name, lonely[7]}
    assert await owner_key(nc, subjects, lonely[7]) == d.instance_id


async def test_a_queue_whose_gateways_left_is_given_up_however_much_is_due(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    """Wakes keep coming for due work nobody serves (every enqueue sends one): they do
    not keep the queue, which idles out and is not claimed back by the next wake."""
    d = await dispatchers(idle_timeout=0.3)
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=10)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
    await gw.register(closing=True)
    await enqueue(broker, queue_name, 3)

    async def released_while_woken() -> bool:
        await wake(nc, subjects, queue_name)
        return queue_name not in d.owned

    await wait_until(released_while_woken, within=30)

    async def key_gone() -> bool:
        return await owner_key(nc, subjects, queue_name) is None

    await wait_until(key_gone, within=30)
    refused = d.claims_refused
    for _ in range(5):
        await wake(nc, subjects, queue_name)
    await gw.register()  # and a gateway's return does bring it back
    await wait_until(lambda: len(gw.received) == 3, within=30)
    assert d.claims_refused == refused


async def test_malformed_messages_are_ignored(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    d = await dispatchers()
    # Sealed, so that what is dropped is dropped for not decoding.
    auth = cluster_auth()
    for subject, body in (
        (subjects.register(queue_name), b"\xff\xff not a protobuf"),
        (subjects.done(queue_name), b"\xff\xff"),
    ):
        await nc.publish(subject, body, headers=auth.seal(subject, body))
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=1)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
    await enqueue(broker, queue_name, 1)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 1)


async def test_an_offer_too_big_for_one_nats_message_goes_in_pieces(
    subjects: Subjects, make_settings: Callable[..., DispatcherSettings], clock: FakeClock
) -> None:
    """On a NATS server that carries 64 kB a message: five 20 kB tasks go out as several
    requests (all accepted), and a 100 kB task, which no message could carry, is archived
    with an error that says why instead of coming back forever."""
    broker = MemoryBroker(clock)
    with EmbeddedNats(max_payload=64 * 1024) as server:
        nc = await connect_nats(server.url, name="test-small")
        settings = make_settings(nats_url=server.url)
        d = Dispatcher(settings, broker, nc, clock)
        await d.start()
        try:
            gw = FakeGateway(nc, subjects, queue=QUEUE, capacity=10)
            await gw.start()
            await wait_until(lambda: (qd := d.queue(QUEUE)) is not None and gw.id in qd.book)
            small = await broker.enqueue_batch(
                [NewTask(queue=QUEUE, type="t", payload=b"x" * 20_000) for _ in range(5)]
            )
            big = await broker.enqueue(NewTask(queue=QUEUE, type="t", payload=b"y" * 100_000))
            await wake(nc, subjects, QUEUE)
            await wait_until(lambda: len(gw.received) == 5)
            assert sorted(gw.accepted_ids) == sorted(r.task.id for r in small)
            assert len(gw.requests) >= 2
            assert all(r.ByteSize() <= 64 * 1024 for r in gw.requests)

            async def archived() -> bool:
                return (await broker.get_task(big.task.id)).state is TaskState.ARCHIVED

            await wait_until(archived)
            error = (await broker.get_task(big.task.id)).last_error or ""
            assert "cannot dispatch" in error
            assert "max_payload" in error
        finally:
            await d.stop()
            await close_nats(nc)


async def test_queues_woken_together_share_lease_round_trips(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
) -> None:
    d = await dispatchers()
    queues = [f"q{uuid.uuid4().hex[:10]}" for _ in range(10)]
    gateways = [FakeGateway(nc, subjects, queue=queue, capacity=2) for queue in queues]
    for gw in gateways:
        await gw.start()
    for queue, gw in zip(queues, gateways, strict=True):
        await wait_until(lambda q=queue, g=gw: (qd := d.queue(q)) is not None and g.id in qd.book)  # type: ignore[misc]
    # Counted from before the enqueue: a re-registration may lease the tasks before the
    # wakes go out.
    asks = d.leaser.asks
    rounds = d.leaser.rounds
    for queue in queues:
        await enqueue(broker, queue, 2)
    bus = Bus(nc, subjects, cluster_auth())
    for queue in queues:
        await bus.publish(cluster_pb2.Wake(queue=queue))
    await nc.flush()
    await wait_until(lambda: all(len(gw.received) == 2 for gw in gateways))
    # However many leases the wakes (and any late re-registration) made, they shared
    # round trips.
    assert d.leaser.asks - asks >= 2
    assert d.leaser.rounds - rounds < d.leaser.asks - asks


async def test_a_task_too_big_to_dispatch_takes_no_credit(
    subjects: Subjects, make_settings: Callable[..., DispatcherSettings], clock: FakeClock
) -> None:
    """A one-slot gateway: the archived task must not keep its slot, or the next task
    would wait for a registration (this gateway never sends another)."""
    broker = MemoryBroker(clock)
    with EmbeddedNats(max_payload=64 * 1024) as server:
        nc = await connect_nats(server.url, name="test-small")
        d = Dispatcher(make_settings(nats_url=server.url), broker, nc, clock)
        await d.start()
        try:
            gw = FakeGateway(nc, subjects, queue=QUEUE, capacity=1)
            await gw.start()
            await wait_until(lambda: (qd := d.queue(QUEUE)) is not None and gw.id in qd.book)
            big = await broker.enqueue(NewTask(queue=QUEUE, type="t", payload=b"y" * 100_000))
            await wake(nc, subjects, QUEUE)

            async def archived() -> bool:
                return (await broker.get_task(big.task.id)).state is TaskState.ARCHIVED

            await wait_until(archived)
            qd = d.queue(QUEUE)
            assert qd is not None
            assert qd.dispatched == 0
            small = await broker.enqueue(NewTask(queue=QUEUE, type="t", payload=b"x"))
            await wake(nc, subjects, QUEUE)
            await wait_until(lambda: gw.accepted_ids == [small.task.id])
        finally:
            await d.stop()
            await close_nats(nc)


# ------------------------------------------------------ progress watchdog
#
# A dispatcher whose lease cycle is stuck on a wedged database connection gives its queue
# up, and another dispatcher takes it over. Postgres sits behind a TCP proxy that stops
# forwarding without closing (a half-open link).

WEDGED_QUEUE = "wedged"


def _via(dsn: str, port: int) -> str:
    parts = urlsplit(dsn)
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(
        parts._replace(netloc=f"{auth}@127.0.0.1:{port}" if auth else f"127.0.0.1:{port}")
    )


@pytest.fixture
async def migrated_dsn(fresh_pg_dsn: str) -> str:
    await migrate(fresh_pg_dsn)
    return fresh_pg_dsn


@pytest.fixture
async def wedge_proxy(migrated_dsn: str) -> AsyncIterator[WedgeProxy]:
    parts = urlsplit(migrated_dsn)
    async with WedgeProxy(parts.hostname or "127.0.0.1", parts.port or 5432) as p:
        yield p


@pytest.mark.postgres
async def test_a_stuck_lease_cycle_hands_the_queue_to_another_dispatcher(
    migrated_dsn: str, wedge_proxy: WedgeProxy, nc: NatsClient, subjects: Subjects, nats_url: str
) -> None:
    def settings(name: str) -> DispatcherSettings:
        return DispatcherSettings(
            nats_url=nats_url,
            subject_prefix=subjects.prefix,
            instance_id=name,
            owner_ttl=30.0,  # long: the hand-over must not come from the key expiring
            progress_deadline=1.0,
        )

    # The wedged one's broker: no client-side timeout to rescue it, only the watchdog.
    wedged_broker = await PostgresBroker.connect(
        _via(migrated_dsn, wedge_proxy.port), SystemClock(), max_size=2, command_timeout=None
    )
    healthy_broker = await PostgresBroker.connect(migrated_dsn, SystemClock(), max_size=2)
    first = Dispatcher(settings("wedged"), wedged_broker, nc)
    second = Dispatcher(settings("healthy"), healthy_broker, nc)
    gateway = FakeGateway(nc, subjects, queue=WEDGED_QUEUE, capacity=10)
    try:
        await first.start()
        await gateway.start()
        await wait_until(lambda: WEDGED_QUEUE in first.owned, message="the first claims the queue")
        await second.start()

        wedge_proxy.wedge(new_connections=True)
        ids = [
            r.task.id
            for r in await healthy_broker.enqueue_batch(
                [NewTask(queue=WEDGED_QUEUE, type="t") for _ in range(3)]
            )
        ]
        await wake(nc, subjects, WEDGED_QUEUE)
        await wait_until(lambda: first.abandoned == 1, message="the stuck owner gives up")
        await wait_until(lambda: WEDGED_QUEUE in second.owned, message="the other takes over")
        # The tasks get through by the healthy dispatcher.
        await wait_until(lambda: sorted(gateway.accepted_ids) == sorted(ids), within=20)
        assert {r.dispatcher for r in gateway.requests} == {"healthy"}
        for task_id in ids:
            assert (await healthy_broker.get_task(task_id)).state is TaskState.ACTIVE
        assert WEDGED_QUEUE not in first.owned
    finally:
        await gateway.stop_answering()
        await second.stop()
        await wedge_proxy.close()  # unwedges the first one's calls (they fail): it can stop
        await first.stop()
        await healthy_broker.close()
        await wedged_broker.close()


async def test_after_a_nats_reconnect_the_gateways_of_owned_queues_register_again(
    nats_server: EmbeddedNats, subjects: Subjects, queue_name: str
) -> None:
    """Dones and registrations in flight through a nats-server that went away are lost,
    and the gateways' credits with them: once its link is back, the dispatcher asks the
    gateways of every queue it still owns to register again (an owner hint)."""
    broker = MemoryBroker(FakeClock())
    d_nc = await connect_nats(nats_server.url, name="dispatcher", reconnect_wait=0.1)
    gw_nc = await connect_nats(nats_server.url, name="gateway", reconnect_wait=0.1)
    settings = DispatcherSettings(
        nats_url=nats_server.url,
        subject_prefix=subjects.prefix,
        broker="memory",
        instance_id="disp-reconnects",
        owner_ttl=30.0,
    )
    d = Dispatcher(settings, broker, d_nc, FakeClock())
    try:
        await d.start()
        gw = FakeGateway(gw_nc, subjects, queue=queue_name)
        await gw.start()
        await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
        qd = d.queue(queue_name)
        hints = gw.owner_hints

        nats_server.kill()
        await wait_until(lambda: not d_nc.is_connected and not gw_nc.is_connected)
        nats_server.start()
        await wait_until(lambda: d_nc.is_connected and gw_nc.is_connected, within=TIMEOUT)
        await wait_until(lambda: gw.owner_hints > hints, within=TIMEOUT)
        # Still the same owner (the key is on disk): the hint came from the reconnect.
        assert d.queue(queue_name) is qd
    finally:
        await d.stop()
        await close_nats(gw_nc, drain=False)
        await close_nats(d_nc, drain=False)


async def test_a_dispatch_lost_with_the_nats_link_does_not_block_the_gateway(
    nats_server: EmbeddedNats, subjects: Subjects, queue_name: str
) -> None:
    """A request in flight when the dispatcher's nats-server went away times out, but
    the gateway did nothing wrong: it keeps its credits (a timeout on a steady link
    would leave it none until it registers again)."""
    broker = MemoryBroker(FakeClock())
    d_nc = await connect_nats(nats_server.url, name="dispatcher", reconnect_wait=0.1)
    gw_nc = await connect_nats(nats_server.url, name="gateway", reconnect_wait=0.1)
    settings = DispatcherSettings(
        nats_url=nats_server.url,
        subject_prefix=subjects.prefix,
        broker="memory",
        instance_id="disp-lost",
        owner_ttl=30.0,
        dispatch_timeout=2.0,
        register_tick=60.0,
    )
    d = Dispatcher(settings, broker, d_nc, FakeClock())
    try:
        await d.start()
        gw = FakeGateway(gw_nc, subjects, queue=queue_name, capacity=4)
        await gw.start()
        await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
        qd = d.queue(queue_name)
        assert qd is not None
        gw.silent = True  # the request reaches it and is never answered...
        await enqueue(broker, queue_name, 2)
        await wake(gw_nc, subjects, queue_name)
        await wait_until(lambda: len(gw.requests) == 1)
        nats_server.kill()  # ... because the server went away
        await wait_until(lambda: not d_nc.is_connected)
        nats_server.start()
        await wait_until(lambda: d_nc.is_connected and gw_nc.is_connected, within=TIMEOUT)
        gw.silent = False
        # The request times out; the tasks go back and are offered again to the same
        # gateway at once (with no new registration: the test's register tick is 60 s).
        await wait_until(lambda: len(gw.received) == 2, within=TIMEOUT)
    finally:
        await d.stop()
        await close_nats(gw_nc, drain=False)
        await close_nats(d_nc, drain=False)


async def test_after_a_nats_outage_the_dispatcher_claims_queues_with_due_work_unprompted(
    nats_server: EmbeddedNats, subjects: Subjects, queue_name: str
) -> None:
    """A queue given up while NATS did not answer, whose work came in meanwhile (its
    wakes lost): once NATS is back the dispatcher finds it by its due work, as at start,
    without a wake or a registration."""
    broker = MemoryBroker(FakeClock())
    d_nc = await connect_nats(nats_server.url, name="dispatcher", reconnect_wait=0.1)
    gw_nc = await connect_nats(nats_server.url, name="gateway", reconnect_wait=0.1)
    settings = DispatcherSettings(
        nats_url=nats_server.url,
        subject_prefix=subjects.prefix,
        broker="memory",
        instance_id="disp-outage",
        owner_ttl=1.0,
        register_tick=60.0,
    )
    d = Dispatcher(settings, broker, d_nc, FakeClock())
    try:
        await d.start()
        gw = FakeGateway(gw_nc, subjects, queue=queue_name)
        await gw.start()
        await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
        nats_server.kill()
        await wait_until(lambda: not d.owned, within=TIMEOUT)  # given up: NATS is silent
        ids = await enqueue(broker, queue_name, 3)
        nats_server.start()
        await wait_until(lambda: sorted(gw.accepted_ids) == sorted(ids), within=TIMEOUT)
    finally:
        await d.stop()
        await close_nats(gw_nc, drain=False)
        await close_nats(d_nc, drain=False)


async def _control(nc: NatsClient, subjects: Subjects, queue: str) -> None:
    await Bus(nc, subjects, cluster_auth()).publish(
        cluster_pb2.Control(queue=queue, reason="rate_limit")
    )
    await nc.flush()


async def _served(
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    nc: NatsClient,
    subjects: Subjects,
    queue: str,
    **gateway: Any,
) -> tuple[FakeGateway, QueueDispatcher]:
    """A dispatcher owning ``queue``, served by a started FakeGateway (``gateway``: its
    options); the gateway and the queue's dispatcher."""
    d = await dispatchers()
    gw = FakeGateway(nc, subjects, queue=queue, **gateway)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue)) is not None and gw.id in qd.book)
    qd = d.queue(queue)
    assert qd is not None
    return gw, qd


async def test_a_rate_limited_queue_leases_no_more_than_its_tokens(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    # The broker's bucket refills on the (fake) clock: nothing more goes out until the
    # test moves it, however often the dispatcher's timer comes back for the next token.
    await broker.set_rate_limit(RateLimit(queue_name, 2.0, 3))
    gw, qd = await _served(dispatchers, nc, subjects, queue_name, capacity=50)
    assert qd.rate_limit == RateLimit(queue_name, 2.0, 3)

    await enqueue(broker, queue_name, 20)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 3 and not qd.cycling)
    # Half a second of (fake) time: one token, at 2 a second.
    clock.advance(timedelta(milliseconds=500))
    await wait_until(lambda: len(gw.received) == 4, within=TIMEOUT)
    clock.advance(timedelta(seconds=10))  # a long spell fills the bucket to its burst only
    await wait_until(lambda: len(gw.received) == 7, within=TIMEOUT)
    assert await count(broker, queue_name, TaskState.ACTIVE) == 7
    assert await count(broker, queue_name, TaskState.PENDING) == 13


async def test_tokens_a_lease_did_not_use_go_back_to_the_bucket(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    await broker.set_rate_limit(RateLimit(queue_name, 1.0, 10))
    gw, qd = await _served(dispatchers, nc, subjects, queue_name, capacity=20, accept=1)
    await enqueue(broker, queue_name, 3)
    await wake(nc, subjects, queue_name)
    # It asked for 10 tokens, leased 3, and the gateway took 1: 9 went back.
    await wait_until(lambda: len(gw.received) == 1 and not qd.cycling)
    assert await count(broker, queue_name, TaskState.PENDING) == 2
    assert (await broker.take_rate_tokens(queue_name, 100)).granted == 9


async def test_a_changed_rate_limit_reaches_the_owner_at_once(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    await broker.set_rate_limit(RateLimit(queue_name, 0.001, 1))
    gw, qd = await _served(dispatchers, nc, subjects, queue_name, capacity=50)
    await enqueue(broker, queue_name, 5)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 1 and not qd.cycling)
    # The next token is 1,000 s away; removing the limit lets the rest go now.
    await broker.delete_rate_limit(queue_name)
    await _control(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 5)
    assert qd.rate_limit is None


async def test_a_new_owner_spends_the_same_bucket_not_a_fresh_burst(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    await broker.set_rate_limit(RateLimit(queue_name, 1.0, 4))
    first = await dispatchers(owner_ttl=60.0)
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=50)
    await gw.start()
    await wait_until(lambda: queue_name in first.owned)
    await enqueue(broker, queue_name, 20)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 4)

    second = await dispatchers(owner_ttl=60.0)
    await first.stop()
    await wait_until(lambda: (qd := second.queue(queue_name)) is not None and gw.id in qd.book)
    qd = second.queue(queue_name)
    assert qd is not None
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: qd.wakes > 0 and not qd.cycling)
    assert len(gw.received) == 4  # the bucket is empty for the new owner too
    clock.advance(timedelta(seconds=2))
    await wait_until(lambda: len(gw.received) == 6, within=TIMEOUT)
    assert {r.dispatcher for r in gw.requests[-1:]} == {second.instance_id}
    assert await count(broker, queue_name, TaskState.ACTIVE) == 6


# -------------------------------------------------------------- breakers


async def test_a_gateway_gets_none_of_the_types_it_blocks_and_another_gets_them(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    """A gateway whose breaker for a type is open names it in blocked_types: the
    dispatcher leases that type for the other gateways only; the type's tasks wait."""
    d = await dispatchers()
    broken = FakeGateway(nc, subjects, queue=queue_name, capacity=50)
    broken.blocked = ["bad"]
    await broken.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and broken.id in qd.book)
    bad = await broker.enqueue_batch([NewTask(queue=queue_name, type="bad") for _ in range(5)])
    good = await enqueue(broker, queue_name, 5)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(broken.received) == 5)
    assert sorted(broken.accepted_ids) == sorted(good)
    assert await count(broker, queue_name, TaskState.PENDING) == 5
    healthy = FakeGateway(nc, subjects, queue=queue_name, capacity=50)
    await healthy.start()
    await wait_until(lambda: len(healthy.received) == 5)
    assert sorted(healthy.accepted_ids) == sorted(r.task.id for r in bad)
    assert {env.type for env in broken.received} == {"t"}


async def test_a_queue_wide_breaker_leases_its_type_to_nobody_then_sends_one_probe(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    dispatchers: Callable[..., Awaitable[Dispatcher]],
    queue_name: str,
) -> None:
    now = clock.now()
    await broker.put_breaker(
        Breaker(
            queue=queue_name,
            type="bad",
            status=BreakerStatus.OPEN,
            opened_at=now,
            until=now + timedelta(seconds=30),
            failures=3,
        )
    )
    d = await dispatchers()
    gw = FakeGateway(nc, subjects, queue=queue_name, capacity=50)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue_name)) is not None and gw.id in qd.book)
    await broker.enqueue_batch([NewTask(queue=queue_name, type="bad") for _ in range(3)])
    good = await enqueue(broker, queue_name, 4)
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 4)
    assert sorted(gw.accepted_ids) == sorted(good)
    # The cool-down is over: the next cycle sends one probe, marked, and no more.
    clock.advance(timedelta(seconds=30))
    await wake(nc, subjects, queue_name)
    await wait_until(lambda: len(gw.received) == 5)
    probe = gw.received[-1]
    assert (probe.type, probe.probe) == ("bad", True)
    (row,) = await broker.list_breakers(queue_name)
    assert row.status is BreakerStatus.HALF_OPEN
    await wake(nc, subjects, queue_name)
    qd = d.queue(queue_name)
    assert qd is not None
    await wait_until(lambda: qd.wakes >= 3 and not qd.cycling)
    assert len(gw.received) == 5
    assert qd.probes == 1
