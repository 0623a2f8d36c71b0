"""What a handler knows about the task it runs, and how it talks back."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from conveyor._payload import Codec, encode_value
from conveyor._worker.dependencies import DependencyResult

# Guards the lazy creation of a context's threading.Event against a concurrent cancel.
# Most runs never need the Event (only a sync handler waiting on cancellation does), and
# building one per delivery costs more than the rest of the context.
_EVENT_LOCK = threading.Lock()


class CancellationState:
    """The cooperative cancellation state of a handler's context (a :class:`TaskContext`
    or a :class:`BatchContext`): the flag, its reason, and an Event for sync handlers to
    block on, made only when one does."""

    __slots__ = ("_cancel_reason", "_cancelled", "_cancelled_event")

    def __init__(self) -> None:
        self._cancelled = False
        self._cancelled_event: threading.Event | None = None
        self._cancel_reason: str | None = None

    @property
    def cancelled(self) -> bool:
        """True once the run was cancelled (server Cancel, timeout, deadline or shutdown).

        Safe to read from any thread: sync handlers poll it to stop early.
        """
        return self._cancelled

    @property
    def cancel_reason(self) -> str | None:
        """Why the run was cancelled, or None while it was not."""
        return self._cancel_reason

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Block the calling thread until the run is cancelled or ``timeout`` seconds pass.

        Returns :attr:`cancelled`. Meant for sync handlers; an async handler must not
        call it (it would block the event loop).
        """
        with _EVENT_LOCK:
            event = self._cancelled_event
            if event is None:
                event = self._cancelled_event = threading.Event()
                if self._cancelled:
                    event.set()
        return event.wait(timeout)

    def _cancel(self, reason: str) -> None:
        with _EVENT_LOCK:
            if self._cancelled:
                return
            self._cancel_reason = reason
            self._cancelled = True
            if self._cancelled_event is not None:
                self._cancelled_event.set()
        self._on_cancel(reason)

    def _on_cancel(self, reason: str) -> None:
        """Called once, outside the lock, when the context is first cancelled."""


class TaskContext(CancellationState):
    """The second argument of every handler: the delivery being run.

    Attributes (read-only): ``task_id`` (also ``id``), ``queue``, ``type``, ``attempt``
    (1 for the first run), ``max_retry``, ``headers``, ``timeout`` (this attempt's bound,
    or None), ``deadline`` (the task's absolute deadline, or None), ``enqueued_at``,
    ``group`` and ``concurrency_key`` (None when unset).

    Cancellation is cooperative. An async handler is cancelled with asyncio cancellation;
    a sync handler (run in a thread) should poll :attr:`cancelled` or block in
    :meth:`wait_cancelled`. A cancelled handler's Result is not used.

    A task enqueued with ``depends_on`` reads what its dependencies returned with
    :meth:`dependency_results` (or everything about them with :meth:`dependencies`).
    """

    __slots__ = (
        "_codec",
        "_dependencies",
        "_emit_progress",
        "_lease_id",
        "_loop",
        "_loop_thread",
        "_read_dependencies",
        "attempt",
        "concurrency_key",
        "deadline",
        "enqueued_at",
        "group",
        "headers",
        "max_retry",
        "queue",
        "task_id",
        "timeout",
        "type",
    )

    def __init__(
        self,
        *,
        task_id: str,
        queue: str,
        type: str,
        attempt: int,
        max_retry: int,
        headers: Mapping[str, str],
        timeout: timedelta | None,
        deadline: datetime | None,
        enqueued_at: datetime | None,
        group: str | None,
        concurrency_key: str | None,
        lease_id: str,
        codec: Codec,
        emit_progress: Callable[[bytes], None],
        loop: asyncio.AbstractEventLoop,
        read_dependencies: Callable[[], Awaitable[list[DependencyResult]]] | None = None,
    ) -> None:
        self.task_id = task_id
        self.queue = queue
        self.type = type
        self.attempt = attempt
        self.max_retry = max_retry
        self.headers = headers
        self.timeout = timeout
        self.deadline = deadline
        self.enqueued_at = enqueued_at
        self.group = group
        self.concurrency_key = concurrency_key
        self._lease_id = lease_id
        self._codec = codec
        self._emit_progress = emit_progress
        self._loop = loop
        self._loop_thread = threading.get_ident()
        super().__init__()
        self._read_dependencies = read_dependencies
        self._dependencies: list[DependencyResult] | None = None

    @property
    def id(self) -> str:
        """The task's id: the same as :attr:`task_id`."""
        return self.task_id

    async def progress(self, value: Any) -> None:
        """Report progress (any value the worker's codec encodes); visible via get_task.

        Updates are coalesced: only the latest unsent value of a task is written.
        """
        self.set_progress(value)

    def set_progress(self, value: Any) -> None:
        """Report progress from any thread (the sync-handler twin of :meth:`progress`).

        Raises what the codec raises for a value it cannot encode.
        """
        data = encode_value(self._codec, value)
        if threading.get_ident() == self._loop_thread:
            self._emit_progress(data)
            return
        # A closed loop means the worker is gone: nobody is left to send the update to.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._emit_progress, data)

    async def dependencies(self) -> list[DependencyResult]:
        """Every dependency of this task, in the order it named them: state, decoded
        result and error (an empty list for a task without dependencies).

        Read from the server on the first call (a page of up to 100 at a time, under this
        delivery's lease) and kept for the run. Raises :class:`FailedPrecondition` once
        the lease is lost, and the SDK's other errors for a server it cannot reach.
        """
        if self._dependencies is None:
            read = self._read_dependencies
            self._dependencies = [] if read is None else await read()
        return list(self._dependencies)

    async def dependency_results(self) -> dict[str, Any]:
        """What the dependencies that completed returned (decoded by the worker's codec;
        None when one returned nothing), by task id, in the order the task named them.

        A dependency that did not complete (it failed and this task runs anyway, under
        ``on_failure="continue"``) is left out: :meth:`dependencies` has it with its
        error.
        """
        return {dep.task_id: dep.result for dep in await self.dependencies() if dep.completed}

    def dependency_results_blocking(self, timeout: float | None = None) -> dict[str, Any]:
        """:meth:`dependency_results` for a plain ``def`` handler (it runs in a thread):
        waits at most ``timeout`` seconds (TimeoutError past them). An async handler must
        ``await ctx.dependency_results()`` instead (RuntimeError here: waiting would block
        the event loop)."""
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError(
                "dependency_results_blocking() would block the event loop: "
                "await ctx.dependency_results() in an async handler"
            )
        future = asyncio.run_coroutine_threadsafe(self.dependency_results(), self._loop)
        return future.result(timeout)

    def __repr__(self) -> str:
        return (
            f"TaskContext(task_id={self.task_id!r}, type={self.type!r}, "
            f"queue={self.queue!r}, attempt={self.attempt})"
        )


class BatchContext(CancellationState):
    """The second argument of every batch handler: an aggregation group's batch.

    A batch handler (registered with :meth:`Worker.batch_task`) runs once for a whole
    batch; its first argument holds the members' decoded payloads, and ``tasks`` a
    :class:`TaskContext` per member in the same order (``batch.tasks[i].task_id``,
    ``.headers``, ``.attempt``...). ``len(batch)`` is the number of members the handler
    runs for.

    Attributes (read-only): ``queue``, ``group`` (the aggregation group), ``type``,
    ``lease_id`` (the one lease every member shares) and ``tasks``.

    Cancellation is cooperative and covers the whole batch (a server Cancel naming the
    batch's lease, its timeout, the worker's shutdown): an async handler is cancelled
    with asyncio cancellation; a sync handler should poll :attr:`cancelled` or block in
    :meth:`wait_cancelled`. Every member's context is cancelled along with it.
    """

    __slots__ = (
        "group",
        "lease_id",
        "queue",
        "tasks",
        "type",
    )

    def __init__(
        self, *, queue: str, group: str, type: str, lease_id: str, tasks: list[TaskContext]
    ) -> None:
        self.queue = queue
        self.group = group
        self.type = type
        self.lease_id = lease_id
        self.tasks = tasks
        super().__init__()

    def __len__(self) -> int:
        return len(self.tasks)

    def _on_cancel(self, reason: str) -> None:
        for task in self.tasks:
            task._cancel(reason)

    def __repr__(self) -> str:
        return (
            f"BatchContext(type={self.type!r}, queue={self.queue!r}, group={self.group!r}, "
            f"tasks={len(self.tasks)})"
        )
