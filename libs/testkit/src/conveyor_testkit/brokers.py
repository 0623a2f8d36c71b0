"""Brokers for tests: a MemoryBroker that counts the batch calls made to it."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor_broker import AckItem, EnqueueResult, FakeClock, NewTask
from conveyor_broker.memory import MemoryBroker


class CountingBroker(MemoryBroker):
    """A MemoryBroker that counts the batch calls the api makes."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.enqueue_batch_sizes: list[int] = []
        self.ack_batch_sizes: list[int] = []
        #: The queues of the ``due_count`` calls (the api's admission reads).
        self.due_counts: list[str] = []

    async def enqueue_batch(self, tasks: Sequence[NewTask]) -> list[EnqueueResult]:
        self.enqueue_batch_sizes.append(len(tasks))
        return await super().enqueue_batch(tasks)

    async def due_count(self, queue: str, *, cap: int) -> int:
        self.due_counts.append(queue)
        return await super().due_count(queue, cap=cap)

    async def ack_batch(self, items: Sequence[AckItem]) -> list[bool]:
        self.ack_batch_sizes.append(len(items))
        return await super().ack_batch(items)
