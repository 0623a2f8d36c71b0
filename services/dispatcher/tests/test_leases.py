"""LeaseBatcher over a real (memory) broker: leases asked for together share a round trip."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from datetime import timedelta

import pytest
from conveyor_broker import FakeClock, NewTask, TaskState
from conveyor_broker.errors import BrokerError
from conveyor_broker.interface import MAX_BATCH
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.types import Task
from conveyor_dispatcher.leases import LeaseBatcher
from conveyor_testkit.polling import wait_until

TTL = timedelta(seconds=30)


class CountingBroker(MemoryBroker):
    """A MemoryBroker that counts its lease round trips."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.calls: list[str] = []
        self.fail_next = False
        #: When set, lease_many waits for it before leasing (a round trip in flight).
        self.hold: asyncio.Event | None = None

    async def lease(
        self,
        queue: str,
        limit: int,
        ttl: timedelta,
        *,
        holders: Sequence[str] = (),
        exclude_types: Collection[str] = (),
        only_types: Collection[str] | None = None,
    ) -> list[Task]:
        self.calls.append("lease")
        return await super().lease(
            queue,
            limit,
            ttl,
            holders=holders,
            exclude_types=exclude_types,
            only_types=only_types,
        )

    async def lease_many(
        self,
        wants: Sequence[tuple[str, int]],
        ttl: timedelta,
        *,
        holders: Sequence[Sequence[str]] = (),
    ) -> list[list[Task]]:
        self.calls.append("lease_many")
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_next:
            self.fail_next = False
            raise BrokerError("the database is down")
        return await super().lease_many(wants, ttl, holders=holders)


@pytest.fixture
async def broker() -> CountingBroker:
    b = CountingBroker(FakeClock())
    for queue in ("a", "b", "c"):
        await b.enqueue_batch([NewTask(queue, "t") for _ in range(5)])
    return b


async def test_leases_asked_for_together_share_one_round_trip(broker: CountingBroker) -> None:
    leaser = LeaseBatcher(broker)
    got = await asyncio.gather(
        leaser.lease("a", 2, TTL), leaser.lease("b", 5, TTL), leaser.lease("c", 1, TTL)
    )
    assert [len(tasks) for tasks in got] == [2, 5, 1]
    assert [{t.queue for t in tasks} for tasks in got] == [{"a"}, {"b"}, {"c"}]
    assert all(t.state is TaskState.ACTIVE for tasks in got for t in tasks)
    assert broker.calls == ["lease_many"]
    assert (leaser.rounds, leaser.asks) == (1, 3)


async def test_each_lease_keeps_its_holders_alone_or_in_a_round(
    broker: CountingBroker,
) -> None:
    leaser = LeaseBatcher(broker)
    [alone] = await asyncio.gather(leaser.lease("a", 2, TTL, ["api~1", "api~2"]))
    assert sorted(t.holder or "" for t in alone) == ["api~1", "api~2"]
    a, b, c = await asyncio.gather(
        leaser.lease("a", 1, TTL, ["api~3"]),
        leaser.lease("b", 2, TTL),
        leaser.lease("c", 3, TTL, ["api~4", "", "api~4"]),
    )
    assert broker.calls == ["lease", "lease_many"]
    assert [t.holder for t in a] == ["api~3"]
    assert [t.holder for t in b] == [None, None]
    assert sorted(t.holder or "" for t in c) == ["", "api~4", "api~4"]


async def test_a_lone_lease_is_a_plain_lease(broker: CountingBroker) -> None:
    leaser = LeaseBatcher(broker)
    assert len(await leaser.lease("a", 3, TTL)) == 3
    assert broker.calls == ["lease"]


async def test_asks_that_cannot_share_a_round_wait_for_the_next(broker: CountingBroker) -> None:
    """The same queue twice, or more than MAX_BATCH tasks in all, takes another round."""
    leaser = LeaseBatcher(broker)
    got = await asyncio.gather(
        leaser.lease("a", 2, TTL),
        leaser.lease("a", 2, TTL),
        leaser.lease("b", MAX_BATCH - 2, TTL),
        leaser.lease("c", 1, TTL),
    )
    assert [len(tasks) for tasks in got] == [2, 2, 5, 1]
    ids = [t.id for tasks in got for t in tasks]
    assert len(ids) == len(set(ids))
    assert leaser.rounds == 2


async def test_a_broker_error_reaches_every_caller_of_the_round(broker: CountingBroker) -> None:
    leaser = LeaseBatcher(broker)
    broker.fail_next = True
    results = await asyncio.gather(
        leaser.lease("a", 1, TTL), leaser.lease("b", 1, TTL), return_exceptions=True
    )
    assert all(isinstance(r, BrokerError) for r in results)
    # The next round works, and nothing was leased by the failed one.
    got = await asyncio.gather(leaser.lease("a", 5, TTL), leaser.lease("b", 5, TTL))
    assert [len(tasks) for tasks in got] == [5, 5]


async def test_a_caller_that_left_before_its_round_gets_nothing_leased(
    broker: CountingBroker,
) -> None:
    leaser = LeaseBatcher(broker)
    gone = asyncio.ensure_future(leaser.lease("a", 3, TTL))
    kept = asyncio.ensure_future(leaser.lease("b", 1, TTL))
    await asyncio.sleep(0)  # both asked; the round trip has not run yet
    gone.cancel()
    assert len(await kept) == 1
    await leaser.aclose()
    (stats,) = await broker.queue_stats("a")
    assert stats.count(TaskState.PENDING) == 5


async def test_tasks_leased_for_a_caller_that_left_meanwhile_go_back(
    broker: CountingBroker,
) -> None:
    leaser = LeaseBatcher(broker)
    broker.hold = asyncio.Event()
    gone = asyncio.ensure_future(leaser.lease("a", 3, TTL))
    kept = asyncio.ensure_future(leaser.lease("b", 1, TTL))
    await wait_until(lambda: broker.calls == ["lease_many"])  # in flight
    gone.cancel()
    broker.hold.set()
    assert len(await kept) == 1
    await leaser.aclose()
    (stats,) = await broker.queue_stats("a")
    assert stats.count(TaskState.PENDING) == 5
    assert stats.count(TaskState.ACTIVE) == 0
