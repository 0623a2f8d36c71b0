"""The handler slots of a running worker, shared by its sessions in turn, and its stop
request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from datetime import timedelta

from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb

from conveyor._payload import Codec
from conveyor._worker.batch import BatchExecution, BatchOrigin, BatchRegistration
from conveyor._worker.execution import Execution, Origin, Registration

#: What takes a slot: one delivery, or one aggregation-group batch (however many members).
Running = Execution | BatchExecution


class Slots:
    """The deliveries one run of a worker is running, at most ``concurrency`` at once.

    A delivery holds its slot from :meth:`start` until its handler and any handler thread
    are done, even when the session it came on has ended meanwhile: the handlers of a
    broken session keep running, and the next session only gets the free slots. A batch
    (a BatchDispatch) takes one slot for all its members.
    ``on_free`` is called each time a slot frees.

    Once :meth:`stop` was called the worker is stopping: its sessions take nothing new,
    and :meth:`drained` waits for the running handlers, within the grace period.
    """

    def __init__(
        self,
        *,
        concurrency: int,
        codec: Codec,
        pool: concurrent.futures.Executor,
        on_free: Callable[[], None],
    ) -> None:
        self.concurrency = concurrency
        self._codec = codec
        self._pool = pool
        self._on_free = on_free
        self._executions: dict[tuple[str, str], Running] = {}
        #: The running batches, by their shared lease id.
        self._batches: dict[str, BatchExecution] = {}
        self._changed = asyncio.Event()
        self._stop = asyncio.Event()
        #: True once :meth:`stop` was called.
        self.stopping = False
        #: True once a stop skipped the grace period.
        self.forced = False
        self._grace_deadline: float | None = None

    # ------------------------------------------------------------- the deliveries

    @property
    def running(self) -> int:
        """How many slots are taken (handlers still finishing in a thread included)."""
        return len(self._executions)

    @property
    def full(self) -> bool:
        """True when no slot is free."""
        return len(self._executions) >= self.concurrency

    def get(self, key: tuple[str, str]) -> Running | None:
        """The running delivery ``key`` (task id, lease id), if any (a batch by its first
        member's task id)."""
        return self._executions.get(key)

    def get_batch(self, lease_id: str) -> BatchExecution | None:
        """The running batch under ``lease_id``, if any."""
        return self._batches.get(lease_id)

    def find(self, task_id: str) -> Running | None:
        """A running delivery of task ``task_id`` (or a batch holding it), whatever its
        lease."""
        return next((e for e in self._executions.values() if e.has_task(task_id)), None)

    def executions(self) -> list[Running]:
        """Every running delivery and batch."""
        return list(self._executions.values())

    def start(self, envelope: pb.TaskEnvelope, registration: Registration, origin: Origin) -> None:
        """Run a delivery that came on session ``origin`` with ``registration``'s handler;
        it takes a slot (the caller checked that one is free)."""
        execution = Execution(envelope, registration, origin, self._codec)
        self._executions[execution.key] = execution
        execution.start(self._pool, self._finished)

    def start_batch(
        self, batch: svc.BatchDispatch, registration: BatchRegistration, origin: BatchOrigin
    ) -> None:
        """Run a batch that came on session ``origin`` with ``registration``'s handler; it
        takes one slot (the caller checked that one is free)."""
        execution = BatchExecution(batch, registration, origin, self._codec)
        self._executions[execution.key] = execution
        self._batches[execution.lease_id] = execution
        execution.start(self._pool, self._finished)

    def _finished(self, execution: Running) -> None:
        if self._executions.get(execution.key) is not execution:
            return
        del self._executions[execution.key]
        if isinstance(execution, BatchExecution):
            self._batches.pop(execution.lease_id, None)
        self._notify()
        self._on_free()

    # ------------------------------------------------------------ the stop request

    def stop(self, *, force: bool, grace_period: timedelta) -> None:
        """Begin stopping (the grace period starts with the first call); ``force`` ends
        the grace period at once. Safe to call again."""
        if force:
            self.forced = True
        if not self.stopping:
            loop = asyncio.get_running_loop()
            self._grace_deadline = loop.time() + grace_period.total_seconds()
        self.stopping = True
        self._stop.set()
        self._notify()

    async def stopped(self) -> None:
        """Return once :meth:`stop` was called."""
        await self._stop.wait()

    async def wait_changed(self, limit: float | None) -> None:
        """Return when a slot frees or a stop is asked for, or after ``limit`` seconds."""
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), limit)

    def _notify(self) -> None:
        self._changed.set()

    async def drained(self) -> None:
        """Wait until every handler finished, or the grace period that began with the stop
        request is over (at once when forced; no wait when no stop was asked for)."""
        loop = asyncio.get_running_loop()
        deadline = self._grace_deadline
        if deadline is None:
            return
        while self._executions and not self.forced:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            await self.wait_changed(remaining)
