"""WorkerService.Session: the handshake, the frame writer (the session's transport), and
the session's lifetime.

The contract is docs/protocol.md. Choices made here:

- Hello problems end the stream before anything is leased: INVALID_ARGUMENT for a missing
  or malformed Hello (or none within ``hello_timeout``), FAILED_PRECONDITION for a version
  mismatch, naming both versions.
- After Hello, a malformed frame (a second Hello, an empty frame, a Result with no lease)
  is logged and ignored; the stream stays up. Ending it would release every task the
  worker is running just because of one bad frame, and nothing a bad frame can say
  changes a task without a lease it holds.
- A frame whose bytes are not a WorkerFrame at all (see :mod:`conveyor_api.decoding`) ends
  the stream with INVALID_ARGUMENT, naming the frame type: the peer's encoding is broken,
  so nothing more it sends can be trusted. Its tasks are released as on any other end.
- Every server frame goes through one writer task, so frames never interleave. The tasks
  a dispatch offer brought go out as one Dispatches frame when the worker's Hello set
  ``accepts_dispatches`` (cut at DISPATCHES_MAX_BYTES), else as one Dispatch frame each.
- However the stream ends (worker half-close, cancel, broken connection, server shutdown)
  the gateway releases everything it still holds at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import grpc
from conveyor_broker import Broker, InvalidTask, validation
from conveyor_broker.clock import Clock
from conveyor_broker.ids import new_id
from conveyor_broker.validation import check_queue, check_text
from conveyor_gateway import Gateway, GatewayConfig, WorkerSpec
from conveyor_protos.v1 import service_pb2, service_pb2_grpc, task_pb2
from conveyor_runtime.decoding import Undecodable, malformed_message
from conveyor_runtime.wire import duration

from conveyor_api.broker_status import abort_for_error, status_message
from conveyor_api.dependency_results import dependency_results
from conveyor_api.semver import at_least

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    _Context = grpc.aio.ServicerContext[service_pb2.WorkerFrame, service_pb2.ServerFrame]

#: A Hello must arrive this soon after the stream opens.
HELLO_TIMEOUT = 10.0
#: Defaults of the frame writer's bounds (ApiSettings: session_max_pending_frames,
#: session_write_timeout).
MAX_PENDING_FRAMES = 1000
WRITE_TIMEOUT = 60.0
#: Most queues one session may serve (each costs the gateway NATS subscriptions).
MAX_QUEUES = 1000
#: The largest weight of one queue (as for webhook workers).
MAX_QUEUE_WEIGHT = validation.MAX_QUEUE_WEIGHT
#: The most tasks one worker runs at once (as for webhook workers).
MAX_CONCURRENCY = validation.MAX_WEBHOOK_CONCURRENCY
#: Labels go into every Register message, for every queue, every register tick: few and
#: short.
MAX_LABELS = 16
MAX_LABEL_KEY_LEN = 64
MAX_LABEL_VALUE_LEN = 256
MAX_WORKER_ID_LEN = 256
#: sdk_name, sdk_version and min_server_version.
MAX_VERSION_LEN = 64
#: The official Python SDK's sdk_name (an empty one is it too: its older releases send
#: none). Only its sdk_version is held to the server's min_sdk_version.
PYTHON_SDK = "conveyor-python"
#: Task types a worker takes as aggregation batches.
MAX_BATCH_TYPES = 100
FIRST_FRAME_MUST_BE_HELLO = "first frame must be Hello"
#: The INVALID_ARGUMENT message for a frame that does not parse.
MALFORMED_FRAME = malformed_message(service_pb2.WorkerFrame.DESCRIPTOR.full_name)
#: How ``_serve`` says the session ended on a frame that does not parse.
_ENDED_BY_MALFORMED = "malformed frame"
#: How ``_serve`` says the session ended on a worker that does not read its stream.
_ENDED_BY_SLOW_READER = "slow reader"
#: The RESOURCE_EXHAUSTED message then.
SLOW_READER = (
    "the session's frames were not being read: session ended, its tasks released; reconnect"
)


class HelloRejected(Exception):
    """A Hello the server will not accept, with the status to end the stream with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def check_hello(hello: service_pb2.Hello, server_version: str, min_sdk_version: str) -> WorkerSpec:
    """The worker's declaration, or HelloRejected saying what is wrong with it: which field,
    and the limit it broke."""
    problem = hello_problem(hello)
    if problem is not None:
        raise HelloRejected(grpc.StatusCode.INVALID_ARGUMENT, problem)
    official = hello.sdk_name in ("", PYTHON_SDK)
    versions = (
        f"server version {server_version} (worker needs >= {hello.min_server_version or 'any'})"
    )
    if official:
        versions += f", sdk version {hello.sdk_version!r} (server needs >= {min_sdk_version})"
    try:
        compatible = at_least(server_version, hello.min_server_version) and (
            # A third-party SDK's version is its own business: never compared, never refused.
            not official or at_least(hello.sdk_version, min_sdk_version)
        )
    except ValueError as exc:
        raise HelloRejected(
            grpc.StatusCode.FAILED_PRECONDITION, f"unparsable version: {exc}; {versions}"
        ) from None
    if not compatible:
        raise HelloRejected(grpc.StatusCode.FAILED_PRECONDITION, f"incompatible: {versions}")
    return WorkerSpec(
        queues=dict(hello.queues),
        concurrency=hello.concurrency,
        labels=dict(hello.labels),
        worker_id=hello.worker_id,
        sdk_version=hello.sdk_version,
        batch_types=tuple(hello.batch_types),
        sdk_name=hello.sdk_name,
    )


def hello_problem(hello: service_pb2.Hello) -> str | None:
    """What is wrong with the fields of ``hello`` (its versions aside), or None."""
    if not hello.queues:
        return "Hello must name at least one queue"
    if len(hello.queues) > MAX_QUEUES:
        return f"Hello names {len(hello.queues)} queues; at most {MAX_QUEUES} are allowed"
    for queue, weight in hello.queues.items():
        try:
            check_queue(queue)
        except InvalidTask as exc:
            return str(exc)
        if not 1 <= weight <= MAX_QUEUE_WEIGHT:
            return f"weight of queue {queue!r} must be 1..{MAX_QUEUE_WEIGHT}, got {weight}"
    if not 1 <= hello.concurrency <= MAX_CONCURRENCY:
        return f"concurrency must be 1..{MAX_CONCURRENCY}, got {hello.concurrency}"
    if len(hello.labels) > MAX_LABELS:
        return f"Hello has {len(hello.labels)} labels; at most {MAX_LABELS} are allowed"
    for key, value in hello.labels.items():
        if not 0 < len(key) <= MAX_LABEL_KEY_LEN:
            return f"label key {key[:80]!r} must be 1-{MAX_LABEL_KEY_LEN} characters"
        if len(value) > MAX_LABEL_VALUE_LEN:
            return (
                f"label {key!r} is {len(value)} characters; at most "
                f"{MAX_LABEL_VALUE_LEN} are allowed"
            )
    fields = [("worker_id", hello.worker_id, MAX_WORKER_ID_LEN)]
    fields += [
        ("sdk_name", hello.sdk_name, MAX_VERSION_LEN),
        ("sdk_version", hello.sdk_version, MAX_VERSION_LEN),
        ("min_server_version", hello.min_server_version, MAX_VERSION_LEN),
    ]
    for name, text, limit in fields:
        if len(text) > limit:
            return f"{name} is {len(text)} characters; at most {limit} are allowed"
    if len(hello.batch_types) > MAX_BATCH_TYPES:
        return (
            f"Hello has {len(hello.batch_types)} batch_types; at most {MAX_BATCH_TYPES} are allowed"
        )
    texts = [(f"label key {k!r}", k) for k in hello.labels]
    texts += [(f"label {k!r}", v) for k, v in hello.labels.items()]
    texts += [(name, text) for name, text, _ in fields]
    texts += [("a batch type", t) for t in hello.batch_types]
    for name, text in texts:
        try:
            check_text(name, text)
        except InvalidTask as exc:
            return str(exc)
    for batch_type in hello.batch_types:
        if not 0 < len(batch_type) <= validation.MAX_TYPE_LEN:
            return f"a batch type must be 1-{validation.MAX_TYPE_LEN} characters"
    return None


class SlowReader(Exception):
    """The worker is not reading its stream: too many frames wait to be written to it, or
    one write has been stuck too long. The session ends and its tasks are released."""


class FrameWriter:
    """The one coroutine that writes to a session's stream, and the session's
    :class:`~conveyor_gateway.transport.Transport`: ``batches`` when the worker takes a
    dispatch's tasks in one Dispatches frame.

    Bounded: a worker that keeps its stream open (and heartbeats) but stops reading would
    otherwise pin its tasks and an ever longer queue of frames here. More than
    ``max_pending`` frames waiting, or one write blocked (the stream's flow-control window
    full) for ``write_timeout`` seconds, ends :attr:`task` with :class:`SlowReader`.

    Keepalive: with ``ping_interval`` set, a stream that had nothing queued for that long
    gets a ``Ping`` (stamped with ``now()``), so an idle session still carries a frame
    from the server at least that often.
    """

    def __init__(
        self,
        context: _Context,
        *,
        batches: bool = False,
        max_pending: int = MAX_PENDING_FRAMES,
        write_timeout: float = WRITE_TIMEOUT,
        ping_interval: float | None = None,
        now: Callable[[], datetime] | None = None,
    ) -> None:
        self._context = context
        self._batches = batches
        self._frames: deque[service_pb2.ServerFrame] = deque()
        self._ready = asyncio.Event()
        self._max_pending = max_pending
        self._write_timeout = write_timeout
        #: When the write in progress began (loop time); None between writes.
        self._writing_since: float | None = None
        self._failure: SlowReader | None = None
        loop = asyncio.get_running_loop()
        self.task = loop.create_task(self._run())
        self.task.add_done_callback(_consume_exception)
        # A timer rather than a timeout around each write: the write is the hot path.
        self._watch = loop.call_later(write_timeout / 2, self._check_stuck)
        self.task.add_done_callback(lambda _: self._watch.cancel())
        #: When a frame was last queued (loop time), for the keepalive.
        self._last_sent = loop.time()
        self._ping_interval = ping_interval
        self._now = now or (lambda: datetime.now(UTC))
        if ping_interval is not None:
            self._pinger = loop.call_later(ping_interval, self._ping_if_idle)
            self.task.add_done_callback(lambda _: self._pinger.cancel())

    @property
    def slow_reader(self) -> bool:
        """True once the writer gave the session up for not reading."""
        return self._failure is not None

    def send(self, frame: service_pb2.ServerFrame) -> None:
        """Queue ``frame``; frames go out in the order they were sent."""
        if self.task.done():
            return  # the session is ending: nothing more reaches the worker
        self._frames.append(frame)
        self._last_sent = asyncio.get_running_loop().time()
        self._ready.set()
        if len(self._frames) > self._max_pending:
            self._give_up(f"{len(self._frames)} frames wait to be written")

    def _ping_if_idle(self) -> None:
        interval = self._ping_interval
        assert interval is not None
        loop = asyncio.get_running_loop()
        idle = loop.time() - self._last_sent
        if idle >= interval:
            ping = service_pb2.Ping()
            ping.sent_at.FromDatetime(self._now())
            self.send(service_pb2.ServerFrame(ping=ping))
            idle = 0.0
        if not self.task.done():
            self._pinger = loop.call_later(interval - idle, self._ping_if_idle)

    def _check_stuck(self) -> None:
        loop = asyncio.get_running_loop()
        since = self._writing_since
        if since is not None and loop.time() - since >= self._write_timeout:
            self._give_up(f"a write has waited {loop.time() - since:.1f} s")
            return
        self._watch = loop.call_later(self._write_timeout / 2, self._check_stuck)

    def _give_up(self, why: str) -> None:
        if self.task.done():
            return
        logger.warning("session.slow_reader why=%s: ending the session", why)
        self._frames.clear()
        self._failure = SlowReader(why)
        self.task.cancel()

    def dispatch(self, tasks: Sequence[task_pb2.TaskEnvelope]) -> None:
        """Queue the tasks of one dispatch offer: in Dispatches frames of at most
        DISPATCHES_MAX_BYTES (a bigger task alone) for a worker that takes them, else in
        one Dispatch frame each."""
        if not self._batches:
            for env in tasks:
                self.send(service_pb2.ServerFrame(dispatch=service_pb2.Dispatch(task=env)))
            return
        # One frame for the whole offer (each stream write costs tens of microseconds on
        # both ends, far more than the envelopes it carries), cut at DISPATCHES_MAX_BYTES
        # so no worker gets a message bigger than that or than one task alone.
        for chunk in frame_chunks(tasks):
            self.send(service_pb2.ServerFrame(dispatches=service_pb2.Dispatches(tasks=chunk)))

    def dispatch_batch(self, batch: service_pb2.BatchDispatch) -> None:
        """Queue a BatchDispatch frame (the worker listed its type in batch_types)."""
        self.send(service_pb2.ServerFrame(batch_dispatch=batch))

    def cancel(self, task_id: str, lease_id: str, reason: str) -> None:
        """Queue a Cancel frame."""
        cancel = service_pb2.Cancel(task_id=task_id, lease_id=lease_id, reason=reason)
        self.send(service_pb2.ServerFrame(cancel=cancel))

    async def _run(self) -> None:
        # A dispatch queues a burst of frames at once: write them back to back, waking
        # only when the queue runs dry (an asyncio.Queue costs a future per frame).
        frames = self._frames
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                while frames:
                    self._writing_since = loop.time()
                    await self._context.write(_next_frame(frames))
                    self._writing_since = None
        except asyncio.CancelledError:
            if self._failure is not None:
                raise self._failure from None
            raise


#: The most bytes of tasks in one Dispatches frame (a single bigger task goes alone), so
#: a worker's receive limit need only fit the largest task.
DISPATCHES_MAX_BYTES = 1024 * 1024


def frame_chunks(
    envelopes: Sequence[task_pb2.TaskEnvelope],
) -> list[list[task_pb2.TaskEnvelope]]:
    """``envelopes`` in order, in runs of at most DISPATCHES_MAX_BYTES."""
    chunks: list[list[task_pb2.TaskEnvelope]] = []
    chunk: list[task_pb2.TaskEnvelope] = []
    used = 0
    for envelope in envelopes:
        size = envelope.ByteSize() + 8
        if chunk and used + size > DISPATCHES_MAX_BYTES:
            chunks.append(chunk)
            chunk, used = [], 0
        chunk.append(envelope)
        used += size
    if chunk:
        chunks.append(chunk)
    return chunks


#: Dispatches frames waiting together are written as one, up to this many bytes: each
#: stream write costs tens of microseconds on both ends, and with many queues each
#: dispatch offer carries a task or two.
MERGE_MAX_BYTES = DISPATCHES_MAX_BYTES


def _next_frame(frames: deque[service_pb2.ServerFrame]) -> service_pb2.ServerFrame:
    """Take the next frame to write: Dispatches frames at the head of the queue become
    one (in order, up to MERGE_MAX_BYTES), every other frame goes as it is."""
    frame = frames.popleft()
    if not frames or frame.WhichOneof("frame") != "dispatches":
        return frame
    if frames[0].WhichOneof("frame") != "dispatches":
        return frame
    size = frame.ByteSize()
    merged = service_pb2.Dispatches()
    merged.tasks.extend(frame.dispatches.tasks)
    while frames and frames[0].WhichOneof("frame") == "dispatches":
        more = frames[0].ByteSize()
        if size + more > MERGE_MAX_BYTES:
            break
        merged.tasks.extend(frames.popleft().dispatches.tasks)
        size += more
    return service_pb2.ServerFrame(dispatches=merged)


class SessionRegistry:
    """The live gateways of this process, and the closes still running."""

    def __init__(self) -> None:
        self.gateways: dict[str, Gateway] = {}
        self._stops: dict[str, asyncio.Event] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def add(self, gateway: Gateway) -> asyncio.Event:
        """Track ``gateway``; the returned event is set when the server wants it gone."""
        stop = asyncio.Event()
        self.gateways[gateway.id] = gateway
        self._stops[gateway.id] = stop
        return stop

    def close_soon(self, gateway: Gateway) -> asyncio.Task[None]:
        """Close ``gateway`` in a task of its own that outlives a cancelled handler."""
        self.gateways.pop(gateway.id, None)
        self._stops.pop(gateway.id, None)
        task = asyncio.get_running_loop().create_task(gateway.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    def cancel_task(self, task_id: str, reason: str) -> bool:
        """Cancel ``task_id`` on whichever local session holds it."""
        return any(gw.cancel(task_id, reason) for gw in list(self.gateways.values()))

    async def shutdown(self) -> None:
        """Ask every session to end and wait until each has released its tasks."""
        gateways = list(self.gateways.values())
        for stop in self._stops.values():
            stop.set()
        for gateway in gateways:
            self.close_soon(gateway)
        while self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


class WorkerService(service_pb2_grpc.WorkerServiceServicer):
    """Accepts worker sessions; each one gets a Gateway for as long as it lasts."""

    def __init__(
        self,
        *,
        registry: SessionRegistry,
        clock: Clock,
        config: GatewayConfig,
        server_version: str,
        min_sdk_version: str,
        make_gateway: Callable[[str, WorkerSpec, FrameWriter], Gateway],
        hello_timeout: float = HELLO_TIMEOUT,
        max_pending_frames: int = MAX_PENDING_FRAMES,
        write_timeout: float = WRITE_TIMEOUT,
        broker: Broker | None = None,
    ) -> None:
        """``broker`` serves GetDependencyResults (UNIMPLEMENTED without one)."""
        self._broker = broker
        self._max_pending_frames = max_pending_frames
        self._write_timeout = write_timeout
        self._registry = registry
        self._clock = clock
        self._config = config
        self._server_version = server_version
        self._min_sdk_version = min_sdk_version
        self._make_gateway = make_gateway
        self._hello_timeout = hello_timeout

    async def _read_hello(self, context: _Context) -> service_pb2.Hello:
        try:
            first: object = await asyncio.wait_for(context.read(), self._hello_timeout)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{FIRST_FRAME_MUST_BE_HELLO} (none within {self._hello_timeout:g} s)",
            )
        if isinstance(first, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MALFORMED_FRAME)
        if not isinstance(first, service_pb2.WorkerFrame) or first.WhichOneof("frame") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, FIRST_FRAME_MUST_BE_HELLO)
        return first.hello

    def _welcome(self, session_id: str) -> service_pb2.ServerFrame:
        ttl = self._config.lease_ttl
        return service_pb2.ServerFrame(
            welcome=service_pb2.Welcome(
                session_id=session_id,
                lease_ttl=duration(ttl),
                heartbeat_interval=duration(ttl / 3),
                server_version=self._server_version,
                min_sdk_version=self._min_sdk_version,
                max_result=self._config.max_result,
            )
        )

    async def GetDependencyResults(
        self, request: service_pb2.GetDependencyResultsRequest, context: _Context
    ) -> service_pb2.GetDependencyResultsResponse:
        """The results of the dependencies of a task the caller runs (see
        :mod:`conveyor_api.dependency_results`)."""
        if self._broker is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no broker to read from")
        try:
            return await dependency_results(self._broker, request)
        except Exception as exc:
            await abort_for_error(context, exc)

    async def Session(
        self,
        request_iterator: AsyncIterator[service_pb2.WorkerFrame],
        context: _Context,
    ) -> None:
        """Handshake, then serve the session until the stream ends."""
        hello = await self._read_hello(context)
        try:
            spec = check_hello(hello, self._server_version, self._min_sdk_version)
        except HelloRejected as exc:
            logger.info("session.rejected code=%s reason=%s", exc.code.name, exc.message)
            await context.abort(exc.code, status_message(exc.message))
        session_id = new_id(self._clock.now())
        writer = FrameWriter(
            context,
            batches=hello.accepts_dispatches,
            max_pending=self._max_pending_frames,
            write_timeout=self._write_timeout,
            ping_interval=self._config.lease_ttl.total_seconds() / 3,
            now=self._clock.now,
        )
        writer.send(self._welcome(session_id))
        gateway = self._make_gateway(session_id, spec, writer)
        stop = self._registry.add(gateway)
        logger.info(
            "session.opened session=%s worker=%s sdk=%s/%s queues=%s concurrency=%d",
            session_id,
            spec.worker_id,
            spec.sdk_name or "conveyor-python",
            spec.sdk_version,
            dict(spec.queues),
            spec.concurrency,
        )
        try:
            ended_by = await self._serve(context, gateway, writer, stop)
        finally:
            writer.task.cancel()
            closing = self._registry.close_soon(gateway)
            # Shielded: if this handler is being cancelled (the peer went away), the
            # release still runs to the end in its own task.
            await asyncio.shield(closing)
        logger.info("session.ended session=%s by=%s", session_id, ended_by)
        if ended_by == "server":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server shutting down; reconnect")
        if ended_by == "error":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "session could not start; reconnect")
        if ended_by == _ENDED_BY_SLOW_READER:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, SLOW_READER)
        if ended_by == _ENDED_BY_MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MALFORMED_FRAME)

    async def _serve(
        self, context: _Context, gateway: Gateway, writer: FrameWriter, stop: asyncio.Event
    ) -> str:
        """Run the session until it ends; say who ended it."""
        try:
            await gateway.start()
        except Exception:
            logger.exception("session.start_failed session=%s", gateway.id)
            return "error"
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read_frames(context, gateway))
        reader.add_done_callback(_consume_exception)
        stopper = loop.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait(
                {reader, stopper, writer.task}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            reader.cancel()
            stopper.cancel()
        if stopper in done:
            return "server"
        if writer.task in done:
            return _ENDED_BY_SLOW_READER if writer.slow_reader else "broken stream"
        if reader in done and reader.exception() is None and reader.result():
            return _ENDED_BY_MALFORMED
        return "worker"

    async def _read_frames(self, context: _Context, gateway: Gateway) -> bool:
        """Hand frames to ``gateway`` until the stream ends; True if it ended on a frame
        that does not parse."""
        while True:
            frame: object = await context.read()
            if frame is grpc.aio.EOF:
                return False
            if isinstance(frame, Undecodable):
                logger.warning("session.malformed_frame session=%s", gateway.id)
                return True
            if not isinstance(frame, service_pb2.WorkerFrame):
                return False
            _hand_over(gateway, frame)


def _hand_over(gateway: Gateway, frame: service_pb2.WorkerFrame) -> None:
    """Hand one worker frame after Hello to ``gateway``. A frame that has no place there is
    logged and ignored, so one bad frame cannot cost the session its tasks."""
    kind = frame.WhichOneof("frame")
    if kind == "result":
        gateway.on_results((frame.result,))
    elif kind == "batch_result":
        gateway.on_batch_result(frame.batch_result.results)
    elif kind == "heartbeat":
        gateway.on_heartbeat()
    elif kind == "progress":
        progress = frame.progress
        gateway.on_progress(progress.task_id, progress.lease_id, bytes(progress.progress))
    elif kind == "credit":
        gateway.on_credit(frame.credit.queue, frame.credit.n)
    elif kind == "drain":
        gateway.drain()
    elif kind == "hello":
        logger.warning("session.second_hello_ignored session=%s", gateway.id)
    else:
        logger.warning("gateway.unexpected_frame gateway=%s kind=%s", gateway.id, kind)


def _consume_exception(task: asyncio.Task[Any]) -> None:
    # A read or write fails when the stream breaks; that just ends the session.
    if not task.cancelled() and task.exception() is not None:
        logger.debug("session.stream_error error=%r", task.exception())
