"""Small helpers the conformance tests use to put a broker into a given state.

They only call the public Broker interface, so they work against every implementation.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from conveyor_broker.clock import FakeClock
from conveyor_broker.ids import new_id
from conveyor_broker.interface import Broker
from conveyor_broker.types import NewTask, Task, TaskState

QUEUE = "default"
OTHER_QUEUE = "other"
TYPE = "email.send"
#: Lease TTL used when a test does not care.
TTL = timedelta(seconds=30)


def new_task(queue: str = QUEUE, **options: Any) -> NewTask:
    """A NewTask for ``queue`` with ``options`` (``type`` defaults to TYPE)."""
    options.setdefault("type", TYPE)
    return NewTask(queue=queue, **options)


async def enqueue(broker: Broker, queue: str = QUEUE, **options: Any) -> Task:
    """Enqueue one new task and return it (asserting it was created)."""
    result = await broker.enqueue(new_task(queue, **options))
    assert result.created
    return result.task


async def lease_one(broker: Broker, queue: str = QUEUE, ttl: timedelta = TTL) -> Task:
    """Lease exactly one task of ``queue`` (asserting there was one)."""
    leased = await broker.lease(queue, 1, ttl)
    assert len(leased) == 1, f"expected one due task in {queue!r}, got {len(leased)}"
    assert leased[0].state == TaskState.ACTIVE
    return leased[0]


async def enqueue_and_lease(broker: Broker, queue: str = QUEUE, **options: Any) -> Task:
    """Enqueue a due task and lease it; return the ACTIVE task. ``queue`` must have no
    other due task."""
    task = await enqueue(broker, queue, **options)
    leased = await lease_one(broker, queue)
    assert leased.id == task.id
    return leased


def sorted_ids(clock: FakeClock, count: int) -> list[str]:
    """``count`` distinct fresh ULIDs in ascending order."""
    ids: set[str] = set()
    while len(ids) < count:
        ids.add(new_id(clock.now()))
    return sorted(ids)


def unused_id(clock: FakeClock) -> str:
    """A well-formed id that no stored task has (fresh ULIDs never collide)."""
    return new_id(clock.now())
