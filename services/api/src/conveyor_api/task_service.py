"""TaskService: the producer API (Enqueue, EnqueueBatch, EnqueueTx, GetTask)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import grpc
from conveyor_broker import (
    MAX_BATCH,
    Broker,
    BrokerError,
    DatabaseUnavailable,
    DuplicateTask,
    EnqueueResult,
    InvalidTask,
    NewTask,
    NotSupported,
    QueueFull,
)
from conveyor_broker.clock import Clock
from conveyor_broker.validation import check_queue, check_task_id
from conveyor_gateway import EnqueueCommitter, WakePublisher
from conveyor_protos.v1 import service_pb2, service_pb2_grpc
from conveyor_runtime import metrics
from conveyor_runtime.wire import TaskDefaults, TaskProtos, new_task_from_request, task_to_proto

from conveyor_api.admission import Admission, backlog_full
from conveyor_api.broker_status import abort_for_error, status_code_of, status_message
from conveyor_api.tracing import commit_span, stamp_tasks

logger = logging.getLogger(__name__)

#: A big EnqueueBatch converts its items in runs of this many, yielding to the event loop
#: between runs: worker sessions share this loop, and a thousand conversions in one go
#: would hold their dispatches and acks up for tens of milliseconds.
YIELD_EVERY = 100

if TYPE_CHECKING:
    _Context = grpc.aio.ServicerContext[Any, Any]


def wake_for(results: Sequence[EnqueueResult], wakes: WakePublisher, clock: Clock) -> None:
    """Hint the created tasks' due time: their queues' dispatchers for the PENDING ones,
    the scheduler (when they fall due) for the SCHEDULED ones."""
    now = clock.now()
    # The tasks of a batch mostly share their queue, state and due time: hint each
    # combination once (the publisher coalesces repeats anyway, at a call per task).
    hinted: set[tuple[str, str, datetime]] = set()
    for result in results:
        if result.created:
            task = result.task
            key = (task.queue, task.state, task.available_at)
            if key not in hinted:
                hinted.add(key)
                wakes.when_due(task, now)


class TaskService(service_pb2_grpc.TaskServiceServicer):
    """Validates producer requests and commits them (group-committed for Enqueue)."""

    def __init__(
        self,
        broker: Broker,
        clock: Clock,
        defaults: TaskDefaults,
        committer: EnqueueCommitter,
        wakes: WakePublisher,
        admission: Admission | None = None,
    ) -> None:
        self._broker = broker
        #: Backpressure on a queue past its backlog limit (none: no limit).
        self._admission = admission
        self._clock = clock
        self._defaults = defaults
        self._committer = committer
        self._wakes = wakes

    def _convert_batch(self, tasks: Any, context_name: str) -> list[NewTask]:
        if len(tasks) > MAX_BATCH:
            raise InvalidTask(f"{context_name} holds at most {MAX_BATCH} tasks, got {len(tasks)}")
        out = []
        for index, msg in enumerate(tasks):
            try:
                out.append(new_task_from_request(msg, self._clock, self._defaults))
            except (InvalidTask, NotSupported) as exc:
                raise type(exc)(f"task {index}: {exc}") from None
        return out

    async def Enqueue(
        self, request: service_pb2.EnqueueRequest, context: _Context
    ) -> service_pb2.EnqueueResponse:
        """Validate, group-commit, answer after the commit."""
        try:
            task = new_task_from_request(request.task, self._clock, self._defaults)
            if self._admission is not None:
                await self._admission.admit(task.queue)
            (task,) = stamp_tasks([task])
            with commit_span([task]):
                result = await self._committer.enqueue(task)
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.EnqueueResponse(task=task_to_proto(result.task), created=result.created)

    async def EnqueueBatch(
        self, request: service_pb2.EnqueueBatchRequest, context: _Context
    ) -> service_pb2.EnqueueBatchResponse:
        """Each item succeeds or fails on its own; invalid items are never sent to the broker."""
        if len(request.tasks) > MAX_BATCH:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"EnqueueBatch holds at most {MAX_BATCH} tasks, got {len(request.tasks)}",
            )
        refused: dict[int, BrokerError] = {}
        work: list[NewTask] = []
        # Admission first: the items of a queue at its backlog limit are refused before
        # any work is spent on them (that work is what a backlog limit saves).
        full: set[str] = set()
        if self._admission is not None and self._admission.enabled:
            full = await self._admission.admit_each(_named_queues(request.tasks))
        # One now for the whole request (process_in and the time bounds are read against it).
        now = self._clock.now()
        for index, msg in enumerate(request.tasks):
            if index and index % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let worker sessions run: see YIELD_EVERY
            if msg.queue in full:
                refused[index] = QueueFull(backlog_full(msg.queue))
                continue
            try:
                work.append(new_task_from_request(msg, self._clock, self._defaults, now=now))
            except (InvalidTask, NotSupported) as exc:
                refused[index] = exc
        tasks = stamp_tasks(work)
        with commit_span(tasks):
            outcomes = await self._committer.enqueue_many(tasks)
        for outcome in outcomes:
            if not isinstance(outcome, EnqueueResult | BrokerError):
                # Not the item's fault (the broker is down, say): fail the whole call so
                # the producer retries it rather than reading a partial answer.
                # Only DatabaseUnavailable's own text is fit for a client; any other
                # error's (a driver's internals) stays in the log.
                logger.error("enqueue_batch.failed error=%r", outcome)
                reason = (
                    str(outcome)
                    if isinstance(outcome, DatabaseUnavailable)
                    else "database unavailable: retry"
                )
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"enqueue failed: {reason}")
        # The answer is written in place, each stored task from a template of what the
        # batch's tasks share (TaskProtos): converting a thousand tasks one by one and
        # copying them into the response would cost more than the commit.
        response = service_pb2.EnqueueBatchResponse()
        add = response.results.add
        protos = TaskProtos()
        done = iter(outcomes)
        for index in range(len(request.tasks)):
            if index and index % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            item = refused.get(index)
            if item is None:
                outcome = next(done)
                if isinstance(outcome, EnqueueResult):
                    protos.write(add(created=outcome.created).task, outcome.task)
                    continue
                assert isinstance(outcome, BrokerError)
                item = outcome
            add(**_item_error(item))
        return response

    async def EnqueueTx(
        self, request: service_pb2.EnqueueTxRequest, context: _Context
    ) -> service_pb2.EnqueueTxResponse:
        """All-or-nothing: one broker transaction, no group commit."""
        try:
            converted = self._convert_batch(request.tasks, "EnqueueTx")
            if self._admission is not None and self._admission.enabled:
                full = await self._admission.admit_each(Counter(t.queue for t in converted))
                if full:
                    raise QueueFull(backlog_full(min(full)))
            tasks = stamp_tasks(converted)
            with commit_span(tasks):
                results = await self._broker.enqueue_batch(tasks) if tasks else []
        except Exception as exc:
            await abort_for_error(context, exc)
        metrics.record_enqueued(results)
        wake_for(results, self._wakes, self._clock)
        return service_pb2.EnqueueTxResponse(tasks=[task_to_proto(r.task) for r in results])

    async def GetTask(
        self, request: service_pb2.GetTaskRequest, context: _Context
    ) -> service_pb2.GetTaskResponse:
        """The stored task, NOT_FOUND for an unknown id."""
        try:
            check_task_id(request.id)
            task = await self._broker.get_task(request.id)
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.GetTaskResponse(task=task_to_proto(task))


def _named_queues(tasks: Any) -> Counter[str]:
    """How many of ``tasks`` (wire NewTasks) name each valid queue (a bad name is the
    item's own INVALID_ARGUMENT, found by its conversion)."""
    counts: Counter[str] = Counter()
    for msg in tasks:
        counts[msg.queue] += 1
    for queue in list(counts):
        try:
            check_queue(queue)
        except InvalidTask:
            del counts[queue]
    return counts


def _item_error(exc: BrokerError) -> dict[str, str]:
    """The fields of the EnqueueItemResult that reports ``exc``."""
    existing = exc.existing_id if isinstance(exc, DuplicateTask) else ""
    return {
        "error_code": status_code_of(exc).name,
        "error": status_message(str(exc)),
        "existing_id": existing,
    }
