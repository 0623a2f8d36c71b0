"""Aggregation groups in the dispatcher: the slot book's batch slots (CreditBook.
batch_capable, take_batch_slot), how much of a batch one NATS message carries
(fit_batch), and the GroupsDue path end to end: a real nats-server, a real broker on a
FakeClock, a Dispatcher, and a fake gateway that announces the types it takes as batches
(Register.batch_types) and answers DispatchRequests.

The sweeper's GroupsDue hints are published here by the test itself (the maintenance
service's group pass is tested in services/maintenance).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import Any

import pytest
from conveyor_broker import FakeClock, NewTask
from conveyor_broker.interface import Broker
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.types import TaskEvent, TaskState
from conveyor_dispatcher import Dispatcher
from conveyor_dispatcher.credits import CreditBook
from conveyor_dispatcher.queue import fit_batch
from conveyor_protos.v1 import cluster_pb2, task_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.nats_connect import NatsClient
from conveyor_runtime.settings import DispatcherSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.wire import task_to_envelope
from conveyor_testkit.polling import wait_until
from nats.aio.subscription import Subscription

#: The task type the fake gateways take as batches.
BATCHED = "digest"

# ------------------------------------------------------------ the slot book


def test_batch_capable_needs_a_free_slot_of_a_gateway_taking_batches() -> None:
    book = CreditBook()
    assert not book.batch_capable()
    book.register("plain", capacity=5, weight=1, in_flight=0, now=0.0)
    assert not book.batch_capable()
    book.register(
        "batching", capacity=1, weight=1, in_flight=1, now=0.0, batch_types=frozenset({"t"})
    )
    assert not book.batch_capable()  # no free slot
    book.refill("batching", 1)
    assert book.batch_capable()


def test_take_batch_slot_picks_a_gateway_taking_the_type_with_the_most_credits() -> None:
    book = CreditBook()
    both = frozenset({"a", "b"})
    book.register("g1", capacity=2, weight=9, in_flight=0, now=0.0, batch_types=both)
    book.register("g2", capacity=5, weight=1, in_flight=0, now=0.0, batch_types=both)
    book.register("g3", capacity=5, weight=1, in_flight=0, now=0.0, batch_types=both)
    book.register(
        "only-b", capacity=50, weight=1, in_flight=0, now=0.0, batch_types=frozenset({"b"})
    )
    book.register("plain", capacity=50, weight=1, in_flight=0, now=0.0)

    # Most credits first (the weight does not count), then the first by name.
    assert book.take_batch_slot("a") == "g2"
    assert (book.credits_of("g2"), book.credits_of("g3")) == (4, 5)
    assert book.take_batch_slot("a") == "g3"
    assert book.take_batch_slot("a") == "g2"
    # Only gateways that take the type as batches: "only-b" has room for "b" alone, and
    # "plain" (no batch types) for no batch at all.
    assert book.take_batch_slot("b") == "only-b"
    assert book.take_batch_slot("c") is None
    assert book.credits_of("plain") == 50
    # ``but`` leaves gateways out.
    assert book.take_batch_slot("a", but=["g2", "g3"]) == "g1"
    assert book.take_batch_slot("a", but=("g1", "g2", "g3")) is None


def test_take_batch_slot_skips_blocked_types_and_gateways_without_credits() -> None:
    book = CreditBook()
    types = frozenset({"a", "b"})
    book.register(
        "broken",
        capacity=9,
        weight=1,
        in_flight=0,
        now=0.0,
        batch_types=types,
        blocked=frozenset({"a"}),
    )
    book.register("small", capacity=1, weight=1, in_flight=0, now=0.0, batch_types=types)
    assert book.take_batch_slot("a") == "small"  # "broken" has more room, but blocks "a"
    assert book.take_batch_slot("a") is None  # "small" is full
    assert book.take_batch_slot("b") == "broken"
    assert book.credits_of("broken") == 8
    # A reply naming the blocked types lifts the block.
    book.set_credits("broken", 8, returned=0, blocked=frozenset())
    assert book.take_batch_slot("a") == "broken"
    book.refund(["small"])
    assert book.take_batch_slot("a") == "broken"  # 7 credits beat 1
    assert book.total == 7


# ------------------------------------------------------------ fit_batch


async def _envelopes(*sizes: int) -> list[task_pb2.TaskEnvelope]:
    """Envelopes of leased tasks with payloads of ``sizes`` bytes, in that order."""
    broker = MemoryBroker(FakeClock())
    for size in sizes:
        await broker.enqueue(NewTask("q", BATCHED, payload=b"x" * size, group="g"))
    tasks = await broker.lease_group("q", "g", len(sizes), timedelta(seconds=30))
    return [task_to_envelope(task) for task in tasks]


async def test_fit_batch_keeps_the_first_members_one_message_carries() -> None:
    envelopes = await _envelopes(300, 300, 300)
    one = envelopes[0].ByteSize() + 8  # an envelope with its framing
    assert {env.ByteSize() for env in envelopes} == {one - 8}
    assert fit_batch(envelopes, 1024 + 3 * one) == 3
    assert fit_batch(envelopes, 1024 + 3 * one - 1) == 2
    assert fit_batch(envelopes, 1024 + one) == 1
    assert fit_batch(envelopes, 1024 + one - 1) == 0
    assert fit_batch(envelopes, 0) == 3  # unknown: all fit
    assert fit_batch([], 1 << 20) == 0


async def test_fit_batch_stops_at_the_first_member_that_does_not_fit() -> None:
    envelopes = await _envelopes(300, 5000, 300)
    small = envelopes[0].ByteSize() + 8
    # The last one would fit in the room the big one leaves, but a batch keeps its order.
    assert fit_batch(envelopes, 1024 + 3 * small) == 1
    big_first = [envelopes[1], envelopes[0]]
    assert fit_batch(big_first, 1024 + 3 * small) == 0


# ------------------------------------------------------------ end to end


class BatchGateway:
    """The gateway side of the dispatcher contract for one queue, taking ``batch_types``
    as batches: a batch (a DispatchRequest with ``group`` set) takes one slot, all of it
    or none; ``refuse``: it refuses every batch (its slots full as it sees them)."""

    def __init__(
        self,
        bus: Bus,
        queue: str,
        *,
        capacity: int = 10,
        batch_types: Sequence[str] = (BATCHED,),
        holder: str = "",
        refuse: bool = False,
    ) -> None:
        self.id = f"gw-{uuid.uuid4().hex[:8]}"
        self.bus = bus
        self.queue = queue
        self.capacity = capacity
        self.batch_types = list(batch_types)
        self.holder = holder
        self.refuse = refuse
        self.in_flight = 0
        self.requests: list[cluster_pb2.DispatchRequest] = []
        #: The batches it took (each request's envelopes).
        self.batches: list[list[task_pb2.TaskEnvelope]] = []
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        self._subs.append(await self.bus.serve_dispatch(self.id, self._answer))
        self._subs.append(await self.bus.subscribe_roll_call(self.register))
        self._subs.append(
            await self.bus.subscribe_owner_changed(lambda _: self.register(), queue=self.queue)
        )
        await self.bus.nc.flush()
        await self.register()

    async def register(self) -> None:
        await self.bus.publish(
            cluster_pb2.Register(
                gateway=self.id,
                queue=self.queue,
                capacity=self.capacity,
                weight=1,
                in_flight=self.in_flight,
                holder=self.holder,
                batch_types=self.batch_types,
            )
        )
        await self.bus.nc.flush()

    def _answer(self, request: cluster_pb2.DispatchRequest) -> cluster_pb2.DispatchReply:
        self.requests.append(request)
        accepted: list[str] = []
        if request.group and not self.refuse and self.in_flight < self.capacity:
            accepted = [env.id for env in request.tasks]
            self.batches.append(list(request.tasks))
            self.in_flight += 1
        return cluster_pb2.DispatchReply(accepted=accepted, credits=self.capacity - self.in_flight)


@pytest.fixture
def queue_name() -> str:
    # Unique per test so tests on the shared Postgres database never see each other.
    return f"q{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def dispatcher(
    broker: Broker, nc: NatsClient, clock: FakeClock, nats_url: str, subjects: Subjects
) -> AsyncIterator[Dispatcher]:
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
    d = Dispatcher(DispatcherSettings(**fields), broker, nc, clock)
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


@pytest.fixture
async def gateways(bus: Bus) -> AsyncIterator[list[BatchGateway]]:
    made: list[BatchGateway] = []
    yield made
    for gw in made:
        for sub in gw._subs:
            await sub.unsubscribe()


async def serve(
    d: Dispatcher, bus: Bus, gateways: list[BatchGateway], queue: str, **options: Any
) -> BatchGateway:
    """A started BatchGateway the dispatcher has registered (so it owns ``queue``)."""
    gw = BatchGateway(bus, queue, **options)
    gateways.append(gw)
    await gw.start()
    await wait_until(lambda: (qd := d.queue(queue)) is not None and gw.id in qd.book)
    return gw


async def join(
    broker: Broker, clock: FakeClock, queue: str, group: str, n: int, task_type: str = BATCHED
) -> list[str]:
    """Enqueue ``n`` members of ``group`` (created in this order); their ids."""
    ids = []
    for _ in range(n):
        ids.append((await broker.enqueue(NewTask(queue, task_type, group=group))).task.id)
        clock.advance(timedelta(milliseconds=1))
    return ids


async def hint(bus: Bus, queue: str, *groups: tuple[str, int]) -> None:
    """The sweeper's GroupsDue for ``queue``: (group, max_size) each."""
    due = [cluster_pb2.DueGroupHint(group=g, size=n, max_size=n) for g, n in groups]
    await bus.publish(cluster_pb2.GroupsDue(queue=queue, groups=due))
    await bus.nc.flush()


async def states(broker: Broker, ids: Sequence[str]) -> list[TaskState]:
    return [(await broker.get_task(task_id)).state for task_id in ids]


async def test_a_due_group_is_leased_whole_and_offered_as_one_batch(
    broker: Broker,
    clock: FakeClock,
    bus: Bus,
    dispatcher: Dispatcher,
    gateways: list[BatchGateway],
    queue_name: str,
) -> None:
    gw = await serve(dispatcher, bus, gateways, queue_name, capacity=4, holder="api~A")
    qd = dispatcher.queue(queue_name)
    assert qd is not None
    ids = await join(broker, clock, queue_name, "g", 3)

    await hint(bus, queue_name, ("g", 3))

    await wait_until(lambda: len(gw.batches) == 1)
    (request,) = gw.requests
    assert (request.queue, request.group, request.dispatcher) == (
        queue_name,
        "g",
        dispatcher.instance_id,
    )
    assert [env.id for env in request.tasks] == ids  # oldest first
    (lease_id,) = {env.lease_id for env in request.tasks}
    assert lease_id
    for task_id in ids:
        stored = await broker.get_task(task_id)
        assert (stored.state, stored.lease_id) == (TaskState.ACTIVE, lease_id)
    await wait_until(lambda: qd.batches == 1 and qd.dispatched == 3)
    # One slot for the whole batch.
    assert qd.book.credits_of(gw.id) == 3

    # The group's type is known now: its next batch is leased for the chosen gateway's
    # holder (if that api process dies, the reaper releases exactly its tasks).
    more = await join(broker, clock, queue_name, "g", 2)
    await hint(bus, queue_name, ("g", 5))
    await wait_until(lambda: len(gw.batches) == 2)
    assert [env.id for env in gw.batches[1]] == more
    for task_id in more:
        assert (await broker.get_task(task_id)).holder == "api~A"
    assert qd.book.credits_of(gw.id) == 2


async def test_the_first_batch_of_a_group_is_leased_for_its_gateways_holder(
    broker: Broker,
    clock: FakeClock,
    bus: Bus,
    dispatcher: Dispatcher,
    gateways: list[BatchGateway],
    queue_name: str,
) -> None:
    gw = await serve(dispatcher, bus, gateways, queue_name, holder="api~A")
    ids = await join(broker, clock, queue_name, "g", 2)
    await hint(bus, queue_name, ("g", 2))
    await wait_until(lambda: len(gw.batches) == 1)
    assert [(await broker.get_task(task_id)).holder for task_id in ids] == ["api~A"] * 2


async def test_a_hint_leases_no_more_than_its_max_size_and_other_types_go_back(
    broker: Broker,
    clock: FakeClock,
    bus: Bus,
    dispatcher: Dispatcher,
    gateways: list[BatchGateway],
    queue_name: str,
) -> None:
    gw = await serve(dispatcher, bus, gateways, queue_name)
    qd = dispatcher.queue(queue_name)
    assert qd is not None
    first = await join(broker, clock, queue_name, "g", 2)
    odd = await join(broker, clock, queue_name, "g", 1, task_type="other")
    late = await join(broker, clock, queue_name, "g", 2)

    await hint(bus, queue_name, ("g", 4))

    await wait_until(lambda: len(gw.batches) == 1)
    # The 4 oldest were leased; the one of another type went back, the youngest stayed.
    assert [env.id for env in gw.batches[0]] == [*first, late[0]]
    assert {env.type for env in gw.batches[0]} == {BATCHED}

    async def settled() -> bool:
        return await states(broker, [*odd, late[1]]) == [TaskState.AGGREGATING] * 2

    await wait_until(settled)
    assert (await broker.get_task(odd[0])).retried == 0
    await wait_until(lambda: qd.released == 1)


async def test_a_refused_batch_goes_back_to_its_group(
    broker: Broker,
    clock: FakeClock,
    bus: Bus,
    dispatcher: Dispatcher,
    gateways: list[BatchGateway],
    queue_name: str,
) -> None:
    gw = await serve(dispatcher, bus, gateways, queue_name, refuse=True)
    qd = dispatcher.queue(queue_name)
    assert qd is not None
    ids = await join(broker, clock, queue_name, "g", 3)

    await hint(bus, queue_name, ("g", 3))

    await wait_until(lambda: len(gw.requests) == 1)
    assert gw.requests[0].group == "g"
    assert [env.id for env in gw.requests[0].tasks] == ids

    async def released() -> bool:
        return await states(broker, ids) == [TaskState.AGGREGATING] * 3

    await wait_until(released)
    await wait_until(lambda: qd.released == 3)
    for task_id in ids:
        stored = await broker.get_task(task_id)
        assert (stored.lease_id, stored.retried) == (None, 0)
    assert qd.batches == 0
    assert [(s.group, s.size) for s in await broker.group_stats(queue_name)] == [("g", 3)]


async def test_a_group_no_gateway_takes_as_a_batch_is_released_then_left_alone(
    broker: Broker,
    clock: FakeClock,
    bus: Bus,
    dispatcher: Dispatcher,
    gateways: list[BatchGateway],
    queue_name: str,
) -> None:
    """A gateway takes batches, but not of the group's type: the group is leased once
    (its type is unknown until then), released, and not leased again on the next hint.
    A group in the same hint whose type it takes still goes out, after it."""
    events: list[TaskEvent] = []
    broker.set_event_sink(events.append)
    gw = await serve(dispatcher, bus, gateways, queue_name, batch_types=["other"])
    qd = dispatcher.queue(queue_name)
    assert qd is not None
    stuck = await join(broker, clock, queue_name, "stuck", 2)
    good = await join(broker, clock, queue_name, "good", 1, task_type="other")

    await hint(bus, queue_name, ("stuck", 2))

    async def released() -> bool:
        return qd.released == 2 and await states(broker, stuck) == [TaskState.AGGREGATING] * 2

    await wait_until(released)

    def leases_of(ids: Sequence[str]) -> int:
        return sum(
            1
            for e in events
            if e.task_id in ids
            and (e.previous_state, e.state) == (TaskState.AGGREGATING, TaskState.ACTIVE)
        )

    assert leases_of(stuck) == 2
    assert gw.requests == []  # nobody was offered it

    # The next hint leases nothing of it; the other group of the hint goes out after it.
    await hint(bus, queue_name, ("stuck", 2), ("good", 1))
    await wait_until(lambda: len(gw.batches) == 1)
    assert [env.id for env in gw.batches[0]] == good
    assert leases_of(stuck) == 2
    assert qd.released == 2
    assert await states(broker, stuck) == [TaskState.AGGREGATING] * 2
