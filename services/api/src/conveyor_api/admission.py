"""Enqueue admission: backpressure on producers when a queue's backlog is past its limit.

Past the machine's capacity, every task accepted adds enqueue work (conversion, commit,
index upkeep) that takes CPU from the dispatch and ack path: the more is offered, the
fewer tasks start (congestion collapse). With ``CONVEYOR_ENQUEUE_BACKLOG_LIMIT`` set, a
queue holding that many due tasks (what ``lease`` would pick now) takes no new task
until its backlog falls under the limit: an enqueue waits for that, up to
``CONVEYOR_ENQUEUE_ADMISSION_WAIT`` seconds, and is then refused with RESOURCE_EXHAUSTED
(per item in an EnqueueBatch; the whole call for Enqueue and EnqueueTx). So once the
backlog is full, the producers are slowed to the rate tasks start, and the started rate
holds as the offered load rises.

The backlog is read with ``broker.due_count(queue, cap=limit)``, whose cost follows the
limit, not the backlog: at most once per ``interval`` per queue and api process, shared by
every caller meanwhile; between two reads the tasks admitted are added to the last count,
so a burst cannot overshoot the limit by more than one read's worth of other processes'
enqueues. The limit is a bound of the backlog, not an exact cap: several api processes
each count their own admissions between reads. A read that fails admits (the commit that
follows reports the database's state itself).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from conveyor_broker import Broker, QueueFull

logger = logging.getLogger(__name__)

#: Queues whose last read is kept; past it the reads are forgotten (and redone).
MAX_TRACKED = 4096


def backlog_full(queue: str) -> str:
    """The message of a task refused because ``queue`` stayed at its backlog limit."""
    return (
        f"queue {queue!r} is at its backlog limit (CONVEYOR_ENQUEUE_BACKLOG_LIMIT due "
        "tasks) and stayed there for CONVEYOR_ENQUEUE_ADMISSION_WAIT: retry later"
    )


@dataclass(slots=True)
class _Reading:
    """A queue's due tasks as last read (plus what was admitted since), and when."""

    at: float
    due: int


class Admission:
    """Holds an enqueue back while its queue's backlog is at or past ``limit`` (0: never);
    see the module docstring."""

    def __init__(self, broker: Broker, *, limit: int, wait: float, interval: float = 0.25) -> None:
        self._broker = broker
        self.limit = limit
        self._wait = wait
        self._interval = interval
        self._readings: dict[str, _Reading] = {}
        self._reads: dict[str, asyncio.Future[int]] = {}

    @property
    def enabled(self) -> bool:
        """Whether a limit is set."""
        return self.limit > 0

    async def admit(self, queue: str, n: int = 1) -> None:
        """Return once ``queue`` may take ``n`` more tasks; QueueFull when its backlog
        stays at the limit for the whole wait."""
        if self.limit <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait
        while True:
            await self._due(queue, loop.time())
            # The reading as it is now: the callers that shared one read each add theirs.
            reading = self._readings[queue]
            if reading.due < self.limit:
                reading.due += n
                return
            left = deadline - loop.time()
            if left <= 0:
                raise QueueFull(backlog_full(queue))
            # Until the next read: the backlog is what only the workers can shrink.
            await asyncio.sleep(min(self._interval, left))

    async def admit_each(self, counts: Mapping[str, int]) -> set[str]:
        """Admit several queues at once (``queue -> tasks``); the queues refused."""
        outcomes = await asyncio.gather(
            *(self.admit(queue, n) for queue, n in counts.items()), return_exceptions=True
        )
        refused: set[str] = set()
        for queue, outcome in zip(counts, outcomes, strict=True):
            if isinstance(outcome, QueueFull):
                refused.add(queue)
            elif isinstance(outcome, BaseException):
                raise outcome
        return refused

    async def _due(self, queue: str, now: float) -> int:
        reading = self._readings.get(queue)
        if reading is not None and now - reading.at < self._interval:
            return reading.due
        read = self._reads.get(queue)
        if read is None:
            read = asyncio.ensure_future(self._read(queue))
            self._reads[queue] = read
            read.add_done_callback(lambda _: self._reads.pop(queue, None))
        return await asyncio.shield(read)

    async def _read(self, queue: str) -> int:
        loop = asyncio.get_running_loop()
        try:
            due = await self._broker.due_count(queue, cap=self.limit)
        except Exception as exc:  # the commit that follows says what is wrong
            logger.warning("admission.read_failed queue=%s error=%r", queue, exc)
            due = 0
        if len(self._readings) >= MAX_TRACKED and queue not in self._readings:
            self._readings.clear()
        self._readings[queue] = _Reading(loop.time(), due)
        return due
