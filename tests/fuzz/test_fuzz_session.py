"""WorkerService.Session with hostile frames: arbitrary bytes, hostile Hellos, and hostile
frames of every kind a worker sends (Result, BatchResult, Heartbeat, Credit, Progress, a
second Hello), some naming the task the session really holds, sent before and after it
is dispatched.

- A first frame the server refuses ends the stream with a clear status (INVALID_ARGUMENT,
  FAILED_PRECONDITION), never INTERNAL or UNKNOWN; a Hello it takes gets a Welcome.
- After the Welcome, a frame that does not parse ends the stream with INVALID_ARGUMENT;
  every other frame is applied or ignored, and the session goes on: the task it holds is
  completed by a well-formed Result sent after the fuzz (or was settled by a fuzzed
  Result that named it). Whatever happens, the task never stays leased once the session
  has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from conveyor_protos.v1 import service_pb2, task_pb2
from google.protobuf.message import DecodeError
from hypothesis import event, given
from hypothesis import strategies as st

from tests.fuzz.profile import fuzz
from tests.fuzz.stack import MAX_MESSAGE, Stack, status_problem
from tests.fuzz.strategies import (
    Blob,
    arbitrary_bytes,
    blobs,
    bodies_of,
    int32s,
    messages_of,
    text,
)

pytestmark = [pytest.mark.fuzz, pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

SESSION = "/conveyor.v1.WorkerService/Session"
_Frame = service_pb2.WorkerFrame
FINAL = (
    service_pb2.OUTCOME_SUCCESS,
    service_pb2.OUTCOME_FAILURE,
    service_pb2.OUTCOME_SKIP_RETRY,
    service_pb2.OUTCOME_RELEASE,
)


class RawSession:
    """One Session call whose frames are raw bytes each way."""

    def __init__(self, channel: grpc.aio.Channel, *, timeout: float | None = 60.0) -> None:
        self.call: Any = channel.stream_stream(SESSION)(timeout=timeout)

    async def send(self, data: bytes) -> bool:
        """Write one frame; False when the stream has ended already."""
        try:
            await self.call.write(bytes(data))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return False
        return True

    async def read(self, within: float = 15.0) -> service_pb2.ServerFrame | None:
        """The next server frame; None once the stream has ended."""
        try:
            data = await asyncio.wait_for(self.call.read(), within)
        except grpc.aio.AioRpcError:
            return None
        if data is grpc.aio.EOF:
            return None
        return service_pb2.ServerFrame.FromString(data)

    async def close(self) -> None:
        """Half-close, as a worker that is done."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self.call.done_writing()

    async def drain(self, within: float = 15.0) -> tuple[grpc.StatusCode, str]:
        """Read what is left; the status the stream ended with."""
        async with asyncio.timeout(within):
            while await self.read(within) is not None:
                pass
            return await self.call.code(), await self.call.details()


def parses(data: bytes) -> _Frame | None:
    """The frame the server reads from ``data``, or None when it does not parse."""
    try:
        return _Frame.FromString(data)
    except DecodeError:
        return None


def ends(data: bytes) -> bool:
    """True when a frame of ``data`` ends the session: it does not parse, or it is past
    the server's receive limit."""
    return len(data) > MAX_MESSAGE or parses(data) is None


def check_status(code: grpc.StatusCode, details: str, sent: int) -> None:
    problem = status_problem(code, details, sent)
    assert problem is None, problem


# ------------------------------------------------------------------- hello


def hello_frames() -> st.SearchStrategy[bytes]:
    """A first frame: arbitrary bytes, any hostile frame, or a hostile Hello in one."""
    hellos = messages_of(service_pb2.Hello).map(
        lambda hello: _Frame(hello=hello).SerializeToString()
    )
    return st.one_of(arbitrary_bytes(), bodies_of(_Frame), hellos.map(Blob))


@fuzz()
@given(first=hello_frames())
async def test_first_frame(stack: Stack, first: bytes) -> None:
    session = RawSession(stack.channel)
    await session.send(first)
    frame = await session.read()
    if frame is not None:
        # A Hello the server took: the Welcome, and a clean end when the worker leaves.
        assert frame.WhichOneof("frame") == "welcome", frame
        parsed = parses(first)
        assert parsed is not None
        assert parsed.WhichOneof("frame") == "hello"
        await session.close()
        code, details = await session.drain()
        assert code == grpc.StatusCode.OK, (code, details)
        return
    code, details = await session.drain()
    check_status(code, details, len(first))
    if len(first) <= MAX_MESSAGE:
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), (
            code,
            details,
        )


# ------------------------------------------------------- during a session


@st.composite
def results(draw: st.DrawFn, env: task_pb2.TaskEnvelope) -> service_pb2.Result:
    """A hostile Result; its ids are often the held task's (so it reaches the broker)."""
    result = draw(messages_of(service_pb2.Result))
    if draw(st.integers(0, 3)):
        result.task_id = env.id
    if draw(st.integers(0, 3)):
        result.lease_id = env.lease_id
    if draw(st.integers(0, 2)):
        result.outcome = draw(st.sampled_from(FINAL))
    return result


#: The kinds of frame :func:`frames` makes, Results (which reach the broker) most often.
KINDS = (
    *["result"] * 4,
    *["batch_result"] * 2,
    *["progress"] * 2,
    "heartbeat",
    "credit",
    "hello",
    "any",
    "raw",
)


@st.composite
def frames(draw: st.DrawFn, env: task_pb2.TaskEnvelope, queue: str) -> bytes:
    """One frame a worker sends after its Hello: of any kind, hostile, about the held
    task or not; now and then arbitrary bytes, or damaged."""
    kind = draw(st.sampled_from(KINDS))
    if kind == "raw":
        return draw(arbitrary_bytes())
    if kind == "any":
        return draw(bodies_of(_Frame))
    frame = _Frame()
    if kind == "result":
        frame.result.CopyFrom(draw(results(env)))
    elif kind == "batch_result":
        frame.batch_result.results.extend(draw(st.lists(results(env), max_size=4)))
    elif kind == "heartbeat":
        frame.heartbeat.SetInParent()
    elif kind == "credit":
        frame.credit.queue = draw(st.one_of(st.just(queue), text()))
        frame.credit.n = draw(int32s())
    elif kind == "progress":
        frame.progress.task_id = draw(st.one_of(st.just(env.id), text()))
        frame.progress.lease_id = draw(st.one_of(st.just(env.lease_id), text()))
        frame.progress.progress = draw(blobs())
    else:
        frame.hello.CopyFrom(draw(messages_of(service_pb2.Hello)))
    return Blob(frame.SerializeToString())


def settles(sent: Sequence[bytes], env: task_pb2.TaskEnvelope) -> bool:
    """True when one of the frames ``sent`` was a Result for the held delivery."""
    for data in sent:
        frame = parses(data)
        if frame is None:
            continue
        kind = frame.WhichOneof("frame")
        found = (
            [frame.result]
            if kind == "result"
            else list(frame.batch_result.results)
            if kind == "batch_result"
            else []
        )
        if any(
            r.task_id == env.id and r.lease_id == env.lease_id and r.outcome in FINAL for r in found
        ):
            return True
    return False


async def dispatched(session: RawSession, task_id: str) -> task_pb2.TaskEnvelope | None:
    """The envelope of ``task_id`` once it arrives; None when the stream ends first."""
    while True:
        frame = await session.read()
        if frame is None:
            return None
        kind = frame.WhichOneof("frame")
        envelopes = (
            [frame.dispatch.task]
            if kind == "dispatch"
            else list(frame.dispatches.tasks)
            if kind == "dispatches"
            else []
        )
        for env in envelopes:
            if env.id == task_id:
                return env


NEVER = task_pb2.TaskEnvelope(id="fz-none", lease_id="fz-none")


@fuzz()
@given(data=st.data())
async def test_frames_during_a_session(stack: Stack, data: st.DataObject) -> None:
    queue = f"fzs-{uuid.uuid4().hex}"  # a queue of its own: nothing else is dispatched
    batches = data.draw(st.booleans(), label="accepts_dispatches")
    session = RawSession(stack.channel)
    hello = service_pb2.Hello(
        queues={queue: 1}, concurrency=2, sdk_version="0.1.0", accepts_dispatches=batches
    )
    await session.send(_Frame(hello=hello).SerializeToString())
    welcome = await session.read()
    assert welcome is not None
    assert welcome.WhichOneof("frame") == "welcome"

    # Before anything is dispatched: frames about no task the session holds.
    before = data.draw(st.lists(frames(NEVER, queue), max_size=3), label="before")
    sent: list[bytes] = []
    for frame in before:
        sent.append(frame)
        await session.send(frame)
        if ends(frame):
            # Nothing more: grpc's asyncio client reports a write after the server ended
            # the call as INTERNAL instead of the server's status (grpc/grpc#36066).
            break
    task = await stack.client.enqueue("fuzz.session", {"n": 1}, queue=queue)
    env = await dispatched(session, task.id)
    if env is None:
        event("the session ended before its dispatch")
        # Only a frame that does not parse ends the session.
        assert any(map(ends, sent)), "the session ended on frames it should take"
        code, details = await session.drain()
        check_status(code, details, max(map(len, sent)))
        assert await stack.settled(task.id) != task_pb2.TASK_STATE_ACTIVE
        return

    after = data.draw(st.lists(frames(env, queue), max_size=4), label="after")
    for frame in after:
        sent.append(frame)
        if not await session.send(frame) or ends(frame):
            break
    broken = any(map(ends, sent))
    event("a frame ended the session" if broken else "the session went on")
    if settles(sent, env):
        event("a fuzzed Result settled the held task")
    if not broken:
        # The session is still up and still holds its task unless a fuzzed Result settled
        # it: a well-formed Result completes it.
        ok = service_pb2.Result(
            task_id=env.id, lease_id=env.lease_id, outcome=service_pb2.OUTCOME_SUCCESS
        )
        await session.send(_Frame(result=ok).SerializeToString())
        if not settles(sent, env):
            state = await stack.settled(task.id)
            assert state == task_pb2.TASK_STATE_COMPLETED, task_pb2.TaskState.Name(state)
        await session.close()
    code, details = await session.drain()
    check_status(code, details, max(map(len, sent), default=0))
    if broken:
        too_big = any(len(f) > MAX_MESSAGE for f in sent)
        assert code == grpc.StatusCode.INVALID_ARGUMENT or too_big, (code, details)
    else:
        assert code == grpc.StatusCode.OK, (code, details)
    # However it ended, the session's end left nothing leased.
    await stack.settled(task.id)
