"""One WorkerService.Session stream: handshake, frames in and out, graceful close.

A :class:`SessionRunner` lives for one stream. It reads ServerFrames (Dispatch,
Dispatches, BatchDispatch, Cancel, Ping), runs the deliveries it takes on in the worker's
:class:`~conveyor._worker.slots.Slots`, writes Results, Progress and Heartbeats through an
:class:`~conveyor._worker.outbox.Outbox`, and raises :class:`SessionEnded` when the stream
ends on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import grpc
import grpc.aio
from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb

from conveyor._channel import Endpoint, auth_metadata
from conveyor._errors import Unavailable, error_from_rpc
from conveyor._version import __version__
from conveyor._wire_time import duration_from_wire
from conveyor._worker.batch import BatchRegistration
from conveyor._worker.execution import DEFAULT_MAX_RESULT, Registration, make_result
from conveyor._worker.outbox import Outbox
from conveyor._worker.slots import Slots

#: This SDK's name in its Hello (the server holds its version to its min_sdk_version).
SDK_NAME = "conveyor-python"

logger = logging.getLogger("conveyor.worker")

SESSION_METHOD = "/conveyor.v1.WorkerService/Session"
DEPENDENCY_RESULTS_METHOD = "/conveyor.v1.WorkerService/GetDependencyResults"
#: Seconds a read of dependency results may take.
DEPENDENCY_RESULTS_TIMEOUT = 30.0
#: Statuses that end a worker instead of a reconnect: they do not heal by retrying
#: (PERMISSION_DENIED: the token's role does not cover a worker session on these queues).
FATAL_CODES = frozenset(
    {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNAUTHENTICATED", "PERMISSION_DENIED"}
)
#: How long to wait for Welcome after Hello.
WELCOME_TIMEOUT = 30.0
#: How long a closing session waits for its last writes, then for the server's end.
CLOSE_TIMEOUT = 5.0
#: Used when the server's Welcome names neither a heartbeat interval nor a lease TTL.
DEFAULT_HEARTBEAT = timedelta(seconds=10)
#: While frames keep coming, they are written at most this often (seconds), so results
#: that finish close together share one BatchResult: a stream write costs tens of
#: microseconds of CPU whatever it carries. After a quiet spell the first frame goes out
#: at once, so a lone result never waits.
WRITE_INTERVAL = 0.001
_HEARTBEAT = svc.WorkerFrame(heartbeat=svc.Heartbeat())

#: A delivery waiting for a local slot: a task and its handler, or a batch and its.
Waiting = tuple[pb.TaskEnvelope, Registration] | tuple[svc.BatchDispatch, BatchRegistration]


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """What a session needs to know about its worker: where to connect, how to
    authenticate, and what to say in Hello."""

    endpoint: Endpoint
    token: str | None
    queues: Mapping[str, int]
    concurrency: int
    labels: Mapping[str, str]
    worker_id: str
    min_server_version: str
    #: The worker's own result limit; None takes the one the server announces.
    max_result_size: int | None


class SessionEnded(Exception):
    """The stream ended without a shutdown being asked for.

    ``code`` is the gRPC status code name, ``welcomed`` whether the session got as far
    as Welcome (which resets the reconnect backoff).
    """

    def __init__(self, code: str, details: str, *, welcomed: bool) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details
        self.welcomed = welcomed


def _code_name(code: object) -> str:
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"


async def _final_status(call: grpc.aio.StreamStreamCall[Any, Any]) -> tuple[str, str]:
    code = await call.code()
    details = await call.details()
    return _code_name(code), details or ""


def _status_of(exc: BaseException) -> tuple[str, str] | None:
    if isinstance(exc, grpc.aio.AioRpcError):
        return _code_name(exc.code()), exc.details() or ""
    return None


class SessionRunner:
    """Runs one session of a worker, whose ``handlers`` (and ``batch_handlers``, for
    BatchDispatch) run in its ``slots``.

    Hello always offers the worker's whole concurrency. Handlers of an earlier session
    may still be running (their results are dropped, but they hold real slots): a
    dispatch that arrives while every local slot is taken, yet within what this session
    was offered, waits here, leased and heartbeated, and starts as soon as a slot frees.
    Only a dispatch beyond the session's offer (a misbehaving server) is given back.

    A BatchDispatch counts as one delivery (one slot), whatever its number of members,
    and is answered with one BatchResult frame.
    """

    def __init__(
        self,
        settings: SessionSettings,
        handlers: Mapping[str, Registration],
        slots: Slots,
        batch_handlers: Mapping[str, BatchRegistration] | None = None,
    ) -> None:
        self.settings = settings
        self.handlers = handlers
        self.batch_handlers: Mapping[str, BatchRegistration] = batch_handlers or {}
        self.slots = slots
        self.outbox = Outbox()
        self.session_id: str | None = None
        self.live = False
        #: The largest result this session sends: the worker's own limit, else the one
        #: the server announced in Welcome.
        self.max_result = (
            DEFAULT_MAX_RESULT if settings.max_result_size is None else settings.max_result_size
        )
        #: The most deliveries this session holds: the Hello's concurrency, changed by
        #: :meth:`credit`.
        self.concurrency = settings.concurrency
        #: Deliveries taken on while every slot was busy, oldest first (a batch by its
        #: first member's task id and its lease id).
        self.waiting: dict[tuple[str, str], Waiting] = {}
        #: Deliveries of this session not answered yet (running here, or waiting); a
        #: batch is one.
        self.holding: set[tuple[str, str]] = set()
        self._call: grpc.aio.StreamStreamCall[svc.WorkerFrame, svc.ServerFrame] | None = None
        self._channel: grpc.aio.Channel | None = None

    # ------------------------------------------------------------- the stream

    def hello(self) -> svc.Hello:
        """The Hello frame this session opens with."""
        settings = self.settings
        return svc.Hello(
            queues=settings.queues,
            concurrency=settings.concurrency,
            labels=settings.labels,
            sdk_name=SDK_NAME,
            sdk_version=__version__,
            min_server_version=settings.min_server_version,
            batch_types=sorted(self.batch_handlers),
            worker_id=settings.worker_id,
            accepts_dispatches=True,
        )

    async def run(self) -> None:
        """Open the stream and serve it. Returns after a graceful close; raises
        :class:`SessionEnded` when the stream ended for any other reason."""
        channel = self.settings.endpoint.aio_channel()
        self._channel = channel
        try:
            session: grpc.aio.StreamStreamMultiCallable[svc.WorkerFrame, svc.ServerFrame]
            session = channel.stream_stream(
                SESSION_METHOD,
                request_serializer=svc.WorkerFrame.SerializeToString,
                response_deserializer=svc.ServerFrame.FromString,
            )
            call = session(metadata=auth_metadata(self.settings.token))
            self._call = call
            welcome = await self._handshake(call)
            if welcome is None:
                return
            self._welcomed(welcome)
            try:
                await self._serve(call, welcome)
            finally:
                self.live = False
        finally:
            if self._call is not None:
                self._call.cancel()
            await channel.close()

    async def _handshake(
        self, call: grpc.aio.StreamStreamCall[svc.WorkerFrame, svc.ServerFrame]
    ) -> svc.Welcome | None:
        """Send Hello and wait for Welcome; None when a stop came first."""
        hello = svc.WorkerFrame(hello=self.hello())
        stop = asyncio.ensure_future(self.slots.stopped())
        read: asyncio.Future[Any] | None = None
        try:
            try:
                await call.write(hello)
                read = asyncio.ensure_future(call.read())
                done, _ = await asyncio.wait(
                    {read, stop}, timeout=WELCOME_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
                )
                frame = read.result() if read in done else None
            except Exception as exc:
                raise SessionEnded(*await self._failed(call, exc), welcomed=False) from None
            if frame is not None:
                if not isinstance(frame, svc.ServerFrame):  # EOF before Welcome
                    raise SessionEnded(*await _final_status(call), welcomed=False)
                kind = frame.WhichOneof("frame")
                if kind != "welcome":
                    call.cancel()
                    raise SessionEnded("UNKNOWN", f"expected Welcome, got {kind}", welcomed=False)
                welcome: svc.Welcome = frame.welcome
                return welcome
            call.cancel()
            if stop.done():
                return None
            raise SessionEnded("DEADLINE_EXCEEDED", "no Welcome in time", welcomed=False)
        finally:
            for future in (stop, read):
                if future is not None and not future.done():
                    future.cancel()
                    with contextlib.suppress(BaseException):
                        await future

    async def _failed(
        self, call: grpc.aio.StreamStreamCall[svc.WorkerFrame, svc.ServerFrame], exc: BaseException
    ) -> tuple[str, str]:
        """The status behind a failed read or write (the call is ended if it is not)."""
        status = _status_of(exc)
        if status is not None:
            return status
        if call.done():
            return await _final_status(call)
        logger.error("worker.stream_failed session_id=%s", self.session_id, exc_info=exc)
        call.cancel()
        return "UNKNOWN", repr(exc)

    def _welcomed(self, welcome: svc.Welcome) -> None:
        self.session_id = welcome.session_id
        self.live = True
        if self.settings.max_result_size is None and welcome.max_result > 0:
            self.max_result = welcome.max_result
        logger.info(
            "worker.session_started session_id=%s server_version=%s concurrency=%d",
            welcome.session_id,
            welcome.server_version,
            self.settings.concurrency,
        )

    def _heartbeat_interval(self, welcome: svc.Welcome) -> float:
        interval = duration_from_wire(welcome, "heartbeat_interval")
        if not interval:
            ttl = duration_from_wire(welcome, "lease_ttl")
            interval = ttl / 3 if ttl else DEFAULT_HEARTBEAT
        return max(interval.total_seconds(), 0.01)

    async def _serve(
        self,
        call: grpc.aio.StreamStreamCall[svc.WorkerFrame, svc.ServerFrame],
        welcome: svc.Welcome,
    ) -> None:
        reader = asyncio.ensure_future(self._read_loop(call))
        writer = asyncio.ensure_future(self._write_loop(call))
        heart = asyncio.ensure_future(self._heartbeat_loop(self._heartbeat_interval(welcome)))
        stop = asyncio.ensure_future(self.slots.stopped())
        tasks = (reader, writer, heart, stop)
        try:
            done, _ = await asyncio.wait(
                {reader, writer, stop}, return_when=asyncio.FIRST_COMPLETED
            )
            if stop in done and not reader.done() and not writer.done():
                await self._close_gracefully(reader, writer)
                return
            self.live = False
            raise SessionEnded(*await self._end_status(call, reader, writer), welcomed=True)
        finally:
            self.live = False
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _end_status(
        self,
        call: grpc.aio.StreamStreamCall[svc.WorkerFrame, svc.ServerFrame],
        *tasks: asyncio.Future[Any],
    ) -> tuple[str, str]:
        """Why the stream ended: the failed read or write, or the call's final status."""
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                assert exc is not None
                return await self._failed(call, exc)
        return await _final_status(call)

    async def _close_gracefully(
        self, reader: asyncio.Future[Any], writer: asyncio.Future[Any]
    ) -> None:
        """Shutdown, steps 2 to 4: say Drain (the server sends nothing new from then on),
        grace period, RELEASE the rest, half-close."""
        self.outbox.put_frame(svc.WorkerFrame(drain=svc.Drain()))
        self.release_waiting()
        await self.slots.drained()
        for execution in self.slots.executions():
            if execution.origin is self and not execution.reported:
                execution.release()
            execution.cancel("worker shutting down")
        self.outbox.close()
        await asyncio.wait({writer}, timeout=CLOSE_TIMEOUT)
        # The server ends the stream once it has seen the half-close.
        await asyncio.wait({reader}, timeout=CLOSE_TIMEOUT)
        logger.info("worker.session_closed session_id=%s", self.session_id)

    async def _read_loop(
        self, call: grpc.aio.StreamStreamCall[svc.WorkerFrame, svc.ServerFrame]
    ) -> None:
        while True:
            frame = await call.read()
            if not isinstance(frame, svc.ServerFrame):  # EOF: the server ended the stream
                return
            kind = frame.WhichOneof("frame")
            if kind == "dispatch":
                self.on_dispatch(frame.dispatch.task)
            elif kind == "dispatches":
                # Exactly N Dispatch frames, in order: each task is checked on its own.
                for envelope in frame.dispatches.tasks:
                    self.on_dispatch(envelope)
            elif kind == "cancel":
                self.on_cancel(frame.cancel)
            elif kind == "batch_dispatch":
                self.on_batch_dispatch(frame.batch_dispatch)
            elif kind not in ("ping", "welcome"):
                logger.debug("worker.frame_ignored kind=%s", kind)

    async def _write_loop(
        self, call: grpc.aio.StreamStreamCall[svc.WorkerFrame, svc.ServerFrame]
    ) -> None:
        outbox = self.outbox
        loop = asyncio.get_running_loop()
        last_write = -WRITE_INTERVAL
        while True:
            await outbox.wait()
            wait = last_write + WRITE_INTERVAL - loop.time()
            if wait > 0 and not outbox.closed:
                await asyncio.sleep(wait)  # busy: let what finishes meanwhile join
            for frame in outbox.drain():
                await call.write(frame)
            last_write = loop.time()
            outbox.written()
            if outbox.closed and not outbox.pending:
                await call.done_writing()
                return

    async def _heartbeat_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.outbox.put_frame(_HEARTBEAT)

    # ---------------------------------------------------------------- frames in

    def on_dispatch(self, envelope: pb.TaskEnvelope) -> None:
        """Run a dispatched task, hold it until a slot frees, or answer it at once when
        it cannot run here."""
        key = (envelope.id, envelope.lease_id)
        registration = self._take_on(envelope, key)
        if registration is None:
            return
        self.holding.add(key)
        if self.slots.full:
            logger.info("worker.dispatch_waiting task_id=%s", envelope.id)
            self.waiting[key] = (envelope, registration)
        else:
            self.slots.start(envelope, registration, self)

    def _take_on(self, envelope: pb.TaskEnvelope, key: tuple[str, str]) -> Registration | None:
        """The handler to run a dispatch with; None when the dispatch was answered at once
        (RELEASE, or FAILURE for want of a handler) or must be ignored."""
        if not envelope.id or not envelope.lease_id:
            logger.warning("worker.dispatch_malformed task_id=%s", envelope.id)
            return None
        if self.outbox.closed:
            # Half-closed: nothing can be written any more; the server releases every
            # task the session holds when the stream ends.
            logger.info("worker.dispatch_after_close task_id=%s", envelope.id)
            return None
        if self.slots.stopping:
            self.send(make_result(*key, svc.OUTCOME_RELEASE))
            return None
        if self.slots.get(key) is not None or key in self.waiting:
            logger.warning("worker.dispatch_duplicate task_id=%s lease_id=%s", *key)
            return None
        concurrency = self.concurrency
        if len(self.holding) >= concurrency:
            logger.warning(
                "worker.dispatch_over_capacity task_id=%s held=%d concurrency=%d",
                envelope.id,
                len(self.holding),
                concurrency,
            )
            self.send(make_result(*key, svc.OUTCOME_RELEASE))
            return None
        registration = self.handlers.get(envelope.type)
        if registration is None:
            logger.warning("worker.no_handler task_id=%s type=%s", envelope.id, envelope.type)
            error = f"no handler for type {envelope.type}"
            self.send(make_result(*key, svc.OUTCOME_FAILURE, error=error))
        return registration

    def credit(self, queue: str, n: int) -> None:
        """Ask the server for ``n`` more slots on ``queue`` (fewer when negative): a
        Credit frame, and this session holds as many more (or fewer) from now on."""
        self.concurrency = max(0, self.concurrency + n)
        self.outbox.put_frame(svc.WorkerFrame(credit=svc.Credit(queue=queue, n=n)))

    def slot_freed(self) -> None:
        """A local slot freed: start the oldest waiting dispatch (RELEASE it when
        stopping)."""
        slots = self.slots
        while self.waiting and not slots.full:
            key = next(iter(self.waiting))
            waiting = self.waiting.pop(key)
            if slots.stopping:
                self._release_waiting(key, waiting)
            elif isinstance(waiting[0], svc.BatchDispatch):
                batch, batch_registration = waiting
                assert isinstance(batch_registration, BatchRegistration)
                slots.start_batch(batch, batch_registration, self)
            else:
                envelope, registration = waiting
                assert isinstance(registration, Registration)
                slots.start(envelope, registration, self)

    def release_waiting(self) -> None:
        """Give back every dispatch still waiting for a slot."""
        for key in list(self.waiting):
            self._release_waiting(key, self.waiting.pop(key))

    def _release_waiting(self, key: tuple[str, str], waiting: Waiting) -> None:
        item = waiting[0]
        if isinstance(item, svc.BatchDispatch):
            self._answer_batch(key, item, svc.OUTCOME_RELEASE)
        else:
            self.send(make_result(*key, svc.OUTCOME_RELEASE))

    def on_batch_dispatch(self, batch: svc.BatchDispatch) -> None:
        """Run an aggregation group's batch with its type's batch handler (one slot for
        all its members), hold it until a slot frees, or answer every member at once
        when it cannot run here: RELEASE (beyond the concurrency, or shutting down), or
        FAILURE when the worker has no batch handler for its type."""
        envelopes = [e for e in batch.tasks if e.id and e.lease_id]
        if len(envelopes) < len(batch.tasks):
            logger.warning(
                "worker.batch_dispatch_malformed type=%s unanswerable=%d",
                batch.type,
                len(batch.tasks) - len(envelopes),
            )
        if not envelopes:
            return
        if self.outbox.closed:
            logger.info("worker.dispatch_after_close task_id=%s", envelopes[0].id)
            return
        lease_id = envelopes[0].lease_id
        if any(e.lease_id != lease_id for e in envelopes):
            # Not a batch the server sends: answer each member under its own lease.
            logger.warning("worker.batch_dispatch_mixed_leases type=%s", batch.type)
            for envelope in envelopes:
                error = "malformed batch: its tasks are not under one lease"
                self.send(
                    make_result(envelope.id, envelope.lease_id, svc.OUTCOME_FAILURE, error=error)
                )
            return
        if len(envelopes) < len(batch.tasks):
            batch = svc.BatchDispatch(
                queue=batch.queue, group=batch.group, type=batch.type, tasks=envelopes
            )
        key = (envelopes[0].id, lease_id)
        if self.slots.stopping:
            self._answer_batch(key, batch, svc.OUTCOME_RELEASE)
            return
        if (
            self.slots.get(key) is not None
            or self.slots.get_batch(lease_id) is not None
            or key in self.waiting
        ):
            logger.warning("worker.dispatch_duplicate task_id=%s lease_id=%s", *key)
            return
        if len(self.holding) >= self.concurrency:
            logger.warning(
                "worker.dispatch_over_capacity task_id=%s held=%d concurrency=%d",
                key[0],
                len(self.holding),
                self.concurrency,
            )
            self._answer_batch(key, batch, svc.OUTCOME_RELEASE)
            return
        registration = self.batch_handlers.get(batch.type)
        if registration is None:
            logger.warning(
                "worker.batch_dispatch_unsupported type=%s n=%d", batch.type, len(envelopes)
            )
            error = f"this worker does not accept batches of type {batch.type}"
            self._answer_batch(key, batch, svc.OUTCOME_FAILURE, error=error)
            return
        self.holding.add(key)
        if self.slots.full:
            logger.info("worker.dispatch_waiting task_id=%s tasks=%d", key[0], len(envelopes))
            self.waiting[key] = (batch, registration)
        else:
            self.slots.start_batch(batch, registration, self)

    def _answer_batch(
        self,
        key: tuple[str, str],
        batch: svc.BatchDispatch,
        outcome: svc.Outcome,
        *,
        error: str = "",
    ) -> None:
        """Answer every member of ``batch`` with ``outcome``, in one BatchResult."""
        results = [make_result(e.id, e.lease_id, outcome, error=error) for e in batch.tasks]
        self.send_batch(key, results)

    def _waiting_key(self, cancel: svc.Cancel) -> tuple[str, str] | None:
        """The waiting delivery a Cancel names: a task by its key, a batch by its lease
        (the Cancel names any one of its members)."""
        key = (cancel.task_id, cancel.lease_id)
        if key in self.waiting:
            return key
        if not cancel.lease_id:
            return None
        return next(
            (
                k
                for k, (item, _) in self.waiting.items()
                if k[1] == cancel.lease_id and isinstance(item, svc.BatchDispatch)
            ),
            None,
        )

    def on_cancel(self, cancel: svc.Cancel) -> None:
        """Cancel the handler of a lost lease; its Result is never sent. A Cancel naming
        a batch's lease cancels the whole batch, whichever member it names."""
        self.holding.discard((cancel.task_id, cancel.lease_id))
        waiting = self._waiting_key(cancel)
        if waiting is not None:
            del self.waiting[waiting]
            self.holding.discard(waiting)
            logger.info("worker.cancel_waiting task_id=%s", cancel.task_id)
            return
        execution = self.slots.get((cancel.task_id, cancel.lease_id))
        if execution is None and cancel.lease_id:
            execution = self.slots.get_batch(cancel.lease_id)
        if execution is None and not cancel.lease_id:
            execution = self.slots.find(cancel.task_id)
        if execution is None or execution.origin is not self:
            logger.debug("worker.cancel_unknown task_id=%s", cancel.task_id)
            return
        logger.info("worker.cancel task_id=%s reason=%s", cancel.task_id, cancel.reason)
        self.holding.discard(execution.key)
        execution.suppressed = True
        execution.cancel(
            f"cancelled by the server: {cancel.reason}"
            if cancel.reason
            else "cancelled by the server"
        )

    # --------------------------------------------------------------- frames out

    def send(self, result: svc.Result) -> None:
        """Queue a Result on this session, unless it can no longer be written."""
        self.holding.discard((result.task_id, result.lease_id))
        if self.live:
            self.outbox.put_result(result)

    def send_batch(self, key: tuple[str, str], results: list[svc.Result]) -> None:
        """Queue the BatchResult answering the batch ``key`` (its first member's task id
        and its lease id), unless it can no longer be written."""
        self.holding.discard(key)
        if self.live:
            self.outbox.put_batch(results)

    async def dependency_results(
        self, task_id: str, lease_id: str, cursor: str
    ) -> svc.GetDependencyResultsResponse:
        """A page of a delivery's dependencies' results, read on this session's channel.
        Raises the SDK's errors (:class:`Unavailable` once the session is over)."""
        channel = self._channel
        if channel is None or not self.live:
            raise Unavailable("the session this task came on has ended", code="UNAVAILABLE")
        call: grpc.aio.UnaryUnaryMultiCallable[
            svc.GetDependencyResultsRequest, svc.GetDependencyResultsResponse
        ] = channel.unary_unary(
            DEPENDENCY_RESULTS_METHOD,
            request_serializer=svc.GetDependencyResultsRequest.SerializeToString,
            response_deserializer=svc.GetDependencyResultsResponse.FromString,
        )
        request = svc.GetDependencyResultsRequest(task_id=task_id, lease_id=lease_id, cursor=cursor)
        try:
            return await call(
                request,
                metadata=auth_metadata(self.settings.token),
                timeout=DEPENDENCY_RESULTS_TIMEOUT,
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, task_id=task_id) from None

    def send_progress(self, task_id: str, lease_id: str, data: bytes) -> None:
        """Queue a Progress frame for a running delivery of this session."""
        if self.live:
            self.outbox.put_progress(task_id, lease_id, data)
