"""Group commit units: per-caller answers from shared commits, and how batches are cut."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta

import pytest
from conveyor_broker import (
    MAX_BATCH,
    AckItem,
    BrokerError,
    DuplicateTask,
    EnqueueResult,
    FakeClock,
    InvalidTask,
    NewTask,
    TaskState,
)
from conveyor_gateway.group_commit import AckBatcher, EnqueueCommitter
from conveyor_testkit.brokers import CountingBroker

_TTL = timedelta(seconds=30)


class FlakyBroker(CountingBroker):
    """Refuses enqueue batches as a whole (the database is down) while ``down`` is set."""

    def __init__(self) -> None:
        super().__init__(FakeClock())
        self.down = False

    async def enqueue_batch(self, tasks: Sequence[NewTask]) -> list[EnqueueResult]:
        if self.down:
            raise ConnectionError("database is down")
        return await super().enqueue_batch(tasks)


async def test_enqueue_many_answers_every_item_in_order() -> None:
    broker = CountingBroker(FakeClock())
    committer = EnqueueCommitter(broker, window=60, max_items=500)
    tasks = [NewTask("q", "t", payload=str(i).encode()) for i in range(1200)]
    outcomes = await committer.enqueue_many(tasks)
    assert [o.task.payload for o in outcomes if isinstance(o, EnqueueResult)] == [
        t.payload for t in tasks
    ]
    # Cut at max_items, each chunk a commit of its own.
    assert broker.enqueue_batch_sizes == [500, 500, 200]


async def test_an_item_refused_alone_does_not_spoil_the_others() -> None:
    broker = CountingBroker(FakeClock())
    committer = EnqueueCommitter(broker, window=60, max_items=500)
    tasks = [NewTask("q", "t", unique_key="same") for _ in range(3)]
    tasks += [NewTask("q", "t") for _ in range(5)]
    outcomes = await committer.enqueue_many(tasks)
    first, *dups = outcomes[:3]
    assert isinstance(first, EnqueueResult)
    assert first.created
    assert all(isinstance(d, DuplicateTask) for d in dups)
    assert all(isinstance(o, EnqueueResult) and o.created for o in outcomes[3:])
    [stats] = await broker.queue_stats("q")
    assert stats.count(TaskState.PENDING) == 6


class PickyBroker(CountingBroker):
    """Refuses, past validation (as a database would), any batch holding a task of type
    ``poison``: the whole commit fails with InvalidTask, as the Postgres broker's does
    when the database refuses a value."""

    def __init__(self) -> None:
        super().__init__(FakeClock())

    async def _enqueue_batch(self, tasks: Sequence[NewTask]) -> list[EnqueueResult]:
        if any(task.type == "poison" for task in tasks):
            raise InvalidTask("the database refused a value: poison")
        return await super()._enqueue_batch(tasks)


async def test_an_item_the_broker_refuses_fails_alone_among_concurrent_callers() -> None:
    broker = PickyBroker()
    committer = EnqueueCommitter(broker, window=60, max_items=500)
    # A commit in flight: everything below gathers behind it into one shared batch.
    first = asyncio.ensure_future(committer.enqueue(NewTask("q", "first")))
    await asyncio.sleep(0)
    singles = [committer.enqueue(NewTask("q", f"single-{n}")) for n in range(100)]
    poisoned = committer.enqueue(NewTask("q", "poison"))
    many = committer.enqueue_many([NewTask("q", f"many-{n}") for n in range(50)])
    *results, refused, outcomes = await asyncio.gather(
        *singles, poisoned, many, return_exceptions=True
    )
    await first
    assert isinstance(refused, InvalidTask)
    assert "poison" in str(refused)
    assert all(isinstance(r, EnqueueResult) and r.created for r in results)
    assert isinstance(outcomes, list)
    assert all(isinstance(o, EnqueueResult) and o.created for o in outcomes)
    [stats] = await broker.queue_stats("q")
    assert stats.count(TaskState.PENDING) == 1 + 100 + 50
    # One shared batch of 151, then halves down to the poisoned item: about 2 log2(151)
    # commits, not one per caller.
    assert broker.enqueue_batch_sizes[:2] == [1, 151]
    assert len(broker.enqueue_batch_sizes) <= 2 + 2 * 8, broker.enqueue_batch_sizes


async def test_a_failed_commit_is_each_callers_error() -> None:
    broker = FlakyBroker()
    committer = EnqueueCommitter(broker, window=60, max_items=500)
    broker.down = True
    outcomes = await committer.enqueue_many([NewTask("q", "t") for _ in range(3)])
    assert all(isinstance(o, ConnectionError) for o in outcomes)
    assert not any(isinstance(o, BrokerError) for o in outcomes)
    with pytest.raises(ConnectionError):
        await committer.enqueue(NewTask("q", "t"))
    broker.down = False
    assert (await committer.enqueue(NewTask("q", "t"))).created


async def test_acks_of_many_callers_share_commits_and_get_their_own_answers() -> None:
    broker = CountingBroker(FakeClock())
    for _ in range(3):
        await broker.enqueue_batch([NewTask("q", "t") for _ in range(500)])
    leased = await broker.lease("q", 1000, ttl=_TTL)
    leased += await broker.lease("q", 500, ttl=_TTL)
    acks = AckBatcher(broker)
    items = [AckItem(t.id, t.lease_id or "") for t in leased]
    items[7] = AckItem(items[7].task_id, "not-the-lease")
    # Three callers in the same loop turn: their 1500 items go in two commits (at most
    # MAX_BATCH each, never splitting one caller's group unless it is itself too big).
    answers = await asyncio.gather(
        acks.ack_many(items[:400]), acks.ack_many(items[400:1200]), acks.ack(items[1200])
    )
    assert answers[0] == [i != 7 for i in range(400)]
    assert answers[1] == [True] * 800
    assert answers[2] is True
    assert broker.ack_batch_sizes == [400, 801]
    assert all(size <= MAX_BATCH for size in broker.ack_batch_sizes)
    rest = await acks.ack_many(items[1201:])
    assert rest == [True] * 299
