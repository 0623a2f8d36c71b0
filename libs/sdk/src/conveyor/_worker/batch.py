"""Running one aggregation-group batch (a BatchDispatch): its context, the one handler
call for all its members, its time bound, and the one BatchResult it sends back.

What a batch handler's outcome means for each member (see :func:`batch_outcomes`):

- it returns None: every member succeeds, with no result;
- it returns a list (or tuple) with one item per member, in member order, or a dict
  keyed by task id: an item that is an ``Exception`` instance fails that member exactly
  as raising it from a task handler would (``SkipRetry``, ``RetryAfter``...); any other
  item is that member's result, encoded by the worker's codec. A member a dict leaves
  out succeeds with no result;
- a list of the wrong length, a dict naming a task that is not in the batch, or any
  other return value fails every member with an error saying so;
- it raises: every member fails as that exception maps for a task handler;
- it outlives the batch's bound (the smallest member timeout, the earliest member
  deadline): every member fails with "timed out".

A member whose payload does not decode fails at once ("cannot decode payload: ...", as a
single task would) and the handler runs for the others (none at all when no payload
decodes); the results of a batch that would not fit in one frame are cut, in member
order, the members left over failing with the reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol

from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb
from opentelemetry.trace import Span

from conveyor._payload import Codec, decode_value
from conveyor._tracing import end_batch_run, start_run
from conveyor._wire_time import duration_from_wire, timestamp_from_wire
from conveyor._worker.context import BatchContext, TaskContext
from conveyor._worker.execution import (
    TIMED_OUT,
    HandlerRegistration,
    HandlerRun,
    Origin,
    dependencies_of,
    describe_exception,
    make_result,
    result_for_exception,
    success_result,
    task_context,
    truncate,
)

logger = logging.getLogger("conveyor.worker")

#: An async batch handler ``async def f(payloads, batch)`` or a sync one
#: ``def f(payloads, batch)``.
BatchHandler = Callable[[list[Any], BatchContext], Any]

#: A batch's BatchResult may be this much larger than the session's result limit: the
#: server receives frames of its largest payload or result plus 256 KiB, and a frame past
#: that would end the session (and bring the batch back for ever).
BATCH_FRAME_HEADROOM = 128 * 1024
#: What a Result costs inside a BatchResult beyond its own bytes (a tag and a length).
_RESULT_FRAMING = 4


class BatchRegistration(HandlerRegistration[BatchHandler]):
    """A registered batch handler and how to call it."""

    __slots__ = ()


class BatchOrigin(Origin, Protocol):
    """The session a batch came on, as its execution sees it."""

    def send_batch(self, key: tuple[str, str], results: list[svc.Result]) -> None:
        """Queue the batch's one BatchResult (``key`` names the batch)."""
        ...


def member_failure(task_ids: Sequence[str], lease_id: str, error: str) -> list[svc.Result]:
    """A FAILURE Result with ``error`` for every member."""
    return [make_result(t, lease_id, svc.OUTCOME_FAILURE, error=error) for t in task_ids]


def _member_result(
    task_id: str, lease_id: str, value: Any, codec: Codec, max_result: int
) -> svc.Result:
    if isinstance(value, Exception):
        return result_for_exception(task_id, lease_id, value)
    return success_result(task_id, lease_id, value, codec, max_result)


def batch_outcomes(
    value: Any, task_ids: Sequence[str], lease_id: str, codec: Codec, max_result: int
) -> list[svc.Result]:
    """The Results, in member order, of a batch handler that returned ``value`` for the
    members ``task_ids`` (see the module's docstring for the rules)."""
    n = len(task_ids)
    if value is None:
        return [make_result(t, lease_id, svc.OUTCOME_SUCCESS) for t in task_ids]
    if isinstance(value, list | tuple):
        if len(value) != n:
            error = (
                f"batch handler returned {len(value)} results for {n} tasks: return one "
                "per task, in the order of the payloads (or a dict keyed by task id)"
            )
            return member_failure(task_ids, lease_id, error)
        return [
            _member_result(t, lease_id, v, codec, max_result)
            for t, v in zip(task_ids, value, strict=True)
        ]
    if isinstance(value, Mapping):
        members = set(task_ids)
        unknown = [k for k in value if k not in members]
        if unknown:
            shown = ", ".join(repr(k) for k in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            error = truncate(
                f"batch handler returned results for {len(unknown)} keys that are not "
                f"task ids of the batch: {shown}{more}"
            )
            return member_failure(task_ids, lease_id, error)
        return [_member_result(t, lease_id, value.get(t), codec, max_result) for t in task_ids]
    error = (
        "batch handler must return None, a list with one result per task or a dict "
        f"keyed by task id; it returned {type(value).__name__}"
    )
    return member_failure(task_ids, lease_id, error)


def _framed_size(result: svc.Result) -> int:
    return result.ByteSize() + _RESULT_FRAMING


def fit_batch(results: list[svc.Result], budget: int) -> list[svc.Result]:
    """``results`` cut to fit one frame of about ``budget`` bytes: in member order each
    Result stays while it fits (with room left for a short failure of each member after
    it); those that do not are replaced by a FAILURE saying why."""
    total = sum(_framed_size(r) for r in results)
    if total <= budget:
        return results
    error = (
        f"the batch's results are {total} bytes in all, over the limit of {budget}: "
        "this task's outcome did not fit"
    )
    shorts = [make_result(r.task_id, r.lease_id, svc.OUTCOME_FAILURE, error=error) for r in results]
    cheapest = [min(_framed_size(r), _framed_size(s)) for r, s in zip(results, shorts, strict=True)]
    reserve = sum(cheapest)
    out: list[svc.Result] = []
    used = 0
    for result, short, cheap in zip(results, shorts, cheapest, strict=True):
        reserve -= cheap
        size = _framed_size(result)
        if used + size + reserve <= budget:
            out.append(result)
            used += size
        else:
            out.append(short)
            used += _framed_size(short)
    logger.warning(
        "worker.batch_results_cut lease_id=%s bytes=%d budget=%d kept=%d of %d",
        results[0].lease_id,
        total,
        budget,
        sum(a is b for a, b in zip(out, results, strict=True)),
        len(results),
    )
    return out


def batch_bounds(
    envelopes: Sequence[pb.TaskEnvelope],
) -> tuple[timedelta | None, datetime | None]:
    """A batch's timeout (the smallest of its members' timeouts) and deadline (the
    earliest of their deadlines); None where no member has one."""
    timeouts = [t for t in (duration_from_wire(e, "timeout") for e in envelopes) if t]
    deadlines = [d for d in (timestamp_from_wire(e, "deadline") for e in envelopes) if d]
    return min(timeouts, default=None), min(deadlines, default=None)


class BatchExecution(HandlerRun[list[svc.Result], BatchContext]):
    """One BatchDispatch being run: the context of each member, the asyncio task around
    the one handler call, and the one BatchResult it sends on the session it came on.

    It takes one slot of its worker, however many members it has. Its ``key`` is its
    first member's task id and the shared lease id. The task's value is the Results of
    every member, in member order. Outside cancellation (a server Cancel, the worker's
    shutdown) cancels the task, and every member is given back (RELEASE) unless the
    server cancelled the batch or it was already given back; a timeout instead makes every
    member fail with "timed out".
    """

    __slots__ = (
        "batch",
        "envelopes",
        "lease_id",
        "payloads",
        "runnable",
        "task_ids",
        "undecodable",
    )

    _TASK_NAME = "conveyor:batch:"
    _CRASHED = "worker.batch_crashed lease_id=%s"
    _DROPPED = "worker.result_dropped lease_id=%s reason=session_ended"

    registration: BatchRegistration
    origin: BatchOrigin

    def __init__(
        self,
        batch: svc.BatchDispatch,
        registration: BatchRegistration,
        origin: BatchOrigin,
        codec: Codec,
    ) -> None:
        self.batch = batch
        self.envelopes: list[pb.TaskEnvelope] = list(batch.tasks)
        first = self.envelopes[0]
        self.lease_id = first.lease_id
        super().__init__((first.id, first.lease_id), registration, origin, codec)
        #: Every member's task id, in member order.
        self.task_ids = [e.id for e in self.envelopes]
        loop = asyncio.get_running_loop()
        #: The decoded payloads of the members the handler runs for, and the Results of
        #: those whose payload did not decode (by member index).
        self.payloads: list[Any] = []
        self.runnable: list[int] = []
        self.undecodable: dict[int, svc.Result] = {}
        contexts: list[TaskContext] = []
        for index, envelope in enumerate(self.envelopes):
            try:
                payload = decode_value(codec, envelope.payload)
            except Exception as exc:
                error = truncate(f"cannot decode payload: {describe_exception(exc)}")
                self.undecodable[index] = make_result(
                    envelope.id, self.lease_id, svc.OUTCOME_FAILURE, error=error
                )
                continue
            self.payloads.append(payload)
            self.runnable.append(index)
            contexts.append(self._member_context(envelope, loop))
        self.ctx = BatchContext(
            queue=batch.queue or first.queue,
            group=batch.group,
            type=batch.type,
            lease_id=self.lease_id,
            tasks=contexts,
        )

    def _member_context(
        self, envelope: pb.TaskEnvelope, loop: asyncio.AbstractEventLoop
    ) -> TaskContext:
        task_id, lease_id = envelope.id, self.lease_id

        def emit_progress(data: bytes) -> None:
            if not (self.reported or self.suppressed or self.released):
                self.origin.send_progress(task_id, lease_id, data)

        dependencies = functools.partial(
            dependencies_of, self.origin, task_id, lease_id, self._codec
        )
        return task_context(envelope, lease_id, self._codec, emit_progress, loop, dependencies)

    def has_task(self, task_id: str) -> bool:
        """True when ``task_id`` is one of the batch's members."""
        return task_id in self.task_ids

    def _bounds(self) -> tuple[timedelta | None, datetime | None]:
        return batch_bounds(self.envelopes)

    def _start_span(self) -> tuple[Span | None, contextvars.Context | None]:
        span, context = start_run(self.envelopes[0])
        if span is not None:
            span.set_attribute("conveyor.group", self.batch.group)
            span.set_attribute("conveyor.tasks", len(self.envelopes))
        return span, context

    def _end_span(self, span: Span, task: asyncio.Task[list[svc.Result]]) -> None:
        end_batch_run(span, task)

    def _merge(self, ran: list[svc.Result]) -> list[svc.Result]:
        """Every member's Result in member order: ``ran`` (those of the members the
        handler ran for) with the decode failures put back in their places."""
        out: list[svc.Result] = []
        ran_iter = iter(ran)
        for index in range(len(self.envelopes)):
            failed = self.undecodable.get(index)
            out.append(failed if failed is not None else next(ran_iter))
        budget = self.origin.max_result + BATCH_FRAME_HEADROOM
        return fit_batch(out, budget)

    @property
    def _ran_ids(self) -> list[str]:
        """The task ids of the members the handler runs for, in member order."""
        return [self.task_ids[i] for i in self.runnable]

    async def _run(
        self, pool: concurrent.futures.Executor, limit: float | None
    ) -> list[svc.Result]:
        if not self.runnable:  # no payload decoded: nothing to run the handler for
            if self._timer is not None:
                self._timer.cancel()
            return self._merge([])
        return await self._call(list(self.payloads), pool, limit)

    def _timed_out_outcome(self) -> list[svc.Result]:
        return self._merge(member_failure(self._ran_ids, self.lease_id, TIMED_OUT))

    def _failed(self, exc: Exception) -> list[svc.Result]:
        return self._merge([result_for_exception(t, self.lease_id, exc) for t in self._ran_ids])

    def _succeeded(self, value: Any) -> list[svc.Result]:
        max_result = self.origin.max_result
        return self._merge(
            batch_outcomes(value, self._ran_ids, self.lease_id, self._codec, max_result)
        )

    def _crashed(self, exc: BaseException) -> list[svc.Result]:
        return [result_for_exception(t, self.lease_id, exc) for t in self.task_ids]

    def _released_outcome(self) -> list[svc.Result]:
        return [make_result(t, self.lease_id, svc.OUTCOME_RELEASE) for t in self.task_ids]

    def _send(self, outcome: list[svc.Result]) -> None:
        self.origin.send_batch(self.key, outcome)

    @property
    def _log_id(self) -> str:
        return self.lease_id
