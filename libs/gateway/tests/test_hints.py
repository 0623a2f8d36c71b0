"""WakePublisher.wake_later against the session's private nats-server: wakes for work that
falls due later (a retry after its backoff) go out when it is due, coalesced per tick.
And ResolvePublisher: the ends a broker reports go out as few Resolve messages."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from conveyor_broker import FakeClock, NewTask, Resolution, TaskState
from conveyor_broker.memory import MemoryBroker
from conveyor_gateway.hints import ResolvePublisher, WakePublisher
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_testkit.polling import wait_until
from nats.aio.msg import Msg


class Wakes:
    """Every Wake seen, as (queue, monotonic time received)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def on_wake(self, wake: cluster_pb2.Wake) -> None:
        self.seen.append((wake.queue, time.monotonic()))

    def queues(self) -> list[str]:
        return [queue for queue, _ in self.seen]


async def listen(bus: Bus) -> Wakes:
    wakes = Wakes()
    await bus.subscribe(cluster_pb2.Wake, wakes.on_wake)
    await bus.nc.flush()
    return wakes


async def test_a_later_wake_goes_out_once_due_and_not_before(bus: Bus) -> None:
    wakes = await listen(bus)
    publisher = WakePublisher(bus)
    asked = time.monotonic()
    publisher.wake_later("slow", 0.6)
    publisher.wake_later("fast", 0.2)
    assert publisher.later_pending == 2
    await wait_until(lambda: wakes.queues() == ["fast", "slow"], within=5)
    received = dict(wakes.seen)
    assert received["fast"] - asked >= 0.2
    assert received["slow"] - asked >= 0.6
    assert publisher.later_pending == 0
    await publisher.aclose()


async def test_later_wakes_due_in_the_same_tick_share_one_wake(bus: Bus) -> None:
    wakes = await listen(bus)
    publisher = WakePublisher(bus)
    for _ in range(50):
        publisher.wake_later("q", 0.3)
    publisher.wake_later("other", 0.3)
    # 51 requests in a few microseconds share a tick or two; a pause of the test
    # process between two of them could add one more, not dozens.
    assert publisher.later_pending < 10
    await wait_until(lambda: "other" in wakes.queues() and "q" in wakes.queues(), within=5)
    await bus.nc.flush()
    assert wakes.queues().count("q") <= 2
    await publisher.aclose()


async def test_a_due_or_past_later_wake_is_an_immediate_wake(bus: Bus) -> None:
    wakes = await listen(bus)
    publisher = WakePublisher(bus)
    publisher.wake_later("now", 0)
    publisher.wake_later("past", -5)
    assert publisher.later_pending == 0
    await wait_until(lambda: sorted(wakes.queues()) == ["now", "past"], within=5)
    await publisher.aclose()


async def test_an_earlier_wake_rearms_the_timer(bus: Bus) -> None:
    """The timer follows the earliest later wake, whatever order they were asked in."""
    wakes = await listen(bus)
    publisher = WakePublisher(bus)
    publisher.wake_later("late", 30)
    publisher.wake_later("soon", 0.1)
    await wait_until(lambda: wakes.queues() == ["soon"], within=5)
    assert publisher.later_pending == 1
    await publisher.aclose()


async def test_closing_drops_later_wakes(bus: Bus) -> None:
    wakes = await listen(bus)
    publisher = WakePublisher(bus)
    publisher.wake_later("dropped", 0.2)
    await publisher.aclose()
    assert publisher.later_pending == 0
    # A wake asked after the dropped one was due still goes out (the loop and the
    # connection are fine); the dropped one never does.
    await asyncio.sleep(0)  # let a wrongly kept timer's callback be scheduled
    other = WakePublisher(bus)
    other.wake_later("probe", 0.4)
    await wait_until(lambda: "probe" in wakes.queues(), within=5)
    assert "dropped" not in wakes.queues()
    await other.aclose()


async def test_later_wakes_past_the_horizon_are_left_to_the_sweep(bus: Bus) -> None:
    publisher = WakePublisher(bus)
    publisher.wake_later("far", WakePublisher.LATER_HORIZON + 1)
    publisher.wake_later("near", WakePublisher.LATER_HORIZON - 1)
    assert publisher.later_pending == 1
    await publisher.aclose()


async def test_later_wakes_past_the_cap_are_dropped(bus: Bus) -> None:
    publisher = WakePublisher(bus)
    publisher.MAX_LATER = 3
    for n in range(5):
        publisher.wake_later(f"q{n}", 60)
    assert publisher.later_pending == 3
    await publisher.aclose()


async def test_a_later_promote_hint_reaches_the_scheduler_once_due(bus: Bus) -> None:
    hints: list[float] = []

    async def on_hint(msg: Msg) -> None:
        assert msg.data == b""
        hints.append(time.monotonic())

    # Read straight off NATS, so the empty body is checked too.
    await bus.nc.subscribe(bus.subjects.promote(), cb=on_hint)
    await bus.nc.flush()
    publisher = WakePublisher(bus)
    asked = time.monotonic()
    for _ in range(5):
        publisher.promote_later(0.3)  # due together: one hint (two if a tick edge fell
    assert publisher.later_pending <= 2  # between the calls)
    await wait_until(lambda: publisher.later_pending == 0 and len(hints) >= 1, within=5)
    assert hints[0] - asked >= 0.3
    sent = len(hints)
    publisher.promote()
    await wait_until(lambda: len(hints) == sent + 1, within=5)
    await publisher.aclose()


async def test_promote_hints_have_their_own_cap(bus: Bus) -> None:
    """A stream of delayed tasks must not crowd out the retries' wakes."""
    publisher = WakePublisher(bus)
    publisher.MAX_LATER_PROMOTES = 3
    for n in range(10):
        publisher.promote_later(60 + n)
    assert publisher.later_pending == 3
    publisher.wake_later("retrying", 60)
    assert publisher.later_pending == 4
    await publisher.aclose()


async def test_when_due_hints_whoever_acts_on_the_task(bus: Bus, clock: FakeClock) -> None:
    """PENDING: its queue now; RETRY: its queue when the retry is due; SCHEDULED: the
    scheduler when it is due; anything else: nobody."""
    wakes = await listen(bus)
    promotes: list[float] = []

    await bus.subscribe_promote(lambda: promotes.append(time.monotonic()))
    await bus.nc.flush()
    broker = MemoryBroker(clock)
    now = clock.now()
    soon = timedelta(seconds=0.3)
    pending = (await broker.enqueue(NewTask("ready", "t"))).task
    scheduled = (await broker.enqueue(NewTask("later", "t", process_at=now + soon))).task
    await broker.enqueue(NewTask("retrying", "t"))
    (first,) = await broker.lease("retrying", 1, timedelta(seconds=30))
    retry = await broker.fail(first.id, first.lease_id or "", "boom", soon)
    await broker.enqueue(NewTask("finished", "t"))
    (second,) = await broker.lease("finished", 1, timedelta(seconds=30))
    completed = await broker.ack(second.id, second.lease_id or "")
    assert [t.state for t in (pending, scheduled, retry, completed)] == [
        TaskState.PENDING,
        TaskState.SCHEDULED,
        TaskState.RETRY,
        TaskState.COMPLETED,
    ]
    publisher = WakePublisher(bus)
    asked = time.monotonic()
    for task in (pending, scheduled, retry, completed):
        publisher.when_due(task, now)
    await wait_until(lambda: len(promotes) == 1 and "retrying" in wakes.queues(), within=5)
    assert promotes[0] - asked >= 0.3
    assert dict(wakes.seen)["retrying"] - asked >= 0.3
    assert wakes.queues() == ["ready", "retrying"]
    await publisher.aclose()


# ------------------------------------------------------------------ ResolvePublisher


async def test_the_ends_of_one_turn_go_out_as_one_resolve(bus: Bus, clock: FakeClock) -> None:
    heard: list[list[str]] = []

    def on_resolve(message: cluster_pb2.Resolve) -> None:
        heard.append(list(message.task_ids))

    await bus.subscribe(cluster_pb2.Resolve, on_resolve)
    wakes = await listen(bus)
    await bus.nc.flush()
    publisher = ResolvePublisher(bus, WakePublisher(bus))
    publisher(Resolution(pending=("a", "b")))
    publisher(Resolution(pending=("b", "c"), promoted={"q": 2}))
    await wait_until(lambda: heard == [["a", "b", "c"]] and wakes.queues() == ["q"], within=5)
    assert publisher.published == 3
    await publisher.aclose()


async def test_a_long_list_of_ends_is_split(bus: Bus) -> None:
    heard: list[int] = []
    await bus.subscribe(cluster_pb2.Resolve, lambda m: heard.append(len(m.task_ids)))
    await bus.nc.flush()
    publisher = ResolvePublisher(bus, WakePublisher(bus))
    publisher(Resolution(pending=tuple(f"t{n}" for n in range(ResolvePublisher.MAX_IDS + 5))))
    await wait_until(lambda: sorted(heard) == [5, ResolvePublisher.MAX_IDS], within=5)
    await publisher.aclose()


async def test_the_broker_reports_to_the_attached_publisher(bus: Bus, clock: FakeClock) -> None:
    heard: list[list[str]] = []
    await bus.subscribe(cluster_pb2.Resolve, lambda m: heard.append(list(m.task_ids)))
    await bus.nc.flush()
    broker = MemoryBroker(clock)

    def earlier(resolution: Resolution) -> None:
        """Another service's sink on the same broker (conveyor dev shares one)."""

    broker.set_dependency_sink(earlier)
    publisher = ResolvePublisher(bus, WakePublisher(bus))
    publisher.attach(broker)
    dep = (await broker.enqueue(NewTask("q", "t"))).task
    await broker.enqueue(NewTask("q", "t", depends_on=(dep.id,)))
    [leased] = await broker.lease("q", 1, timedelta(seconds=30))
    await broker.ack(leased.id, leased.lease_id or "")
    await wait_until(lambda: heard == [[dep.id]], within=5)
    publisher.detach(broker)
    assert broker.dependency_sink is earlier
    await publisher.aclose()
