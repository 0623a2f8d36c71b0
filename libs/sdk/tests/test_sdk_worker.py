"""The Worker against a scripted WorkerService double on a real gRPC socket (task
handlers, then aggregation-group batch handlers at the end).

The double plays the server side of docs/protocol.md: it records every frame the worker
sends and lets each test push frames (Dispatch, Cancel) or end the stream with a status.
Every wait is on a condition with a timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import conveyor
import grpc
import grpc.aio
import pytest
from conveyor import (
    BatchContext,
    FailedPrecondition,
    InvalidArgument,
    JsonCodec,
    PermissionDenied,
    ReconnectBackoff,
    RetryAfter,
    SkipRetry,
    TaskContext,
    Unauthenticated,
    Worker,
)
from conveyor._worker.batch import batch_outcomes, fit_batch
from conveyor._worker.execution import make_result
from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb
from conveyor_testkit.polling import wait_until
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

WAIT = 10.0
FAST = ReconnectBackoff(initial=0.02, maximum=0.1, jitter=0.0)


def seconds(value: float) -> Duration:
    d = Duration()
    d.FromTimedelta(timedelta(seconds=value))
    return d


def envelope(
    task_id: str,
    task_type: str = "t.echo",
    payload: bytes = b'{"n":1}',
    *,
    queue: str = "default",
    timeout: float | None = None,
    deadline: datetime | None = None,
) -> pb.TaskEnvelope:
    env = pb.TaskEnvelope(
        id=task_id,
        queue=queue,
        type=task_type,
        payload=payload,
        lease_id=f"L-{task_id}",
        attempt=1,
        max_retry=3,
        headers={"h": "v"},
    )
    if timeout is not None:
        env.timeout.CopyFrom(seconds(timeout))
    if deadline is not None:
        ts = Timestamp()
        ts.FromDatetime(deadline)
        env.deadline.CopyFrom(ts)
    return env


def dispatch(env: pb.TaskEnvelope) -> svc.ServerFrame:
    return svc.ServerFrame(dispatch=svc.Dispatch(task=env))


@dataclass
class Abort:
    code: grpc.StatusCode
    details: str


@dataclass
class ScriptedSession:
    """One Session stream, as the double sees it."""

    hello: svc.Hello
    metadata: dict[str, str]
    inbox: asyncio.Queue[svc.WorkerFrame | None] = field(default_factory=asyncio.Queue)
    outgoing: asyncio.Queue[svc.ServerFrame | Abort | None] = field(default_factory=asyncio.Queue)
    received: list[svc.WorkerFrame] = field(default_factory=list)
    half_closed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def send(self, frame: svc.ServerFrame) -> None:
        self.outgoing.put_nowait(frame)

    def cancel(self, task_id: str, reason: str = "lease lost") -> None:
        cancel = svc.Cancel(task_id=task_id, lease_id=f"L-{task_id}", reason=reason)
        self.send(svc.ServerFrame(cancel=cancel))

    async def frame(self, kind: str) -> svc.WorkerFrame:
        """The next frame of ``kind`` (earlier frames of other kinds are skipped)."""
        while True:
            frame = await asyncio.wait_for(self.inbox.get(), WAIT)
            assert frame is not None, f"stream half-closed while waiting for {kind}"
            if frame.WhichOneof("frame") == kind:
                return frame

    async def results(self, n: int) -> list[svc.Result]:
        """The next ``n`` Results, whether sent alone or in BatchResults."""
        out: list[svc.Result] = []
        while len(out) < n:
            frame = await asyncio.wait_for(self.inbox.get(), WAIT)
            assert frame is not None, f"stream half-closed after {len(out)} of {n} results"
            if frame.HasField("result"):
                out.append(frame.result)
            elif frame.HasField("batch_result"):
                out.extend(frame.batch_result.results)
        assert len(out) == n, out
        return out

    def all_results(self) -> list[svc.Result]:
        out: list[svc.Result] = []
        for frame in self.received:
            if frame.HasField("result"):
                out.append(frame.result)
            out.extend(frame.batch_result.results)
        return out


class WorkerServiceDouble:
    """A scripted conveyor.v1.WorkerService: Welcome after Hello, then whatever the test
    pushes; ends the stream with OK when the worker half-closes."""

    def __init__(self, *, heartbeat: float = 30.0, max_result: int = 0) -> None:
        self.heartbeat = heartbeat
        self.max_result = max_result
        self.reject: Abort | None = None
        self.sessions: asyncio.Queue[ScriptedSession] = asyncio.Queue()

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.stream_stream_rpc_method_handler(
            self.session,
            request_deserializer=svc.WorkerFrame.FromString,
            response_serializer=svc.ServerFrame.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(
            "conveyor.v1.WorkerService", {"Session": method}
        )

    async def session(self, _: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        first = await context.read()
        assert isinstance(first, svc.WorkerFrame), first
        assert first.HasField("hello"), first
        metadata = {k: str(v) for k, v in (context.invocation_metadata() or ())}
        scripted = ScriptedSession(hello=first.hello, metadata=metadata)
        self.sessions.put_nowait(scripted)
        if self.reject is not None:
            await context.abort(self.reject.code, self.reject.details)
        welcome = svc.Welcome(
            session_id="S1",
            lease_ttl=seconds(self.heartbeat * 3),
            heartbeat_interval=seconds(self.heartbeat),
            server_version="0.1.0",
            min_sdk_version="0.0.0",
            max_result=self.max_result,
        )
        await context.write(svc.ServerFrame(welcome=welcome))

        async def pump() -> None:
            while True:
                frame = await context.read()
                if not isinstance(frame, svc.WorkerFrame):
                    scripted.half_closed.set()
                    scripted.inbox.put_nowait(None)
                    scripted.outgoing.put_nowait(None)
                    return
                scripted.received.append(frame)
                scripted.inbox.put_nowait(frame)

        reader = asyncio.ensure_future(pump())
        try:
            while True:
                item = await scripted.outgoing.get()
                if item is None:
                    return
                if isinstance(item, Abort):
                    await context.abort(item.code, item.details)
                await context.write(item)
        finally:
            reader.cancel()
            scripted.ended.set()

    async def next_session(self) -> ScriptedSession:
        return await asyncio.wait_for(self.sessions.get(), WAIT)


async def start_server(double: WorkerServiceDouble, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((double.handler(),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


@dataclass
class Harness:
    double: WorkerServiceDouble
    server: grpc.aio.Server
    port: int
    workers: list[tuple[Worker, asyncio.Task[None]]] = field(default_factory=list)

    def start(self, worker: Worker) -> asyncio.Task[None]:
        task = asyncio.ensure_future(worker.run())
        self.workers.append((worker, task))
        return task

    def worker(self, **kwargs: Any) -> Worker:
        kwargs.setdefault("reconnect", FAST)
        kwargs.setdefault("grace_period", 5.0)
        return Worker(f"127.0.0.1:{self.port}", **kwargs)

    async def restart(self) -> None:
        await self.server.stop(None)
        self.server, _ = await start_server(self.double, self.port)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    double = WorkerServiceDouble()
    server, port = await start_server(double)
    h = Harness(double, server, port)
    yield h
    for worker, task in h.workers:
        worker.stop(force=True)
        await asyncio.wait({task}, timeout=WAIT)
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: a test that cared has checked it
    await h.server.stop(None)


def echo_worker(h: Harness, **kwargs: Any) -> Worker:
    worker = h.worker(**kwargs)

    @worker.task("t.echo")
    async def echo(payload: Any, ctx: TaskContext) -> Any:
        return {"echo": payload, "attempt": ctx.attempt, "headers": dict(ctx.headers)}

    return worker


# ------------------------------------------------------------------------ handshake


async def test_hello_is_the_first_frame_with_the_worker_settings(harness: Harness) -> None:
    worker = echo_worker(
        harness,
        queues={"emails": 3, "reports": 1},
        concurrency=7,
        labels={"zone": "eu"},
        worker_id="w-1",
        token="sekret",
        min_server_version="0.1.0",
    )
    harness.start(worker)
    session = await harness.double.next_session()
    hello = session.hello
    assert dict(hello.queues) == {"emails": 3, "reports": 1}
    assert hello.concurrency == 7
    assert dict(hello.labels) == {"zone": "eu"}
    assert hello.sdk_version == conveyor.__version__
    assert hello.min_server_version == "0.1.0"
    assert hello.worker_id == "w-1"
    assert list(hello.batch_types) == []
    assert hello.accepts_dispatches
    assert session.metadata["authorization"] == "Bearer sekret"


async def test_heartbeats_are_sent_every_heartbeat_interval(harness: Harness) -> None:
    harness.double.heartbeat = 0.05
    harness.start(echo_worker(harness))
    session = await harness.double.next_session()
    for _ in range(3):
        await session.frame("heartbeat")


# ------------------------------------------------------------------------- outcomes


async def test_success_sends_the_encoded_return_value(harness: Harness) -> None:
    harness.start(echo_worker(harness))
    session = await harness.double.next_session()
    session.send(dispatch(envelope("T1")))
    (result,) = await session.results(1)
    assert (result.task_id, result.lease_id) == ("T1", "L-T1")
    assert result.outcome == svc.OUTCOME_SUCCESS
    assert result.result == b'{"echo":{"n":1},"attempt":1,"headers":{"h":"v"}}'


async def test_handler_errors_map_to_outcomes(harness: Harness) -> None:
    worker = harness.worker()

    @worker.task("t.boom")
    async def boom(payload: Any, ctx: TaskContext) -> None:
        raise ValueError("bad input")

    @worker.task("t.skip")
    async def skip(payload: Any, ctx: TaskContext) -> None:
        raise SkipRetry("permanently broken")

    @worker.task("t.later")
    async def later(payload: Any, ctx: TaskContext) -> None:
        raise RetryAfter(2.5, "rate limited")

    harness.start(worker)
    session = await harness.double.next_session()
    for task_id, task_type in [("A", "t.boom"), ("B", "t.skip"), ("C", "t.later"), ("D", "t.nope")]:
        session.send(dispatch(envelope(task_id, task_type)))
    results = {r.task_id: r for r in await session.results(4)}
    assert results["A"].outcome == svc.OUTCOME_FAILURE
    assert results["A"].error == "ValueError: bad input"
    assert not results["A"].HasField("retry_after")
    assert results["B"].outcome == svc.OUTCOME_SKIP_RETRY
    assert results["B"].error == "permanently broken"
    assert results["C"].outcome == svc.OUTCOME_FAILURE
    assert results["C"].retry_after.ToTimedelta() == timedelta(seconds=2.5)
    assert results["D"].outcome == svc.OUTCOME_FAILURE
    assert results["D"].error == "no handler for type t.nope"


async def test_attempt_timeout_and_deadline_cancel_the_handler(harness: Harness) -> None:
    worker = harness.worker()
    cancelled: set[str] = set()

    @worker.task("t.hang")
    async def hang(payload: Any, ctx: TaskContext) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.add(ctx.task_id)
            raise

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(dispatch(envelope("TO", "t.hang", timeout=0.05)))
    session.send(
        dispatch(envelope("DL", "t.hang", deadline=datetime.now(UTC) + timedelta(seconds=0.05)))
    )
    session.send(
        dispatch(envelope("PAST", "t.hang", deadline=datetime.now(UTC) - timedelta(seconds=1)))
    )
    results = {r.task_id: r for r in await session.results(3)}
    for task_id in ("TO", "DL", "PAST"):
        assert results[task_id].outcome == svc.OUTCOME_FAILURE
        assert results[task_id].error == "timed out"
    assert cancelled == {"TO", "DL"}  # PAST never started


async def test_progress_frames_carry_the_encoded_value(harness: Harness) -> None:
    worker = harness.worker()

    @worker.task("t.progress")
    async def report(payload: Any, ctx: TaskContext) -> str:
        await ctx.progress({"pct": 50})
        return "done"

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(dispatch(envelope("P", "t.progress")))
    progress = (await session.frame("progress")).progress
    assert (progress.task_id, progress.lease_id, progress.progress) == ("P", "L-P", b'{"pct":50}')
    (result,) = await session.results(1)
    assert result.result == b'"done"'


async def test_results_ready_together_leave_as_one_batch_result(harness: Harness) -> None:
    worker = harness.worker(concurrency=3)
    gate = asyncio.Event()
    started = 0
    all_started = asyncio.Event()

    @worker.task("t.gated")
    async def gated(payload: Any, ctx: TaskContext) -> int:
        nonlocal started
        started += 1
        if started == 3:
            all_started.set()
        await gate.wait()
        return 1

    harness.start(worker)
    session = await harness.double.next_session()
    for task_id in ("G1", "G2", "G3"):
        session.send(dispatch(envelope(task_id, "t.gated")))
    await asyncio.wait_for(all_started.wait(), WAIT)
    gate.set()
    frame = await session.frame("batch_result")
    assert sorted(r.task_id for r in frame.batch_result.results) == ["G1", "G2", "G3"]
    assert all(r.outcome == svc.OUTCOME_SUCCESS for r in frame.batch_result.results)


# --------------------------------------------------------------- cancel, capacity


async def test_cancel_stops_the_handler_and_suppresses_its_result(harness: Harness) -> None:
    worker = echo_worker(harness)
    cancelled = asyncio.Event()
    started = asyncio.Event()

    @worker.task("t.hang")
    async def hang(payload: Any, ctx: TaskContext) -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(dispatch(envelope("H", "t.hang")))
    await asyncio.wait_for(started.wait(), WAIT)
    session.cancel("H")
    await asyncio.wait_for(cancelled.wait(), WAIT)
    session.send(dispatch(envelope("E")))
    (result,) = await session.results(1)
    assert result.task_id == "E"
    assert [r.task_id for r in session.all_results()] == ["E"]
    assert worker.running == 0


async def test_concurrency_is_never_exceeded_and_extra_dispatches_are_released(
    harness: Harness,
) -> None:
    worker = harness.worker(concurrency=2)
    gate = asyncio.Event()
    running = peak = 0
    two_running = asyncio.Event()

    @worker.task("t.gated")
    async def gated(payload: Any, ctx: TaskContext) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running == 2:
            two_running.set()
        try:
            await gate.wait()
        finally:
            running -= 1

    harness.start(worker)
    session = await harness.double.next_session()
    for i in range(5):  # a misbehaving server: more than the worker's concurrency
        session.send(dispatch(envelope(f"C{i}", "t.gated")))
    released = await session.results(3)
    assert sorted(r.task_id for r in released) == ["C2", "C3", "C4"]
    assert all(r.outcome == svc.OUTCOME_RELEASE for r in released)
    await asyncio.wait_for(two_running.wait(), WAIT)
    gate.set()
    done = await session.results(2)
    assert sorted(r.task_id for r in done) == ["C0", "C1"]
    assert peak == 2


async def test_add_slots_sends_a_credit_and_runs_more_handlers_at_once(
    harness: Harness,
) -> None:
    worker = harness.worker(concurrency=1)
    gate = asyncio.Event()
    running = 0
    two_running = asyncio.Event()

    @worker.task("t.gated")
    async def gated(payload: Any, ctx: TaskContext) -> None:
        nonlocal running
        running += 1
        if running == 2:
            two_running.set()
        try:
            await gate.wait()
        finally:
            running -= 1

    harness.start(worker)
    session = await harness.double.next_session()
    worker.add_slots("default", 1)
    credit = (await session.frame("credit")).credit
    assert (credit.queue, credit.n) == ("default", 1)
    assert worker.concurrency == 2
    for i in range(3):  # one more than the new concurrency
        session.send(dispatch(envelope(f"A{i}", "t.gated")))
    (released,) = await session.results(1)
    assert (released.task_id, released.outcome) == ("A2", svc.OUTCOME_RELEASE)
    await asyncio.wait_for(two_running.wait(), WAIT)

    # Back to one: the two running finish, the next dispatch over one is released.
    worker.add_slots("default", -1)
    credit = (await session.frame("credit")).credit
    assert (credit.queue, credit.n) == ("default", -1)
    gate.set()
    assert sorted(r.task_id for r in await session.results(2)) == ["A0", "A1"]
    gate.clear()  # A3 runs until A4 was answered
    for i in (3, 4):
        session.send(dispatch(envelope(f"A{i}", "t.gated")))
    (released,) = await session.results(1)
    assert (released.task_id, released.outcome) == ("A4", svc.OUTCOME_RELEASE)
    gate.set()
    (done,) = await session.results(1)
    assert (done.task_id, done.outcome) == ("A3", svc.OUTCOME_SUCCESS)


async def test_add_slots_refuses_bad_input() -> None:
    worker = Worker("127.0.0.1:1", queues={"a": 1}, concurrency=2)
    with pytest.raises(InvalidArgument, match="not one this worker serves"):
        worker.add_slots("b", 1)
    for bad in (0, True, 1.5):
        with pytest.raises(InvalidArgument, match="non-zero int"):
            worker.add_slots("a", bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="outside"):
        worker.add_slots("a", -2)
    with pytest.raises(InvalidArgument, match="outside"):
        worker.add_slots("a", 10_000)
    worker.add_slots("a", 3)  # not running: the next run starts with it
    assert worker.concurrency == 5


async def test_a_dispatches_frame_runs_every_task_it_carries(harness: Harness) -> None:
    harness.start(echo_worker(harness, concurrency=3))
    session = await harness.double.next_session()
    tasks = [envelope(f"D{i}") for i in range(3)]
    session.send(svc.ServerFrame(dispatches=svc.Dispatches(tasks=tasks)))
    results = await session.results(3)
    assert sorted((r.task_id, r.lease_id) for r in results) == [
        ("D0", "L-D0"),
        ("D1", "L-D1"),
        ("D2", "L-D2"),
    ]
    assert all(r.outcome == svc.OUTCOME_SUCCESS for r in results)


async def test_dispatches_beyond_capacity_are_released(harness: Harness) -> None:
    worker = harness.worker(concurrency=2)
    gate = asyncio.Event()
    started: list[str] = []

    @worker.task("t.gated")
    async def gated(payload: Any, ctx: TaskContext) -> None:
        started.append(ctx.task_id)
        await gate.wait()

    harness.start(worker)
    session = await harness.double.next_session()
    tasks = [envelope(f"X{i}", "t.gated") for i in range(5)]
    session.send(svc.ServerFrame(dispatches=svc.Dispatches(tasks=tasks)))
    released = await session.results(3)
    assert sorted(r.task_id for r in released) == ["X2", "X3", "X4"]
    assert all(r.outcome == svc.OUTCOME_RELEASE for r in released)
    gate.set()
    done = await session.results(2)
    assert sorted(r.task_id for r in done) == ["X0", "X1"]
    assert all(r.outcome == svc.OUTCOME_SUCCESS for r in done)
    assert sorted(started) == ["X0", "X1"]


# ---------------------------------------------------------------------- lifecycle


async def test_graceful_stop_releases_late_dispatches_and_unfinished_tasks(
    harness: Harness,
) -> None:
    # Capacity is left over, so only the shutdown can explain a RELEASE of LATE.
    worker = harness.worker(concurrency=3, grace_period=0.3)
    finish_quick = asyncio.Event()
    started: set[str] = set()
    both_started = asyncio.Event()
    slow_cancelled = asyncio.Event()

    @worker.task("t.quick")
    async def quick(payload: Any, ctx: TaskContext) -> str:
        started.add(ctx.task_id)
        if len(started) == 2:
            both_started.set()
        await finish_quick.wait()
        return "ok"

    @worker.task("t.slow")
    async def slow(payload: Any, ctx: TaskContext) -> None:
        started.add(ctx.task_id)
        if len(started) == 2:
            both_started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            slow_cancelled.set()
            raise

    run = harness.start(worker)
    session = await harness.double.next_session()
    session.send(dispatch(envelope("Q", "t.quick")))
    session.send(dispatch(envelope("S", "t.slow")))
    await asyncio.wait_for(both_started.wait(), WAIT)

    worker.stop()
    session.send(dispatch(envelope("LATE", "t.quick")))
    (late,) = await session.results(1)
    assert (late.task_id, late.outcome) == ("LATE", svc.OUTCOME_RELEASE)
    finish_quick.set()
    (quick_result,) = await session.results(1)
    assert (quick_result.task_id, quick_result.outcome) == ("Q", svc.OUTCOME_SUCCESS)
    (slow_result,) = await session.results(1)  # after the grace period
    assert (slow_result.task_id, slow_result.outcome) == ("S", svc.OUTCOME_RELEASE)
    await asyncio.wait_for(slow_cancelled.wait(), WAIT)
    await asyncio.wait_for(session.half_closed.wait(), WAIT)
    await asyncio.wait_for(run, WAIT)
    assert session.all_results()[-1].task_id == "S"


async def test_worker_reconnects_after_the_server_restarts(harness: Harness) -> None:
    worker = harness.worker(concurrency=2)
    gate = asyncio.Event()
    events: list[str] = []
    old_started = asyncio.Event()

    @worker.task("t.gated")
    async def gated(payload: Any, ctx: TaskContext) -> str:
        events.append(f"start {ctx.task_id}")
        old_started.set()
        await gate.wait()
        events.append(f"end {ctx.task_id}")
        return "done"

    harness.start(worker)
    first = await harness.double.next_session()
    first.send(dispatch(envelope("OLD", "t.gated")))
    await asyncio.wait_for(old_started.wait(), WAIT)

    await harness.restart()
    second = await harness.double.next_session()
    assert second.hello.concurrency == 2
    # OLD (from the dead session) still holds a slot. NEW1 takes the other one; NEW2
    # waits for a slot, leased, instead of running beside them or bouncing back ...
    for task_id in ("NEW1", "NEW2"):
        second.send(dispatch(envelope(task_id, "t.gated")))
    # ... while a dispatch beyond what the session offered is given back at once.
    second.send(dispatch(envelope("OVER", "t.gated")))
    (over,) = await second.results(1)
    assert (over.task_id, over.outcome) == ("OVER", svc.OUTCOME_RELEASE)
    assert events == ["start OLD", "start NEW1"]
    gate.set()
    done = await second.results(2)
    assert sorted((r.task_id, r.outcome) for r in done) == [
        ("NEW1", svc.OUTCOME_SUCCESS),
        ("NEW2", svc.OUTCOME_SUCCESS),
    ]
    assert events.index("start NEW2") > min(events.index("end OLD"), events.index("end NEW1"))
    assert "OLD" not in {r.task_id for r in second.all_results()}  # its result was dropped


async def test_a_stream_ended_by_the_server_is_reopened(harness: Harness) -> None:
    harness.start(echo_worker(harness))
    first = await harness.double.next_session()
    first.outgoing.put_nowait(Abort(grpc.StatusCode.UNAVAILABLE, "draining"))
    second = await harness.double.next_session()
    second.send(dispatch(envelope("X")))
    (result,) = await second.results(1)
    assert result.outcome == svc.OUTCOME_SUCCESS


async def test_sigterm_stops_a_worker_run_with_signal_handling(harness: Harness) -> None:
    worker = harness.worker(grace_period=0.05)
    started = asyncio.Event()

    @worker.task("t.hang")
    async def hang(payload: Any, ctx: TaskContext) -> None:
        started.set()
        await asyncio.Event().wait()

    run = asyncio.ensure_future(worker.run(handle_signals=True))
    session = await harness.double.next_session()
    session.send(dispatch(envelope("H", "t.hang")))
    await asyncio.wait_for(started.wait(), WAIT)
    os.kill(os.getpid(), signal.SIGTERM)
    (released,) = await session.results(1)
    assert (released.task_id, released.outcome) == ("H", svc.OUTCOME_RELEASE)
    await asyncio.wait_for(session.half_closed.wait(), WAIT)
    await asyncio.wait_for(run, WAIT)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
    ],
)
async def test_a_refused_session_makes_run_raise_without_retrying(
    harness: Harness, code: grpc.StatusCode, error: type[Exception]
) -> None:
    harness.double.reject = Abort(code, "sdk 0.1.0 is older than 9.0.0")
    run = harness.start(echo_worker(harness))
    with pytest.raises(error, match=r"9\.0\.0"):
        await asyncio.wait_for(run, WAIT)
    assert harness.double.sessions.qsize() == 1


# ------------------------------------------------------------------ sync handlers


async def test_sync_handlers_run_in_threads_and_see_cancellation(harness: Harness) -> None:
    worker = harness.worker(concurrency=3)
    seen: dict[str, Any] = {}
    started = threading.Event()
    loop_thread = threading.get_ident()

    @worker.task("t.sync")
    def work(payload: Any, ctx: TaskContext) -> int:
        seen["thread"] = threading.get_ident()
        ctx.set_progress("halfway")
        return int(payload["n"]) + 1

    @worker.task("t.sync_wait")
    def wait(payload: Any, ctx: TaskContext) -> str:
        started.set()
        seen[ctx.task_id] = ctx.wait_cancelled(WAIT)
        seen[f"{ctx.task_id}.reason"] = ctx.cancel_reason
        return "ignored"

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(dispatch(envelope("S1", "t.sync")))
    progress = (await session.frame("progress")).progress
    assert progress.progress == b'"halfway"'
    (result,) = await session.results(1)
    assert (result.outcome, result.result) == (svc.OUTCOME_SUCCESS, b"2")
    assert seen["thread"] != loop_thread

    session.send(dispatch(envelope("W1", "t.sync_wait")))
    await asyncio.to_thread(started.wait, WAIT)
    session.cancel("W1", reason="operator")
    session.send(dispatch(envelope("W2", "t.sync_wait", timeout=0.05)))
    (timed_out,) = await session.results(1)
    assert (timed_out.task_id, timed_out.error) == ("W2", "timed out")
    await wait_until(lambda: worker.running == 0, within=WAIT)
    assert seen["W1"] is True
    assert seen["W2"] is True
    assert seen["W1.reason"] == "cancelled by the server: operator"
    assert seen["W2.reason"] == "timed out"
    assert "W1" not in [r.task_id for r in session.all_results()]


async def test_a_result_over_max_result_size_fails_the_attempt(harness: Harness) -> None:
    # Sent anyway, a result past the server's frame limit would end the whole session.
    harness.start(echo_worker(harness, max_result_size=20))
    session = await harness.double.next_session()
    session.send(dispatch(envelope("T1")))
    (result,) = await session.results(1)
    assert (result.outcome, result.result) == (svc.OUTCOME_FAILURE, b"")
    assert result.error == "result is 48 bytes; the limit is 20"
    with pytest.raises(InvalidArgument, match="max_result_size must be >= 0"):
        Worker(max_result_size=-1)


async def test_the_result_limit_comes_from_welcome_unless_the_worker_sets_one(
    harness: Harness,
) -> None:
    harness.double.max_result = 30
    first = echo_worker(harness)  # no max_result_size: the server's applies
    running = harness.start(first)
    session = await harness.double.next_session()
    session.send(dispatch(envelope("T1")))
    (result,) = await session.results(1)
    assert (result.outcome, result.error) == (
        svc.OUTCOME_FAILURE,
        "result is 48 bytes; the limit is 30",
    )
    first.stop(force=True)
    await asyncio.wait_for(running, WAIT)

    harness.start(echo_worker(harness, max_result_size=100))  # the worker's own wins
    session = await harness.double.next_session()
    session.send(dispatch(envelope("T2")))
    (result,) = await session.results(1)
    assert result.outcome == svc.OUTCOME_SUCCESS


# ===================================================== aggregation-group batches
#
# ``@worker.batch_task`` handlers: a BatchDispatch takes one slot, every member shares its
# lease, a Cancel naming that lease stops the whole batch, and the answer is one
# BatchResult with a Result per member; then the pure outcome rules (batch_outcomes,
# fit_batch).


def batch(
    lease: str,
    task_ids: list[str],
    task_type: str = "t.digest",
    *,
    group: str = "user:1",
    payloads: list[bytes] | None = None,
    timeouts: list[float | None] | None = None,
) -> svc.ServerFrame:
    """A BatchDispatch frame: ``task_ids`` under the one lease ``lease``, payload
    ``{"n": i}`` each unless ``payloads`` are given."""
    tasks: list[pb.TaskEnvelope] = []
    for i, task_id in enumerate(task_ids):
        env = envelope(task_id, task_type, payloads[i] if payloads else b'{"n":%d}' % i)
        env.lease_id = lease
        env.group = group
        timeout = timeouts[i] if timeouts else None
        if timeout is not None:
            env.timeout.CopyFrom(seconds(timeout))
        tasks.append(env)
    return svc.ServerFrame(
        batch_dispatch=svc.BatchDispatch(queue="default", group=group, type=task_type, tasks=tasks)
    )


def cancel_frame(task_id: str, lease: str, reason: str = "lease lost") -> svc.ServerFrame:
    return svc.ServerFrame(cancel=svc.Cancel(task_id=task_id, lease_id=lease, reason=reason))


async def batch_result(session: ScriptedSession) -> list[svc.Result]:
    """The Results of the next BatchResult frame."""
    return list((await session.frame("batch_result")).batch_result.results)


# ----------------------------------------------------------------- registration


async def test_hello_lists_the_batch_types(harness: Harness) -> None:
    worker = harness.worker()

    @worker.task("t.single")
    async def single(payload: Any, ctx: TaskContext) -> None:
        return None

    @worker.batch_task("t.b")
    async def b(payloads: list[Any], batch: BatchContext) -> None:
        return None

    worker.register_batch("t.a", lambda payloads, batch: None)
    assert worker.batch_types == ["t.a", "t.b"]
    assert worker.task_types == ["t.single"]
    assert worker.clone("127.0.0.1:1").batch_types == ["t.a", "t.b"]
    harness.start(worker)
    session = await harness.double.next_session()
    assert list(session.hello.batch_types) == ["t.a", "t.b"]


def test_registering_both_kinds_for_one_type_is_refused() -> None:
    worker = Worker()

    @worker.task("t.x")
    async def x(payload: Any, ctx: TaskContext) -> None:
        return None

    with pytest.raises(ValueError, match="already has a task handler"):
        worker.register_batch("t.x", lambda payloads, batch: None)

    @worker.batch_task("t.y")
    async def y(payloads: list[Any], batch: BatchContext) -> None:
        return None

    with pytest.raises(ValueError, match="already has a batch handler"):
        worker.register("t.y", lambda payload, ctx: None)
    with pytest.raises(ValueError, match="already has a batch handler"):
        worker.register_batch("t.y", lambda payloads, batch: None)
    assert worker.task_types == ["t.x"]
    assert worker.batch_types == ["t.y"]


def test_batch_types_are_held_to_the_hello_bounds() -> None:
    worker = Worker()
    with pytest.raises(InvalidArgument, match="1-256"):
        worker.register_batch("", lambda payloads, batch: None)
    with pytest.raises(InvalidArgument, match="1-256"):
        worker.register_batch("t" * 257, lambda payloads, batch: None)
    with pytest.raises(InvalidArgument, match="control character"):
        worker.register_batch("t\n", lambda payloads, batch: None)
    with pytest.raises(TypeError, match="not callable"):
        worker.register_batch("t.z", "nope")  # type: ignore[arg-type]
    for n in range(100):
        worker.register_batch(f"t{n}", lambda payloads, batch: None)
    with pytest.raises(InvalidArgument, match="at most 100 batch handlers"):
        worker.register_batch("t100", lambda payloads, batch: None)


# ------------------------------------------------------------------------ running


async def test_a_batch_runs_once_and_sees_every_member(harness: Harness) -> None:
    worker = harness.worker()
    calls: list[tuple[list[Any], BatchContext]] = []

    @worker.batch_task("t.digest")
    async def digest(payloads: list[Any], batch: BatchContext) -> list[Any]:
        calls.append((payloads, batch))
        return [p["n"] * 10 for p in payloads]

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("LB", ["A", "B", "C"]))
    results = await batch_result(session)
    assert [(r.task_id, r.lease_id, r.outcome, r.result) for r in results] == [
        ("A", "LB", svc.OUTCOME_SUCCESS, b"0"),
        ("B", "LB", svc.OUTCOME_SUCCESS, b"10"),
        ("C", "LB", svc.OUTCOME_SUCCESS, b"20"),
    ]
    ((payloads, ctx),) = calls
    assert payloads == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert (ctx.queue, ctx.group, ctx.type, ctx.lease_id, len(ctx)) == (
        "default",
        "user:1",
        "t.digest",
        "LB",
        3,
    )
    assert [t.task_id for t in ctx.tasks] == ["A", "B", "C"]
    assert [t.id for t in ctx.tasks] == ["A", "B", "C"]
    assert ctx.tasks[1].headers == {"h": "v"}
    assert ctx.tasks[1].attempt == 1
    assert ctx.tasks[1].group == "user:1"
    assert not ctx.cancelled


async def test_a_single_member_batch_is_still_answered_with_a_batch_result(
    harness: Harness,
) -> None:
    worker = harness.worker()
    worker.register_batch("t.digest", lambda payloads, batch: None)
    harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("LB", ["A"]))
    (result,) = await batch_result(session)
    assert (result.task_id, result.outcome, result.result) == ("A", svc.OUTCOME_SUCCESS, b"")


async def test_a_batch_takes_one_slot_however_many_members(harness: Harness) -> None:
    worker = harness.worker(concurrency=2)
    gate = asyncio.Event()
    started = asyncio.Event()

    @worker.batch_task("t.digest")
    async def digest(payloads: list[Any], batch: BatchContext) -> None:
        started.set()
        await gate.wait()

    @worker.task("t.echo")
    async def echo(payload: Any, ctx: TaskContext) -> str:
        await gate.wait()
        return "ok"

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("LB", [f"M{i}" for i in range(5)]))
    await asyncio.wait_for(started.wait(), WAIT)
    assert worker.running == 1
    session.send(dispatch(envelope("S1")))  # the second slot
    await wait_until(lambda: worker.running == 2, within=WAIT)
    session.send(dispatch(envelope("S2")))  # beyond the concurrency
    (released,) = await session.results(1)
    assert (released.task_id, released.outcome) == ("S2", svc.OUTCOME_RELEASE)
    session.send(batch("LB2", ["N0", "N1"]))  # a batch beyond it too
    results = await batch_result(session)
    assert [(r.task_id, r.lease_id, r.outcome) for r in results] == [
        ("N0", "LB2", svc.OUTCOME_RELEASE),
        ("N1", "LB2", svc.OUTCOME_RELEASE),
    ]
    gate.set()
    results = await batch_result(session)
    assert [r.task_id for r in results] == [f"M{i}" for i in range(5)]
    assert all(r.outcome == svc.OUTCOME_SUCCESS for r in results)
    await wait_until(lambda: worker.running == 0, within=WAIT)


async def test_heartbeats_cover_a_held_batch(harness: Harness) -> None:
    harness.double.heartbeat = 0.05
    worker = harness.worker()
    gate = asyncio.Event()

    @worker.batch_task("t.digest")
    async def digest(payloads: list[Any], batch: BatchContext) -> None:
        await gate.wait()

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("LB", ["A", "B"]))
    await wait_until(lambda: worker.running == 1, within=WAIT)
    for _ in range(3):
        await session.frame("heartbeat")
    gate.set()
    assert len(await batch_result(session)) == 2


# ------------------------------------------------------------------------ outcomes


async def test_per_member_outcomes_from_none_lists_dicts_and_exceptions(
    harness: Harness,
) -> None:
    worker = harness.worker()

    @worker.batch_task("t.digest")
    async def digest(payloads: list[Any], batch: BatchContext) -> Any:
        ids = [t.task_id for t in batch.tasks]
        if batch.group == "none":
            return None
        if batch.group == "list":
            return ["a", ValueError("bad"), SkipRetry("gone"), RetryAfter(2.5, "later"), None]
        return {ids[0]: {"x": 1}, ids[2]: RuntimeError("nope")}

    harness.start(worker)
    session = await harness.double.next_session()

    session.send(batch("L1", ["N0", "N1"], group="none"))
    results = await batch_result(session)
    assert [(r.task_id, r.outcome, r.result) for r in results] == [
        ("N0", svc.OUTCOME_SUCCESS, b""),
        ("N1", svc.OUTCOME_SUCCESS, b""),
    ]

    session.send(batch("L2", ["A", "B", "C", "D", "E"], group="list"))
    a, b, c, d, e = await batch_result(session)
    assert (a.outcome, a.result) == (svc.OUTCOME_SUCCESS, b'"a"')
    assert (b.outcome, b.error) == (svc.OUTCOME_FAILURE, "ValueError: bad")
    assert not b.HasField("retry_after")
    assert (c.outcome, c.error) == (svc.OUTCOME_SKIP_RETRY, "gone")
    assert d.outcome == svc.OUTCOME_FAILURE
    assert d.retry_after.ToTimedelta() == timedelta(seconds=2.5)
    assert (e.outcome, e.result) == (svc.OUTCOME_SUCCESS, b"")
    assert {r.lease_id for r in (a, b, c, d, e)} == {"L2"}

    session.send(batch("L3", ["X", "Y", "Z"], group="dict"))
    x, y, z = await batch_result(session)
    assert (x.task_id, x.outcome, x.result) == ("X", svc.OUTCOME_SUCCESS, b'{"x":1}')
    assert (y.task_id, y.outcome, y.result) == ("Y", svc.OUTCOME_SUCCESS, b"")  # left out
    assert (z.task_id, z.outcome, z.error) == ("Z", svc.OUTCOME_FAILURE, "RuntimeError: nope")


async def test_raising_fails_every_member(harness: Harness) -> None:
    worker = harness.worker()

    @worker.batch_task("t.digest")
    async def digest(payloads: list[Any], batch: BatchContext) -> None:
        if batch.group == "skip":
            raise SkipRetry("bad batch")
        if batch.group == "later":
            raise RetryAfter(3, "busy")
        raise ValueError("boom")

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("L1", ["A", "B"]))
    results = await batch_result(session)
    assert [(r.task_id, r.outcome, r.error) for r in results] == [
        ("A", svc.OUTCOME_FAILURE, "ValueError: boom"),
        ("B", svc.OUTCOME_FAILURE, "ValueError: boom"),
    ]
    session.send(batch("L2", ["C", "D"], group="skip"))
    results = await batch_result(session)
    assert [(r.outcome, r.error) for r in results] == [(svc.OUTCOME_SKIP_RETRY, "bad batch")] * 2
    session.send(batch("L3", ["E", "F"], group="later"))
    results = await batch_result(session)
    assert all(r.outcome == svc.OUTCOME_FAILURE for r in results)
    assert [r.retry_after.ToTimedelta() for r in results] == [timedelta(seconds=3)] * 2


async def test_a_list_of_the_wrong_length_fails_every_member(harness: Harness) -> None:
    worker = harness.worker()
    worker.register_batch("t.digest", lambda payloads, batch: ["only one"])
    harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("LB", ["A", "B", "C"]))
    results = await batch_result(session)
    assert [r.task_id for r in results] == ["A", "B", "C"]
    assert all(r.outcome == svc.OUTCOME_FAILURE for r in results)
    assert results[0].error.startswith("batch handler returned 1 results for 3 tasks")


async def test_an_undecodable_member_fails_and_the_rest_run(harness: Harness) -> None:
    worker = harness.worker()
    seen: list[list[str]] = []

    @worker.batch_task("t.digest")
    async def digest(payloads: list[Any], batch: BatchContext) -> list[Any]:
        seen.append([t.task_id for t in batch.tasks])
        return [p["n"] for p in payloads]

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("LB", ["A", "B", "C"], payloads=[b'{"n":1}', b"{not json", b'{"n":3}']))
    a, b, c = await batch_result(session)
    assert (a.task_id, a.outcome, a.result) == ("A", svc.OUTCOME_SUCCESS, b"1")
    assert (b.task_id, b.outcome) == ("B", svc.OUTCOME_FAILURE)
    assert b.error.startswith("cannot decode payload: ")
    assert (c.task_id, c.outcome, c.result) == ("C", svc.OUTCOME_SUCCESS, b"3")
    assert seen == [["A", "C"]]

    session.send(batch("L2", ["D"], payloads=[b"{bad"]))  # nothing to run the handler for
    (d,) = await batch_result(session)
    assert d.error.startswith("cannot decode payload: ")
    assert len(seen) == 1


async def test_the_smallest_member_timeout_bounds_the_batch(harness: Harness) -> None:
    worker = harness.worker()
    cancelled = asyncio.Event()

    @worker.batch_task("t.digest")
    async def digest(payloads: list[Any], batch: BatchContext) -> None:
        try:
            await asyncio.sleep(WAIT)
        except asyncio.CancelledError:
            assert batch.cancel_reason == "timed out"
            assert all(t.cancelled for t in batch.tasks)
            cancelled.set()
            raise

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("LB", ["A", "B", "C"], timeouts=[None, 0.05, 30.0]))
    results = await batch_result(session)
    assert [(r.outcome, r.error) for r in results] == [(svc.OUTCOME_FAILURE, "timed out")] * 3
    assert cancelled.is_set()


async def test_sync_batch_handlers_run_in_a_thread_and_see_cancellation(
    harness: Harness,
) -> None:
    worker = harness.worker()
    loop_thread = threading.get_ident()
    seen: dict[str, Any] = {}
    started = threading.Event()

    @worker.batch_task("t.digest")
    def digest(payloads: list[Any], batch: BatchContext) -> dict[str, Any]:
        seen["thread"] = threading.get_ident()
        if batch.group == "wait":
            started.set()
            seen["cancelled"] = batch.wait_cancelled(WAIT)
            seen["reason"] = batch.cancel_reason
        return {batch.tasks[0].task_id: "first"}

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("L1", ["A", "B"]))
    a, b = await batch_result(session)
    assert (a.result, b.result) == (b'"first"', b"")
    assert seen["thread"] != loop_thread

    session.send(batch("L2", ["C", "D"], group="wait"))
    await asyncio.to_thread(started.wait, WAIT)
    session.send(cancel_frame("D", "L2", reason="operator"))
    await wait_until(lambda: worker.running == 0, within=WAIT)
    assert seen["cancelled"] is True
    assert seen["reason"] == "cancelled by the server: operator"
    assert not [r for r in session.all_results() if r.lease_id == "L2"]


# ----------------------------------------------------------------- cancel, drain


async def test_a_cancel_naming_the_lease_stops_the_whole_batch(harness: Harness) -> None:
    worker = harness.worker(concurrency=1)
    started = asyncio.Event()
    cancelled: list[BatchContext] = []

    @worker.batch_task("t.digest")
    async def digest(payloads: list[Any], batch: BatchContext) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(batch)
            raise

    @worker.task("t.echo")
    async def echo(payload: Any, ctx: TaskContext) -> str:
        return "ok"

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("LB", ["A", "B", "C"]))
    await asyncio.wait_for(started.wait(), WAIT)
    session.send(cancel_frame("B", "LB"))  # any member names the batch
    await wait_until(lambda: bool(cancelled), within=WAIT)
    (ctx,) = cancelled
    assert ctx.cancelled
    assert ctx.cancel_reason == "cancelled by the server: lease lost"
    assert all(t.cancelled for t in ctx.tasks)
    # The slot is free at once (the server freed it with the Cancel).
    session.send(dispatch(envelope("E")))
    (result,) = await session.results(1)
    assert (result.task_id, result.outcome) == ("E", svc.OUTCOME_SUCCESS)
    assert [r.task_id for r in session.all_results()] == ["E"]


async def test_a_cancel_removes_a_batch_waiting_for_a_slot(harness: Harness) -> None:
    worker = harness.worker(concurrency=1)
    unwind = asyncio.Event()
    ran: list[str] = []

    @worker.batch_task("t.digest")
    async def digest(payloads: list[Any], batch: BatchContext) -> None:
        ran.append(batch.lease_id)
        if batch.lease_id != "L1":
            return
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await unwind.wait()  # a slow unwind, holding the local slot
            raise

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("L1", ["A"]))
    await wait_until(lambda: ran == ["L1"], within=WAIT)
    session.send(cancel_frame("A", "L1"))
    session.send(batch("L2", ["B", "C"]))  # within the session's count: it waits
    session.send(cancel_frame("C", "L2"))
    session.send(batch("L3", ["D"]))
    runner = worker._runner
    assert runner is not None
    await wait_until(lambda: list(runner.waiting) == [("D", "L3")], within=WAIT)
    assert ran == ["L1"]
    assert runner.holding == {("D", "L3")}
    unwind.set()
    (d,) = await batch_result(session)
    assert (d.task_id, d.outcome) == ("D", svc.OUTCOME_SUCCESS)
    assert "L2" not in ran


async def test_drain_releases_every_member_of_an_unfinished_batch(harness: Harness) -> None:
    worker = harness.worker(concurrency=2, grace_period=0.2)
    started = asyncio.Event()

    @worker.batch_task("t.digest")
    async def digest(payloads: list[Any], batch: BatchContext) -> None:
        started.set()
        await asyncio.Event().wait()

    run = harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("L1", ["A", "B", "C"]))
    await asyncio.wait_for(started.wait(), WAIT)
    worker.stop()
    await session.frame("drain")
    session.send(batch("L2", ["D", "E"]))  # on the wire as the Drain went out
    late = await batch_result(session)
    assert [(r.task_id, r.lease_id, r.outcome) for r in late] == [
        ("D", "L2", svc.OUTCOME_RELEASE),
        ("E", "L2", svc.OUTCOME_RELEASE),
    ]
    unfinished = await batch_result(session)  # after the grace period
    assert [(r.task_id, r.lease_id, r.outcome) for r in unfinished] == [
        ("A", "L1", svc.OUTCOME_RELEASE),
        ("B", "L1", svc.OUTCOME_RELEASE),
        ("C", "L1", svc.OUTCOME_RELEASE),
    ]
    await asyncio.wait_for(session.half_closed.wait(), WAIT)
    await asyncio.wait_for(run, WAIT)


async def test_a_batch_of_a_type_without_a_batch_handler_fails_its_members(
    harness: Harness,
) -> None:
    worker = harness.worker()

    @worker.task("t.digest")  # a task handler is not a batch handler
    async def digest(payload: Any, ctx: TaskContext) -> None:
        return None

    harness.start(worker)
    session = await harness.double.next_session()
    session.send(batch("LB", ["A", "B"]))
    results = await batch_result(session)
    assert [(r.task_id, r.lease_id, r.outcome, r.error) for r in results] == [
        ("A", "LB", svc.OUTCOME_FAILURE, "this worker does not accept batches of type t.digest"),
        ("B", "LB", svc.OUTCOME_FAILURE, "this worker does not accept batches of type t.digest"),
    ]
    assert worker.running == 0


# -------------------------------------------------------------------- pure rules


def test_outcomes_refuse_unknown_keys_and_other_values() -> None:
    codec = JsonCodec()
    ids = ["A", "B"]
    unknown = batch_outcomes({"A": 1, "Z": 2}, ids, "L", codec, 1024)
    assert all(r.outcome == svc.OUTCOME_FAILURE for r in unknown)
    assert unknown[0].error == (
        "batch handler returned results for 1 keys that are not task ids of the batch: 'Z'"
    )
    other = batch_outcomes("text", ids, "L", codec, 1024)
    assert all(r.outcome == svc.OUTCOME_FAILURE for r in other)
    assert other[0].error.endswith("it returned str")
    as_tuple = batch_outcomes((1, 2), ids, "L", codec, 1024)
    assert [r.result for r in as_tuple] == [b"1", b"2"]


def test_outcomes_fail_a_member_whose_result_does_not_encode_or_fit() -> None:
    codec = JsonCodec()
    results = batch_outcomes([object(), "x" * 50, "ok"], ["A", "B", "C"], "L", codec, 20)
    assert results[0].outcome == svc.OUTCOME_FAILURE
    assert results[0].error.startswith("cannot encode result: ")
    assert (results[1].outcome, results[1].error) == (
        svc.OUTCOME_FAILURE,
        "result is 52 bytes; the limit is 20",
    )
    assert (results[2].outcome, results[2].result) == (svc.OUTCOME_SUCCESS, b'"ok"')


def test_results_that_do_not_fit_one_frame_are_cut_in_member_order() -> None:
    big = b"x" * 400
    results = [
        make_result(f"T{i}", "L", svc.OUTCOME_SUCCESS, result=big if i < 3 else b"")
        for i in range(5)
    ]
    assert fit_batch(results, 10_000) is results
    cut = fit_batch(results, 900)
    assert [r.task_id for r in cut] == [f"T{i}" for i in range(5)]
    assert [r.outcome for r in cut] == [
        svc.OUTCOME_SUCCESS,
        svc.OUTCOME_FAILURE,
        svc.OUTCOME_FAILURE,
        svc.OUTCOME_SUCCESS,
        svc.OUTCOME_SUCCESS,
    ]
    assert "over the limit of 900" in cut[1].error
    assert sum(r.ByteSize() + 4 for r in cut) <= 900
