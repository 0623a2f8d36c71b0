"""Running one delivery: its context, the handler call, its time bound, and the Result it
sends back on the session the delivery came on."""

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
from typing import Any, Protocol

from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb
from opentelemetry.trace import Span

from conveyor._errors import SkipRetry
from conveyor._payload import Codec, decode_value, encode_value
from conveyor._tracing import end_run, start_run
from conveyor._wire_time import duration_from_wire, duration_to_wire, timestamp_from_wire
from conveyor._worker.context import TaskContext
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


@dataclass(frozen=True, slots=True)
class Registration:
    """A registered handler and how to call it."""

    type: str
    fn: Handler
    is_async: bool

    @classmethod
    def of(cls, type: str, fn: Handler) -> Registration:
        """Register ``fn`` for ``type``, telling async handlers from sync ones."""
        return cls(type=type, fn=fn, is_async=is_async_handler(type, fn))


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


class Execution:
    """One delivery being run: its context, the asyncio task around the handler, and what
    it sends back on the session the delivery came on (its ``origin``).

    The task's value is the Result to send. Outside cancellation (a server Cancel, the
    worker's shutdown) cancels the task, and the delivery is given back (RELEASE) unless
    the server cancelled it or it was already given back; a timeout instead makes the
    task return a ``FAILURE "timed out"`` Result.
    """

    __slots__ = (
        "_codec",
        "_on_finished",
        "_timer",
        "ctx",
        "envelope",
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

    def __init__(
        self,
        envelope: pb.TaskEnvelope,
        registration: Registration,
        origin: Origin,
        codec: Codec,
    ) -> None:
        self.envelope = envelope
        #: (task id, lease id): the delivery's identity.
        self.key: tuple[str, str] = (envelope.id, envelope.lease_id)
        self.registration = registration
        self.origin = origin
        self._codec = codec
        self.ctx = TaskContext(
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
            lease_id=envelope.lease_id,
            codec=codec,
            emit_progress=self._emit_progress,
            loop=asyncio.get_running_loop(),
            read_dependencies=self._read_dependencies,
        )
        self.task: asyncio.Task[svc.Result] | None = None
        self.thread_future: concurrent.futures.Future[Any] | None = None
        self.timed_out = False
        #: A server Cancel arrived: send nothing for this delivery.
        self.suppressed = False
        #: A RELEASE was already sent for this delivery: send nothing more.
        self.released = False
        #: The task's outcome has been dealt with.
        self.reported = False
        #: The run's span, while the application traces (see conveyor._tracing).
        self.span: Span | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._on_finished: Callable[[Execution], None] | None = None

    async def _read_dependencies(self) -> list[DependencyResult]:
        envelope, origin = self.envelope, self.origin

        async def fetch(cursor: str) -> svc.GetDependencyResultsResponse:
            return await origin.dependency_results(envelope.id, envelope.lease_id, cursor)

        return await read_dependencies(fetch, self._codec)

    def has_task(self, task_id: str) -> bool:
        """True when this is a delivery of task ``task_id``."""
        return self.envelope.id == task_id

    @property
    def finished(self) -> bool:
        """True once the task is done and any handler thread has returned."""
        task_done = self.task is not None and self.task.done()
        thread_done = self.thread_future is None or self.thread_future.done()
        return task_done and thread_done

    def start(
        self, pool: concurrent.futures.Executor, on_finished: Callable[[Execution], None]
    ) -> None:
        """Start the handler task (a sync handler runs in ``pool``). Its Result goes to
        the origin session when the task is done; ``on_finished`` runs once (on the loop)
        when the task and any handler thread are both done."""
        loop = asyncio.get_running_loop()
        self._on_finished = on_finished
        ctx = self.ctx
        limit = (
            time_limit(ctx.timeout, ctx.deadline, datetime.now(UTC))
            if ctx.timeout is not None or ctx.deadline is not None
            else None
        )
        self.span, context = start_run(self.envelope)
        self.task = loop.create_task(
            self._run(self._codec, pool, limit), name=f"conveyor:{self.key[0]}", context=context
        )
        self.task.add_done_callback(self._settled)
        if limit is not None:
            self._timer = loop.call_later(max(limit, 0.0), self._expire)

    def release(self) -> None:
        """Give the delivery back untouched (RELEASE); nothing more is sent for it."""
        if not self.suppressed and not self.released:
            self.released = True
            self.origin.send(make_result(*self.key, svc.OUTCOME_RELEASE))

    def cancel(self, reason: str) -> None:
        """Cancel the handler: flag its context, then cancel the asyncio task."""
        self.ctx._cancel(reason)
        if self.task is not None:
            self.task.cancel()

    def _expire(self) -> None:
        self.timed_out = True
        self.cancel(TIMED_OUT)

    def _emit_progress(self, data: bytes) -> None:
        if not (self.reported or self.suppressed or self.released):
            self.origin.send_progress(*self.key, data)

    def _settled(self, *_: object) -> None:
        """The task or the handler thread is done: report the task's outcome once, and
        call ``on_finished`` once both are done (in whichever order they end)."""
        task = self.task
        if task is not None and task.done() and not self.reported:
            self.reported = True
            self._report(task)
            if self.span is not None:
                end_run(self.span, task)
        on_finished = self._on_finished
        if on_finished is not None and self.finished:
            self._on_finished = None
            on_finished(self)

    def _report(self, task: asyncio.Task[svc.Result]) -> None:
        if self.suppressed or self.released:
            return
        if task.cancelled():
            self.release()
            return
        exc = task.exception()
        if exc is not None:
            logger.error("worker.execution_crashed task_id=%s", self.key[0], exc_info=exc)
            result = result_for_exception(*self.key, exc)
        else:
            result = task.result()
        if not self.origin.live:
            logger.debug("worker.result_dropped task_id=%s reason=session_ended", self.key[0])
            return
        self.origin.send(result)

    async def _run(
        self, codec: Codec, pool: concurrent.futures.Executor, limit: float | None
    ) -> svc.Result:
        task_id, lease_id = self.key
        try:
            payload = decode_value(codec, self.envelope.payload)
        except Exception as exc:
            error = f"cannot decode payload: {describe_exception(exc)}"
            return make_result(task_id, lease_id, svc.OUTCOME_FAILURE, error=truncate(error))
        if limit is not None and limit <= 0:
            self.timed_out = True
            self.ctx._cancel(TIMED_OUT)
            return make_result(task_id, lease_id, svc.OUTCOME_FAILURE, error=TIMED_OUT)
        try:
            value = await self._invoke(payload, pool)
        except asyncio.CancelledError:
            if not self.timed_out:
                raise
            # Our own timer cancelled the task: undo that cancellation and report it.
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            return make_result(task_id, lease_id, svc.OUTCOME_FAILURE, error=TIMED_OUT)
        except Exception as exc:
            return result_for_exception(task_id, lease_id, exc)
        finally:
            if self._timer is not None:
                self._timer.cancel()
        if self.timed_out:  # the handler swallowed the cancellation and returned anyway
            return make_result(task_id, lease_id, svc.OUTCOME_FAILURE, error=TIMED_OUT)
        return success_result(task_id, lease_id, value, codec, self.origin.max_result)

    async def _invoke(self, payload: Any, pool: concurrent.futures.Executor) -> Any:
        fn = self.registration.fn
        if self.registration.is_async:
            coro: Awaitable[Any] = fn(payload, self.ctx)
            return await coro
        context = contextvars.copy_context()
        future = pool.submit(context.run, fn, payload, self.ctx)
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
