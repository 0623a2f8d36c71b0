"""Running one delivery: its context, the handler call, its time bound, and the Result it
sends back on the session the delivery came on; and what the run of a batch
(conveyor._worker.batch) shares with it (:class:`HandlerRun`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb
from opentelemetry.trace import Span

from conveyor._errors import SkipRetry
from conveyor._payload import Codec, decode_value, encode_value
from conveyor._tracing import end_run, start_run
from conveyor._wire_time import duration_from_wire, duration_to_wire, timestamp_from_wire
from conveyor._worker.context import CancellationState, TaskContext
from conveyor._worker.dependencies import DependencyResult, read_dependencies

logger = logging.getLogger("conveyor.worker")

#: The error reported when an attempt outlives its timeout or the task's deadline.
TIMED_OUT = "timed out"
#: The server's default limit on a result (CONVEYOR_MAX_RESULT), in encoded bytes.
DEFAULT_MAX_RESULT = 1024 * 1024
#: Error messages are cut to this many characters (the server stores them per task).
MAX_ERROR_LEN = 4096

#: An async handler ``async def f(payload, ctx)`` or a sync one ``def f(payload, ctx)``.
Handler = Callable[[Any, TaskContext], Any]


#: A handler: of a task (:data:`Handler`) or of a batch (batch.BatchHandler).
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class HandlerRegistration(Generic[F]):
    """A registered handler (of a task or of a batch) and how to call it."""

    type: str
    fn: F
    is_async: bool

    @classmethod
    def of(cls, type: str, fn: F) -> Self:
        """Register ``fn`` for ``type``, telling async handlers from sync ones."""
        return cls(type=type, fn=fn, is_async=is_async_handler(type, fn))


class Registration(HandlerRegistration[Handler]):
    """A registered handler and how to call it."""

    __slots__ = ()


def is_async_handler(type: str, fn: object) -> bool:
    """True when ``fn`` (the handler of ``type``) is a coroutine function, or an object
    whose ``__call__`` is one; TypeError when it is not callable at all."""
    if not callable(fn):
        raise TypeError(f"handler for {type!r} is not callable: {fn!r}")
    call = inspect.getattr_static(fn, "__call__", None)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def describe_exception(exc: BaseException) -> str:
    """``"TypeName: message"`` (just the type name when the message is empty), bounded."""
    message = str(exc)
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return truncate(text)


def truncate(text: str) -> str:
    """``text`` cut to :data:`MAX_ERROR_LEN` characters."""
    return text if len(text) <= MAX_ERROR_LEN else text[: MAX_ERROR_LEN - 3] + "..."


def retry_after_of(exc: BaseException) -> timedelta | None:
    """The retry delay an exception asks for through a ``retry_after`` attribute."""
    value = getattr(exc, "retry_after", None)
    if isinstance(value, timedelta):
        delay = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        delay = timedelta(seconds=value)
    else:
        return None
    return delay if delay >= timedelta(0) else None


def make_result(
    task_id: str,
    lease_id: str,
    outcome: svc.Outcome,
    *,
    result: bytes = b"",
    error: str = "",
    retry_after: timedelta | None = None,
) -> svc.Result:
    """A wire Result for one delivery."""
    message = svc.Result(
        task_id=task_id, lease_id=lease_id, outcome=outcome, result=result, error=error
    )
    if retry_after is not None:
        message.retry_after.CopyFrom(duration_to_wire(retry_after))
    return message


def result_for_exception(task_id: str, lease_id: str, exc: BaseException) -> svc.Result:
    """The Result a handler exception maps to.

    ``SkipRetry`` archives at once with its message; an exception carrying
    ``retry_after`` (such as ``RetryAfter``) fails with that delay; anything else fails
    with ``"TypeName: message"`` and the server's backoff.
    """
    if isinstance(exc, SkipRetry):
        error = truncate(exc.message) if exc.message else describe_exception(exc)
        return make_result(task_id, lease_id, svc.OUTCOME_SKIP_RETRY, error=error)
    return make_result(
        task_id,
        lease_id,
        svc.OUTCOME_FAILURE,
        error=describe_exception(exc),
        retry_after=retry_after_of(exc),
    )


def success_result(
    task_id: str, lease_id: str, value: Any, codec: Codec, max_result: int
) -> svc.Result:
    """The Result of a handler that returned ``value``: SUCCESS with the encoded value,
    or FAILURE when the codec cannot encode it or it is over ``max_result`` bytes."""
    try:
        data = encode_value(codec, value)
    except Exception as exc:
        error = f"cannot encode result: {describe_exception(exc)}"
        return make_result(task_id, lease_id, svc.OUTCOME_FAILURE, error=truncate(error))
    if len(data) > max_result:
        # A frame past the server's receive limit would end the whole session (and the
        # task would come back for ever): fail the attempt with the reason instead.
        error = f"result is {len(data)} bytes; the limit is {max_result}"
        return make_result(task_id, lease_id, svc.OUTCOME_FAILURE, error=error)
    return make_result(task_id, lease_id, svc.OUTCOME_SUCCESS, result=data)


def time_limit(timeout: timedelta | None, deadline: datetime | None, now: datetime) -> float | None:
    """Seconds this attempt may run: the smaller of its timeout and what is left before
    the deadline (None when neither is set; <= 0 when the deadline has passed)."""
    limits: list[float] = []
    if timeout is not None and timeout > timedelta(0):
        limits.append(timeout.total_seconds())
    if deadline is not None:
        limits.append((deadline - now).total_seconds())
    return min(limits) if limits else None


def task_context(
    envelope: pb.TaskEnvelope,
    lease_id: str,
    codec: Codec,
    emit_progress: Callable[[bytes], None],
    loop: asyncio.AbstractEventLoop,
    read_dependencies: Callable[[], Awaitable[list[DependencyResult]]],
) -> TaskContext:
    """The context of a handler run of ``envelope`` under ``lease_id`` (a delivery, or a
    member of a batch)."""
    return TaskContext(
        task_id=envelope.id,
        queue=envelope.queue,
        type=envelope.type,
        attempt=envelope.attempt,
        max_retry=envelope.max_retry,
        headers=dict(envelope.headers),
        timeout=duration_from_wire(envelope, "timeout") or None,
        deadline=timestamp_from_wire(envelope, "deadline"),
        enqueued_at=timestamp_from_wire(envelope, "enqueued_at"),
        group=envelope.group or None,
        concurrency_key=envelope.concurrency_key or None,
        lease_id=lease_id,
        codec=codec,
        emit_progress=emit_progress,
        loop=loop,
        read_dependencies=read_dependencies,
    )


class Origin(Protocol):
    """The session a delivery came on, as the delivery's execution sees it: where its
    Result and progress updates go."""

    @property
    def live(self) -> bool:
        """True while the session's stream is up (afterwards nothing more is sent)."""
        ...

    @property
    def max_result(self) -> int:
        """The largest encoded result the session sends."""
        ...

    def send(self, result: svc.Result) -> None:
        """Queue the delivery's Result."""
        ...

    def send_progress(self, task_id: str, lease_id: str, data: bytes) -> None:
        """Queue a Progress update of the delivery."""
        ...

    async def dependency_results(
        self, task_id: str, lease_id: str, cursor: str
    ) -> svc.GetDependencyResultsResponse:
        """A page of the delivery's dependencies' results (after ``cursor``)."""
        ...


async def dependencies_of(
    origin: Origin, task_id: str, lease_id: str, codec: Codec
) -> list[DependencyResult]:
    """Every dependency of the task ``task_id``, read through ``origin`` under its lease
    ``lease_id`` (all pages)."""

    async def fetch(cursor: str) -> svc.GetDependencyResultsResponse:
        return await origin.dependency_results(task_id, lease_id, cursor)

    return await read_dependencies(fetch, codec)


#: What a run's asyncio task comes to: a delivery's Result, or a batch's Results.
R = TypeVar("R")
#: The context a run's handler is given: a TaskContext, or a BatchContext.
C = TypeVar("C", bound=CancellationState)


class HandlerRun(Generic[R, C]):
    """What the run of a delivery (:class:`Execution`) and of a batch
    (conveyor._worker.batch.BatchExecution) share: the asyncio task around the handler
    call (a sync handler in the thread pool), its time bound, its span, and reporting
    what the task came to on the session it came on (its ``origin``) once.

    Outside cancellation (a server Cancel, the worker's shutdown) cancels the task, and
    the run is given back (RELEASE) unless the server cancelled it or it was already
    given back; a timeout instead makes the task come to "timed out" failures.

    A subclass sets ``ctx`` and says what its outcomes are (the methods that raise
    NotImplementedError here).
    """

    __slots__ = (
        "_codec",
        "_on_finished",
        "_timer",
        "ctx",
        "key",
        "origin",
        "registration",
        "released",
        "reported",
        "span",
        "suppressed",
        "task",
        "thread_future",
        "timed_out",
    )

    #: The name of the run's asyncio task, before ``key[0]``.
    _TASK_NAME: ClassVar[str]
    #: The log lines of a crashed task and of an outcome dropped with its session (with
    #: :attr:`_log_id`).
    _CRASHED: ClassVar[str]
    _DROPPED: ClassVar[str]

    ctx: C

    def __init__(
        self,
        key: tuple[str, str],
        registration: HandlerRegistration[Any],
        origin: Origin,
        codec: Codec,
    ) -> None:
        #: The run's identity: (task id, lease id) of a delivery, (first member's task
        #: id, lease id) of a batch.
        self.key = key
        self.registration = registration
        self.origin = origin
        self._codec = codec
        self.task: asyncio.Task[R] | None = None
        self.thread_future: concurrent.futures.Future[Any] | None = None
        self.timed_out = False
        #: A server Cancel arrived: send nothing for this run.
        self.suppressed = False
        #: A RELEASE was already sent for this run: send nothing more.
        self.released = False
        #: The task's outcome has been dealt with.
        self.reported = False
        #: The run's span, while the application traces (see conveyor._tracing).
        self.span: Span | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._on_finished: Callable[[Self], None] | None = None

    # ------------------------------------------------------------ what a subclass says

    def _bounds(self) -> tuple[timedelta | None, datetime | None]:
        """The run's timeout and deadline (None where it has none)."""
        raise NotImplementedError

    def _start_span(self) -> tuple[Span | None, contextvars.Context | None]:
        """The run's span and the context its task runs in (see start_run)."""
        raise NotImplementedError

    def _end_span(self, span: Span, task: asyncio.Task[R]) -> None:
        """End the run's span with what its task came to."""
        raise NotImplementedError

    async def _run(self, pool: concurrent.futures.Executor, limit: float | None) -> R:
        """The run's task: what it sends (through :meth:`_call` for the handler call)."""
        raise NotImplementedError

    def _timed_out_outcome(self) -> R:
        """What the run comes to when it outlives its bound."""
        raise NotImplementedError

    def _failed(self, exc: Exception) -> R:
        """What the run comes to when the handler raises ``exc``."""
        raise NotImplementedError

    def _succeeded(self, value: Any) -> R:
        """What the run comes to when the handler returns ``value``."""
        raise NotImplementedError

    def _crashed(self, exc: BaseException) -> R:
        """What the run sends when its task itself raised ``exc``."""
        raise NotImplementedError

    def _released_outcome(self) -> R:
        """What the run sends to give its delivery back untouched."""
        raise NotImplementedError

    def _send(self, outcome: R) -> None:
        """Send ``outcome`` on the origin session."""
        raise NotImplementedError

    @property
    def _log_id(self) -> str:
        """What the run's log lines name it by."""
        raise NotImplementedError

    # ---------------------------------------------------------------- the shared part

    @property
    def finished(self) -> bool:
        """True once the task is done and any handler thread has returned."""
        task_done = self.task is not None and self.task.done()
        thread_done = self.thread_future is None or self.thread_future.done()
        return task_done and thread_done

    def start(self, pool: concurrent.futures.Executor, on_finished: Callable[[Self], None]) -> None:
        """Start the handler task (a sync handler runs in ``pool``). What it comes to goes
        to the origin session when the task is done; ``on_finished`` runs once (on the
        loop) when the task and any handler thread are both done."""
        loop = asyncio.get_running_loop()
        self._on_finished = on_finished
        timeout, deadline = self._bounds()
        limit = (
            time_limit(timeout, deadline, datetime.now(UTC))
            if timeout is not None or deadline is not None
            else None
        )
        self.span, context = self._start_span()
        self.task = loop.create_task(
            self._run(pool, limit), name=f"{self._TASK_NAME}{self.key[0]}", context=context
        )
        self.task.add_done_callback(self._settled)
        if limit is not None:
            self._timer = loop.call_later(max(limit, 0.0), self._expire)

    def release(self) -> None:
        """Give the delivery (every member of a batch) back untouched (RELEASE); nothing
        more is sent for it."""
        if not self.suppressed and not self.released:
            self.released = True
            self._send(self._released_outcome())

    def cancel(self, reason: str) -> None:
        """Cancel the handler: flag its context, then cancel the asyncio task."""
        self.ctx._cancel(reason)
        if self.task is not None:
            self.task.cancel()

    def _expire(self) -> None:
        self.timed_out = True
        self.cancel(TIMED_OUT)

    def _settled(self: Self, *_: object) -> None:
        """The task or the handler thread is done: report the task's outcome once, and
        call ``on_finished`` once both are done (in whichever order they end)."""
        task = self.task
        if task is not None and task.done() and not self.reported:
            self.reported = True
            self._report(task)
            if self.span is not None:
                self._end_span(self.span, task)
        on_finished = self._on_finished
        if on_finished is not None and self.finished:
            self._on_finished = None
            on_finished(self)

    def _report(self, task: asyncio.Task[R]) -> None:
        if self.suppressed or self.released:
            return
        if task.cancelled():
            self.release()
            return
        exc = task.exception()
        if exc is not None:
            logger.error(self._CRASHED, self._log_id, exc_info=exc)
            outcome = self._crashed(exc)
        else:
            outcome = task.result()
        if not self.origin.live:
            logger.debug(self._DROPPED, self._log_id)
            return
        self._send(outcome)

    async def _call(
        self, argument: Any, pool: concurrent.futures.Executor, limit: float | None
    ) -> R:
        """Call the handler with ``argument`` within ``limit`` seconds: what the run comes
        to (a timeout undoes the task's own cancellation)."""
        if limit is not None and limit <= 0:
            self.timed_out = True
            self.ctx._cancel(TIMED_OUT)
            return self._timed_out_outcome()
        try:
            value = await self._invoke(argument, pool)
        except asyncio.CancelledError:
            if not self.timed_out:
                raise
            # Our own timer cancelled the task: undo that cancellation and report it.
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            return self._timed_out_outcome()
        except Exception as exc:
            return self._failed(exc)
        finally:
            if self._timer is not None:
                self._timer.cancel()
        if self.timed_out:  # the handler swallowed the cancellation and returned anyway
            return self._timed_out_outcome()
        return self._succeeded(value)

    async def _invoke(self, argument: Any, pool: concurrent.futures.Executor) -> Any:
        fn = self.registration.fn
        if self.registration.is_async:
            coro: Awaitable[Any] = fn(argument, self.ctx)
            return await coro
        context = contextvars.copy_context()
        future = pool.submit(context.run, fn, argument, self.ctx)
        self.thread_future = future
        loop = asyncio.get_running_loop()

        def thread_done(_: concurrent.futures.Future[Any]) -> None:
            # A closed loop means the worker is gone.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._settled)

        future.add_done_callback(thread_done)
        try:
            value = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.ctx._cancel(TIMED_OUT if self.timed_out else "cancelled")
            raise
        if inspect.isawaitable(value):  # a plain function that returned a coroutine
            value = await value
        return value


class Execution(HandlerRun[svc.Result, TaskContext]):
    """One delivery being run: its context, the asyncio task around the handler, and what
    it sends back on the session the delivery came on (its ``origin``).

    The task's value is the Result to send. Outside cancellation (a server Cancel, the
    worker's shutdown) cancels the task, and the delivery is given back (RELEASE) unless
    the server cancelled it or it was already given back; a timeout instead makes the
    task return a ``FAILURE "timed out"`` Result.
    """

    __slots__ = ("envelope",)

    _TASK_NAME = "conveyor:"
    _CRASHED = "worker.execution_crashed task_id=%s"
    _DROPPED = "worker.result_dropped task_id=%s reason=session_ended"

    registration: Registration

    def __init__(
        self,
        envelope: pb.TaskEnvelope,
        registration: Registration,
        origin: Origin,
        codec: Codec,
    ) -> None:
        self.envelope = envelope
        super().__init__((envelope.id, envelope.lease_id), registration, origin, codec)
        self.ctx = task_context(
            envelope,
            envelope.lease_id,
            codec,
            self._emit_progress,
            asyncio.get_running_loop(),
            self._read_dependencies,
        )

    async def _read_dependencies(self) -> list[DependencyResult]:
        return await dependencies_of(self.origin, *self.key, self._codec)

    def has_task(self, task_id: str) -> bool:
        """True when this is a delivery of task ``task_id``."""
        return self.envelope.id == task_id

    def _emit_progress(self, data: bytes) -> None:
        if not (self.reported or self.suppressed or self.released):
            self.origin.send_progress(*self.key, data)

    def _bounds(self) -> tuple[timedelta | None, datetime | None]:
        return self.ctx.timeout, self.ctx.deadline

    def _start_span(self) -> tuple[Span | None, contextvars.Context | None]:
        return start_run(self.envelope)

    def _end_span(self, span: Span, task: asyncio.Task[svc.Result]) -> None:
        end_run(span, task)

    async def _run(self, pool: concurrent.futures.Executor, limit: float | None) -> svc.Result:
        try:
            payload = decode_value(self._codec, self.envelope.payload)
        except Exception as exc:
            error = f"cannot decode payload: {describe_exception(exc)}"
            return make_result(*self.key, svc.OUTCOME_FAILURE, error=truncate(error))
        return await self._call(payload, pool, limit)

    def _timed_out_outcome(self) -> svc.Result:
        return make_result(*self.key, svc.OUTCOME_FAILURE, error=TIMED_OUT)

    def _failed(self, exc: Exception) -> svc.Result:
        return result_for_exception(*self.key, exc)

    def _succeeded(self, value: Any) -> svc.Result:
        return success_result(*self.key, value, self._codec, self.origin.max_result)

    def _crashed(self, exc: BaseException) -> svc.Result:
        return result_for_exception(*self.key, exc)

    def _released_outcome(self) -> svc.Result:
        return make_result(*self.key, svc.OUTCOME_RELEASE)

    def _send(self, outcome: svc.Result) -> None:
        self.origin.send(outcome)

    @property
    def _log_id(self) -> str:
        return self.key[0]
