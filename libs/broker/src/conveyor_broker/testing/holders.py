"""Conformance: holders (who holds each lease), their beats, and release_dead_holders."""

from __future__ import annotations

from datetime import timedelta

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import BrokerClosed, InvalidTask, LeaseLost
from conveyor_broker.interface import MAX_BATCH, Broker
from conveyor_broker.testing.builders import OTHER_QUEUE, QUEUE, TTL, enqueue, new_task
from conveyor_broker.types import (
    HolderReleaseParams,
    ReleasedTask,
    Task,
    TaskEvent,
    TaskState,
)
from conveyor_broker.validation import MAX_HOLDER_LEN

SILENCE = timedelta(seconds=3)
_SECOND = timedelta(seconds=1)


def _dead(limit: int = 1000, alive: frozenset[str] = frozenset()) -> HolderReleaseParams:
    return HolderReleaseParams(silence=SILENCE, alive=alive, limit=limit)


async def _enqueue_spread(broker: Broker, clock: FakeClock, n: int, queue: str = QUEUE) -> None:
    """``n`` due tasks of ``queue``, each available a millisecond after the one before (so
    lease order is enqueue order)."""
    for _ in range(n):
        await enqueue(broker, queue)
        clock.advance(timedelta(milliseconds=1))


class HolderTests:
    """lease(holders=...), lease_many(holders=...), beat_holder, release_dead_holders."""

    async def test_lease_records_the_holders(self, broker: Broker, clock: FakeClock) -> None:
        await _enqueue_spread(broker, clock, 5)
        # Fewer holders than tasks: the rest are held by nobody ("" is nobody too).
        leased = await broker.lease(QUEUE, 5, TTL, holders=["a", "b", "a", ""])
        assert sorted(t.holder or "" for t in leased) == ["", "", "a", "a", "b"]
        for task in leased:
            assert (await broker.get_task(task.id)).holder == task.holder
        # Fewer tasks than holders: the first ones are used.
        await _enqueue_spread(broker, clock, 2)
        two = await broker.lease(QUEUE, 3, TTL, holders=["c", "d", "e"])
        assert sorted(t.holder or "" for t in two) == ["c", "d"]
        await _enqueue_spread(broker, clock, 1)
        [nobody] = await broker.lease(QUEUE, 1, TTL)
        assert nobody.holder is None

    async def test_lease_many_records_each_queues_holders(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await _enqueue_spread(broker, clock, 2, QUEUE)
        await _enqueue_spread(broker, clock, 1, OTHER_QUEUE)
        mine, other = await broker.lease_many(
            [(QUEUE, 3), (OTHER_QUEUE, 2)], TTL, holders=[["a", "b", "c"], ["d"]]
        )
        assert sorted(t.holder or "" for t in mine) == ["a", "b"]
        assert [t.holder for t in other] == ["d"]
        # Fewer holder lists than queues: the rest are held by nobody.
        await _enqueue_spread(broker, clock, 1, QUEUE)
        await _enqueue_spread(broker, clock, 1, OTHER_QUEUE)
        mine, other = await broker.lease_many([(QUEUE, 5), (OTHER_QUEUE, 5)], TTL, holders=[[]])
        assert [t.holder for t in mine + other] == [None, None]

    async def test_a_dead_holders_tasks_are_released_without_spending_an_attempt(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.enqueue_batch([new_task(max_retry=0) for _ in range(3)])
        await broker.beat_holder("api-a")
        await broker.beat_holder("api-b")
        leased = await broker.lease(QUEUE, 3, TTL, holders=["api-a", "api-b", ""])
        by_holder = {t.holder: t for t in leased}
        clock.advance(SILENCE - _SECOND)
        await broker.beat_holder("api-b")
        # api-a's last beat is not silence old yet: nobody is dead.
        assert await broker.release_dead_holders(_dead()) == []
        clock.advance(_SECOND)
        events: list[TaskEvent] = []
        broker.set_event_sink(events.append)
        released = await broker.release_dead_holders(_dead())
        broker.set_event_sink(None)
        gone = by_holder["api-a"]
        assert released == [ReleasedTask(task_id=gone.id, queue=QUEUE, holder="api-a")]
        assert [(e.task_id, e.previous_state, e.state) for e in events] == [
            (gone.id, TaskState.ACTIVE, TaskState.PENDING)
        ]
        stored = await broker.get_task(gone.id)
        assert stored.state == TaskState.PENDING
        assert stored.retried == 0  # no attempt spent: max_retry=0 and it runs again
        assert stored.last_error is None
        assert stored.lease_id is None
        assert stored.lease_expires_at is None
        assert stored.holder is None
        assert stored.available_at == clock.now()
        # The worker's late outcome finds its lease gone, as after any lost lease.
        with pytest.raises(LeaseLost):
            await broker.ack(gone.id, gone.lease_id or "")
        # api-b is alive, and nobody holds the third: both stay ACTIVE.
        for holder in ("api-b", None):
            assert (await broker.get_task(by_holder[holder].id)).state == TaskState.ACTIVE
        again = await broker.lease(QUEUE, 3, TTL)
        assert [t.id for t in again] == [gone.id]

    async def test_only_the_dead_holders_tasks_are_released(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await _enqueue_spread(broker, clock, 2, QUEUE)
        await _enqueue_spread(broker, clock, 2, OTHER_QUEUE)
        await broker.beat_holder("a")
        await broker.beat_holder("b")
        mine, other = await broker.lease_many(
            [(QUEUE, 2), (OTHER_QUEUE, 2)], TTL, holders=[["a", "b"], ["b", "a"]]
        )
        clock.advance(SILENCE)
        await broker.beat_holder("b")
        released = await broker.release_dead_holders(_dead())
        held_by_a = {(t.id, t.queue) for t in mine + other if t.holder == "a"}
        assert len(held_by_a) == 2
        assert {(r.task_id, r.queue) for r in released} == held_by_a
        assert {r.holder for r in released} == {"a"}
        for task in mine + other:
            state = (await broker.get_task(task.id)).state
            assert state == (TaskState.PENDING if task.holder == "a" else TaskState.ACTIVE)

    async def test_a_holder_that_never_beat_is_not_dead(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue(broker)
        await broker.lease(QUEUE, 1, TTL, holders=["ghost"])
        clock.advance(TTL / 2)
        assert await broker.release_dead_holders(_dead()) == []
        assert (await broker.get_task(task.id)).state == TaskState.ACTIVE

    async def test_a_holder_heard_otherwise_is_spared(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue(broker)
        await broker.beat_holder("a")
        await broker.lease(QUEUE, 1, TTL, holders=["a"])
        clock.advance(SILENCE * 2)
        assert await broker.release_dead_holders(_dead(alive=frozenset({"a", "z"}))) == []
        assert (await broker.get_task(task.id)).state == TaskState.ACTIVE
        released = await broker.release_dead_holders(_dead(alive=frozenset({"z"})))
        assert [r.task_id for r in released] == [task.id]

    async def test_a_beat_keeps_a_holder_alive(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue(broker)
        await broker.beat_holder("a")
        await broker.lease(QUEUE, 1, TTL, holders=["a"])
        for _ in range(5):
            clock.advance(SILENCE - _SECOND)
            await broker.beat_holder("a")
            assert await broker.release_dead_holders(_dead()) == []
        assert (await broker.get_task(task.id)).state == TaskState.ACTIVE

    async def test_a_dead_holder_is_forgotten_once_it_holds_nothing(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await _enqueue_spread(broker, clock, 3)
        await broker.beat_holder("a")
        first = await broker.lease(QUEUE, 1, TTL, holders=["a"])
        clock.advance(SILENCE)
        assert [r.task_id for r in await broker.release_dead_holders(_dead())] == [first[0].id]
        # That call found it holding a task: it is still known (and dead).
        second = await broker.lease(QUEUE, 1, TTL, holders=["a"])
        assert [r.task_id for r in await broker.release_dead_holders(_dead())] == [second[0].id]
        assert await broker.release_dead_holders(_dead()) == []  # holds nothing: forgotten
        # Forgotten, it is as a holder that never beat: its tasks wait for lease expiry.
        third = await broker.lease(QUEUE, 1, TTL, holders=["a"])
        clock.advance(SILENCE)
        assert await broker.release_dead_holders(_dead()) == []
        assert (await broker.get_task(third[0].id)).state == TaskState.ACTIVE
        # Until it beats again.
        await broker.beat_holder("a")
        clock.advance(SILENCE)
        assert [r.task_id for r in await broker.release_dead_holders(_dead())] == [third[0].id]

    async def test_release_takes_the_oldest_lease_expiry_first_up_to_the_limit(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await _enqueue_spread(broker, clock, 3)
        await broker.beat_holder("a")
        late = await broker.lease(QUEUE, 1, TTL * 2, holders=["a"])
        assert late[0].holder == "a"
        early = await broker.lease(QUEUE, 2, TTL, holders=["a", "a"])
        clock.advance(SILENCE)
        first = await broker.release_dead_holders(_dead(limit=2))
        assert [r.task_id for r in first] == sorted(t.id for t in early)
        rest = await broker.release_dead_holders(_dead(limit=2))
        assert [r.task_id for r in rest] == [late[0].id]

    async def test_ending_a_lease_ends_its_holding(self, broker: Broker, clock: FakeClock) -> None:
        tasks = [await enqueue(broker, max_retry=5) for _ in range(4)]
        await broker.beat_holder("a")
        leased = {t.id: t for t in await broker.lease(QUEUE, 4, TTL, holders=["a"] * 4)}
        a, b, c, d = (leased[t.id] for t in tasks)
        await broker.ack(a.id, a.lease_id or "")
        await broker.fail(b.id, b.lease_id or "", "boom", timedelta(0))
        await broker.release(c.id, c.lease_id or "")
        await broker.cancel_task(d.id)
        for task in (a, b, c, d):
            assert (await broker.get_task(task.id)).holder is None
        # Leased again, by nobody: the earlier holder is no longer theirs.
        again = await broker.lease(QUEUE, 4, TTL)
        assert {(t.id, t.holder) for t in again} == {(b.id, None), (c.id, None)}
        clock.advance(SILENCE)
        assert await broker.release_dead_holders(_dead()) == []
        for task in again:
            assert (await broker.get_task(task.id)).state == TaskState.ACTIVE

    async def test_a_task_leased_again_by_nobody_is_held_by_nobody(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue(broker)
        await broker.beat_holder("a")
        await broker.lease(QUEUE, 1, TTL, holders=["a"])
        clock.advance(TTL)
        assert len(await broker.reap_expired_leases()) == 1
        leased: list[Task] = await broker.lease(QUEUE, 1, TTL)
        assert [(t.id, t.holder) for t in leased] == [(task.id, None)]
        assert await broker.release_dead_holders(_dead()) == []
        assert (await broker.get_task(task.id)).state == TaskState.ACTIVE

    async def test_holders_reject_bad_input(self, broker: Broker) -> None:
        await broker.enqueue(new_task())
        bad_holders: list[object] = [
            ["a", "b"],  # more than the limit (1)
            "a",  # one name, not a sequence of them
            ["x" * (MAX_HOLDER_LEN + 1)],
            ["api\n1"],
        ]
        for holders in bad_holders:
            with pytest.raises(InvalidTask):
                await broker.lease(QUEUE, 1, TTL, holders=holders)  # type: ignore[arg-type]
        with pytest.raises(InvalidTask):
            await broker.lease_many([(QUEUE, 1)], TTL, holders=[["a"], ["b"]])
        with pytest.raises(InvalidTask):
            await broker.lease_many([(QUEUE, 1)], TTL, holders=[["a", "b"]])
        # Nothing was leased by any of them.
        assert await broker.pending_count() == {QUEUE: 1}
        for name in ("", "x" * (MAX_HOLDER_LEN + 1), "a\x00b"):
            with pytest.raises(InvalidTask):
                await broker.beat_holder(name)
        for params in (
            HolderReleaseParams(silence=timedelta(0)),
            HolderReleaseParams(silence=SILENCE, limit=0),
            HolderReleaseParams(silence=SILENCE, limit=MAX_BATCH + 1),
            HolderReleaseParams(silence=SILENCE, alive=frozenset({""})),
        ):
            with pytest.raises(InvalidTask):
                await broker.release_dead_holders(params)

    async def test_holder_calls_on_a_closed_broker_raise(self, broker: Broker) -> None:
        await broker.close()
        with pytest.raises(BrokerClosed):
            await broker.beat_holder("a")
        with pytest.raises(BrokerClosed):
            await broker.release_dead_holders(_dead())
