"""Fair slots: the turns of queues that share a worker's slots (conveyor_gateway.turns), on
their own and inside a gateway's credits (conveyor_gateway.credits), with a fake timer
so lapses happen when the test says."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from conveyor_broker import FakeClock, NewTask, Task
from conveyor_broker.memory import MemoryBroker
from conveyor_gateway.config import WorkerSpec
from conveyor_gateway.credits import Credits
from conveyor_gateway.holdings import Holdings
from conveyor_gateway.turns import Turns
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.wire import task_to_envelope

TTL = timedelta(seconds=30)


@dataclass
class Timer:
    """A handle of :class:`FakeTimers`."""

    delay: float
    call: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeTimers:
    """A ``call_later`` that fires only when told."""

    timers: list[Timer] = field(default_factory=list)

    def __call__(self, delay: float, call: Callable[[], None]) -> Timer:
        timer = Timer(delay, call)
        self.timers.append(timer)
        return timer

    @property
    def live(self) -> list[Timer]:
        return [t for t in self.timers if not t.cancelled]

    def fire_all(self) -> None:
        for timer in self.live:
            timer.cancelled = True
            timer.call()


# ----------------------------------------------------------------- Turns


def turns(weights: dict[str, int], lapsed: list[str] | None = None) -> tuple[Turns, FakeTimers]:
    timers = FakeTimers()
    sink = lapsed if lapsed is not None else []
    return Turns(weights, timeout=0.2, on_lapse=sink.append, call_later=timers), timers


def test_nobody_waiting_gets_no_turn() -> None:
    t, timers = turns({"a": 1, "b": 1})
    assert t.give(lambda q: 1) is None
    assert t.total_reserved == 0
    assert not timers.timers


def test_turns_follow_the_weights_of_the_waiting_queues() -> None:
    t, _ = turns({"a": 1, "b": 2, "c": 3, "idle": 5})
    for queue in ("a", "b", "c"):
        t.wait(queue)
    picks: Counter[str] = Counter()
    for _ in range(600):
        picked = t.give(lambda q: 1)
        assert picked is not None
        picks[picked] += 1
        t.take(picked, 1)
    # A queue that is not waiting gets nothing, whatever its weight.
    assert picks == {"a": 100, "b": 200, "c": 300}


def test_a_queue_with_its_own_slots_full_is_skipped_and_catches_up_after() -> None:
    t, _ = turns({"a": 1, "b": 1})
    t.wait("a")
    t.wait("b")
    full = {"a"}
    got = []
    for _ in range(3):
        queue = t.give(lambda q: 0 if q in full else 1)
        assert queue is not None
        got.append(queue)
        t.take(queue, 1)
    assert got == ["b", "b", "b"]
    full.clear()
    # "a" kept what it gained while skipped (capped at the total weight): it goes first.
    assert t.give(lambda q: 1) == "a"
    t.take("a", 1)
    assert t.give(lambda q: 1) == "a"


def test_a_queue_gets_no_more_turns_than_its_own_free_slots() -> None:
    t, _ = turns({"a": 1})
    t.wait("a")
    assert t.give(lambda q: 1) == "a"
    assert t.give(lambda q: 1) is None  # its one free slot is reserved already
    assert t.reserved["a"] == 1


def test_a_turn_taken_cancels_its_timer_and_a_lapsed_one_passes_on() -> None:
    lapsed: list[str] = []
    t, timers = turns({"a": 1, "b": 1}, lapsed)
    t.wait("a")
    t.wait("b")
    first = t.give(lambda q: 1)
    assert first == "a"
    assert timers.live[0].delay == 0.2
    assert t.take("a", 3) == 1
    assert not timers.live
    assert t.total_reserved == 0

    second = t.give(lambda q: 1)
    assert second == "b"
    timers.fire_all()
    assert lapsed == ["b"]
    assert t.total_reserved == 0
    assert t.lapsed == 1
    assert "b" not in t.waiting  # its dispatcher did not come: it waits no more


def test_clear_forgets_waits_and_reservations_and_cancels_their_timers() -> None:
    t, timers = turns({"a": 1})
    t.wait("a")
    t.give(lambda q: 1)
    t.clear()
    assert (t.waiting, t.total_reserved, timers.live) == ({}, 0, [])
    t.wait("unknown")  # a queue the worker does not serve never waits
    assert t.waiting == {}


# ---------------------------------------------------------- in the credits


@dataclass
class Recording:
    dispatched: list[list[str]] = field(default_factory=list)

    def dispatch(self, tasks: Sequence[task_pb2.TaskEnvelope]) -> None:
        self.dispatched.append([env.id for env in tasks])

    def dispatch_batch(self, batch: service_pb2.BatchDispatch) -> None:
        self.dispatched.append([env.id for env in batch.tasks])

    def cancel(self, task_id: str, lease_id: str, reason: str) -> None:
        pass


@dataclass
class Rig:
    credits: Credits
    holdings: Holdings
    timers: FakeTimers
    broker: MemoryBroker

    async def leased(self, queue: str, n: int = 1) -> list[Task]:
        for _ in range(n):
            await self.broker.enqueue(NewTask(queue=queue, type="t"))
        return await self.broker.lease(queue, n, TTL)

    def offer(
        self, tasks: Sequence[Task], queue: str, *, more: bool = False
    ) -> cluster_pb2.DispatchReply:
        request = cluster_pb2.DispatchRequest(
            queue=queue, dispatcher="d", tasks=[task_to_envelope(t) for t in tasks], more=more
        )
        return self.credits.answer(request)

    def finish(self, task: Task) -> None:
        """What the gateway does when a result comes: drop the delivery, give the slot."""
        held = self.holdings.take(task.lease_id or "")
        assert held is not None
        self.credits.freed(held.queue)

    def returned(self) -> dict[str, int]:
        return {q: self.credits.done.returned(q) for q in self.credits.capacity}


@pytest.fixture
async def rig(bus: Bus) -> Rig:
    clock = FakeClock()
    weights = {"a": 1, "b": 1, "c": 2}
    holdings = Holdings(grace=timedelta(seconds=5), clock=clock, on_overrun=lambda *_: None)
    timers = FakeTimers()
    credits = Credits(
        "gw",
        WorkerSpec(queues=weights, concurrency=2),
        holdings=holdings,
        transport=Recording(),
        bus=bus,
        register_tick=60.0,
        spawn=lambda coro: coro.close(),
        call_later=timers,
    )
    return Rig(credits, holdings, timers, MemoryBroker(clock))


async def test_a_freed_slot_goes_to_the_waiting_queue_and_is_kept_for_it(rig: Rig) -> None:
    (a,) = await rig.leased("a")
    (b,) = await rig.leased("b")
    c = await rig.leased("c", 2)
    assert rig.offer([a], "a").accepted == [a.id]
    assert rig.offer([b], "b").accepted == [b.id]
    refused = rig.offer(c, "c")
    assert list(refused.accepted) == []
    assert refused.credits == 0
    assert "c" in rig.credits.turns.waiting

    rig.finish(a)
    # The Done goes to c, whose turn it is, not to a, whose task ended.
    assert rig.returned() == {"a": 0, "b": 0, "c": 1}
    assert (rig.credits.free("a"), rig.credits.free("c")) == (0, 1)
    (a2,) = await rig.leased("a")
    assert list(rig.offer([a2], "a").accepted) == []
    assert rig.offer(c[:1], "c", more=True).accepted == [c[0].id]
    assert rig.credits.turns.total_reserved == 0
    assert "c" in rig.credits.turns.waiting  # its dispatcher has more


async def test_a_queue_that_is_not_waiting_keeps_a_standing_credit(rig: Rig) -> None:
    (a,) = await rig.leased("a")
    (b,) = await rig.leased("b")
    rig.offer([a], "a")
    reply = rig.offer([b], "b")
    # Full: b's own slot is taken, and a's answer was before it filled up. c, not waiting
    # and with a slot of its own, is told 1, so its next task is offered at once.
    assert (reply.credits, rig.credits.free("c"), rig.credits.offered("c")) == (0, 0, 1)
    assert rig.credits.offered("a") == 0  # its own slot is in use


async def test_a_lapsed_turn_passes_to_the_next_waiting_queue(rig: Rig) -> None:
    (a,) = await rig.leased("a")
    (b,) = await rig.leased("b")
    (c,) = await rig.leased("c")
    rig.offer([a], "a", more=True)  # served, and it has more: it waits too
    rig.offer([b], "b")
    rig.offer([c], "c")  # refused: waits
    rig.finish(b)
    turn = [q for q, n in rig.returned().items() if n]
    assert turn == ["c"]  # heavier than a, and a's own slot is full
    rig.finish(a)
    assert rig.returned() == {"a": 1, "b": 0, "c": 1}
    assert rig.credits.turns.reserved == {"a": 1, "c": 1}
    rig.timers.fire_all()
    # Neither dispatcher came: the turns lapse, and as nobody waits any more the slots
    # are free for whoever offers first.
    assert rig.credits.turns.total_reserved == 0
    assert not rig.credits.turns.waiting
    assert rig.credits.free("b") == 1


async def test_queues_with_slots_of_their_own_take_no_turns(bus: Bus) -> None:
    clock = FakeClock()
    holdings = Holdings(grace=timedelta(seconds=5), clock=clock, on_overrun=lambda *_: None)
    credits = Credits(
        "gw",
        WorkerSpec(queues={"a": 1, "b": 1}, concurrency=4),
        holdings=holdings,
        transport=Recording(),
        bus=bus,
        register_tick=60.0,
        spawn=lambda coro: coro.close(),
        call_later=FakeTimers(),
    )
    rig = Rig(credits, holdings, FakeTimers(), MemoryBroker(clock))
    a = await rig.leased("a", 3)
    b = await rig.leased("b", 2)
    assert len(rig.offer(a, "a", more=True).accepted) == 2
    rig.offer(b, "b")
    rig.finish(b[0])
    # Each queue has its own two slots: a's refusal was its own, and b's Done is b's.
    assert rig.returned() == {"a": 0, "b": 1}
    assert not credits.turns.waiting
