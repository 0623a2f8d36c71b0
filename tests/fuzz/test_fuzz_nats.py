"""Hostile NATS messages on every subject the services subscribe to (docs/architecture.md's
subject table): arbitrary bytes, hostile messages of the subject's type, and messages
that name what is really there (a queue a worker serves, a live gateway, the webhook
registration), each unsealed, sealed with the cluster key as the services seal, or with a
seal that is damaged, of another key, or of another subject.

Unsealed and badly sealed messages are dropped by design; sealed ones reach the handlers,
so they are what finds bugs. No service may die or log an unhandled error; a sealed
request still gets its reply; a worker session and a WatchEvents stream that are open
meanwhile stay up; and what stays stored and the other clients are checked after each
test (``tests/fuzz/conftest.py``).

The nats-server is open (no users), as a misconfigured one would be: the fuzzer is just
another client.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime.cluster_key import SEAL_HEADER, ClusterAuth, generate_key, parse_keys
from conveyor_runtime.nats_connect import close_nats, connect_nats
from conveyor_runtime.subjects import Subjects
from google.protobuf.message import DecodeError
from hypothesis import event, given
from hypothesis import strategies as st
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from tests.fuzz.profile import fuzz
from tests.fuzz.stack import Stack, poll
from tests.fuzz.strategies import (
    Blob,
    arbitrary_bytes,
    blobs,
    bodies_of,
    floats,
    int32s,
    messages_of,
    names,
    text,
    varint,
)
from tests.fuzz.test_fuzz_session import RawSession

pytestmark = [pytest.mark.fuzz, pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

SUBJECTS = Subjects()  # the services' default prefix

#: Per-queue subjects and their messages (``owner`` has an empty body).
PER_QUEUE = {
    "wake": cluster_pb2.Wake,
    "register": cluster_pb2.Register,
    "done": cluster_pb2.Done,
    "control": cluster_pb2.Control,
    "groups": cluster_pb2.GroupsDue,
    "owner": None,
}
#: Every kind of subject a service subscribes to (the ``_INBOX`` replies have a test of
#: their own: ``test_fuzz_dispatcher.py``).
KINDS = (
    *PER_QUEUE,
    "cancel",
    "promote",
    "watch",
    "resolve",
    "rollcall",
    "holder_beat",
    "dispatcher_beat",
    "cluster_nodes",
    "dispatch",
    "callback",
    "events",
)


@dataclass
class Targets:
    """What is really there for a message to name."""

    queue: str
    gateway: str
    webhook_gateway: str
    webhook_name: str
    webhook_queue: str
    replies: list[str] = field(default_factory=list)


#: Each subject of :class:`Subjects` (by method) and the kind of message it is fuzzed as.
FUZZED_AS = {
    "wake": "wake",
    "register": "register",
    "done": "done",
    "control": "control",
    "groups": "groups",
    "owner_changed": "owner",
    "cancel": "cancel",
    "promote": "promote",
    "watch": "watch",
    "resolve": "resolve",
    "roll_call": "rollcall",
    "holder_beat": "holder_beat",
    "dispatcher_beat": "dispatcher_beat",
    "cluster_nodes": "cluster_nodes",
    "dispatch": "dispatch",
    "webhook_callback": "callback",
    "events": "events",
}


def test_every_subject_is_fuzzed() -> None:
    """A new subject fails here until it is fuzzed too (its replies, on ``_INBOX``, are
    those of ``dispatch`` and ``webhook_callback``: see test_fuzz_dispatcher.py)."""
    spelled = {
        name
        for name, member in inspect.getmembers(Subjects, inspect.isfunction)
        if not name.startswith("_")
        and name not in {"queue_of", "queue_wildcard", "events_wildcard"}
    }
    assert spelled == set(FUZZED_AS)
    assert set(FUZZED_AS.values()) == set(KINDS)


# ---------------------------------------------------------------- subjects


def tokens() -> st.SearchStrategy[str]:
    """A subject token a client may publish on (no dots, wildcards or spaces)."""
    safe = st.characters(codec="utf-8", exclude_characters=".*> \t\r\n\x00")
    return st.one_of(names(), st.text(safe, min_size=1, max_size=20))


@st.composite
def subjects(draw: st.DrawFn, kind: str, targets: Targets) -> str:
    """A subject of ``kind``, naming a real queue, gateway or worker, or another."""
    if kind in PER_QUEUE:
        queue = draw(st.one_of(st.just(targets.queue), st.just(targets.webhook_queue), tokens()))
        return f"{SUBJECTS.prefix}.q.{queue}.{kind}"
    if kind == "dispatch":
        gateway = draw(
            st.one_of(st.just(targets.gateway), st.just(targets.webhook_gateway), tokens())
        )
        return SUBJECTS.dispatch(gateway)
    if kind == "callback":
        return SUBJECTS.webhook_callback(draw(st.one_of(st.just(targets.webhook_name), tokens())))
    if kind == "events":
        state = draw(st.one_of(st.sampled_from(["pending", "active", "completed"]), tokens()))
        return SUBJECTS.events(draw(st.one_of(st.just(targets.queue), tokens())), state)
    return {
        "cancel": SUBJECTS.cancel(),
        "promote": SUBJECTS.promote(),
        "watch": SUBJECTS.watch(),
        "resolve": SUBJECTS.resolve(),
        "rollcall": SUBJECTS.roll_call(),
        "holder_beat": SUBJECTS.holder_beat(),
        "dispatcher_beat": SUBJECTS.dispatcher_beat(),
        "cluster_nodes": SUBJECTS.cluster_nodes(),
    }[kind]


# ---------------------------------------------------------------- payloads

_TYPES: dict[str, Any] = {
    **PER_QUEUE,
    "cancel": cluster_pb2.CancelBroadcast,
    "promote": None,
    "watch": None,
    "resolve": cluster_pb2.Resolve,
    "rollcall": None,
    "holder_beat": cluster_pb2.HolderBeat,
    "dispatcher_beat": cluster_pb2.DispatcherBeat,
    "cluster_nodes": cluster_pb2.NodesRequest,
    "dispatch": cluster_pb2.DispatchRequest,
    "callback": cluster_pb2.WebhookCallback,
}


def _uint64s() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))


@st.composite
def pointed(draw: st.DrawFn, kind: str, targets: Targets) -> bytes:
    """A message of ``kind`` whose names are the real ones (so it reaches deep), its other
    fields hostile."""
    queue = st.one_of(st.just(targets.queue), st.just(targets.webhook_queue), text())
    gateway = st.one_of(st.just(targets.gateway), st.just(targets.webhook_gateway), text())
    message: Any
    if kind == "wake":
        message = cluster_pb2.Wake(queue=draw(queue))
    elif kind == "register":
        message = cluster_pb2.Register(
            gateway=draw(gateway),
            queue=draw(queue),
            capacity=draw(int32s()),
            weight=draw(int32s()),
            in_flight=draw(int32s()),
            labels=draw(st.dictionaries(text(), text(), max_size=3)),
            closing=draw(st.booleans()),
            returned=draw(_uint64s()),
            batch_types=draw(st.lists(text(), max_size=3)),
        )
    elif kind == "done":
        message = cluster_pb2.Done(
            gateway=draw(gateway), queue=draw(queue), n=draw(int32s()), returned=draw(_uint64s())
        )
    elif kind == "control":
        message = cluster_pb2.Control(queue=draw(queue), reason=draw(text()))
    elif kind == "groups":
        message = cluster_pb2.GroupsDue(queue=draw(queue))
        for _ in range(draw(st.integers(0, 3))):
            message.groups.add(group=draw(text()), size=draw(int32s()), max_size=draw(int32s()))
    elif kind == "cancel":
        message = cluster_pb2.CancelBroadcast(task_id=draw(text()), reason=draw(text()))
    elif kind == "dispatch":
        message = cluster_pb2.DispatchRequest(queue=draw(queue), dispatcher=draw(text()))
        if draw(st.booleans()):
            message.group = draw(text())  # an aggregation group's batch
        for _ in range(draw(st.integers(0, 3))):
            envelope = message.tasks.add()
            envelope.CopyFrom(draw(messages_of(task_pb2.TaskEnvelope)))
            if draw(st.booleans()):
                envelope.queue = draw(queue)
    elif kind == "callback":
        message = cluster_pb2.WebhookCallback(
            worker=draw(st.one_of(st.just(targets.webhook_name), text())),
            task_id=draw(text()),
            lease_id=draw(text()),
            queue=draw(queue),
        )
        if draw(st.booleans()):
            message.heartbeat.progress = draw(blobs())
        else:
            outcome = message.result
            outcome.outcome = draw(st.integers(-2, 6))
            outcome.result = draw(blobs())
            outcome.error = draw(text())
            outcome.retry_after = draw(floats())
    elif kind == "events":
        # What conveyor_runtime.wire.encode_events writes: each event after its size.
        events = draw(st.lists(messages_of(service_pb2.TaskEvent), max_size=3))
        encoded = [e.SerializeToString() for e in events]
        return Blob(b"".join(varint(len(e)) + e for e in encoded))
    elif kind == "resolve":
        message = draw(messages_of(cluster_pb2.Resolve))
    elif kind == "holder_beat":
        message = draw(messages_of(cluster_pb2.HolderBeat))
    elif kind == "dispatcher_beat":
        message = draw(messages_of(cluster_pb2.DispatcherBeat))
    else:
        return Blob(draw(st.sampled_from([b"", b"\x00", b"{}"])))
    return Blob(message.SerializeToString())


@st.composite
def payloads(draw: st.DrawFn, kind: str, targets: Targets) -> bytes:
    """Arbitrary bytes, a hostile message of the subject's type, or one naming what is
    really there."""
    message_type = _TYPES.get(kind)
    choices = [arbitrary_bytes(), pointed(kind, targets), pointed(kind, targets)]
    if message_type is not None:
        choices.append(bodies_of(message_type))
    elif kind == "events":
        choices.append(bodies_of(service_pb2.TaskEvent))
    body = draw(st.one_of(choices))
    # Within the nats-server's max_payload (a bigger one is the publisher's error).
    return body if len(body) <= 1024 * 1024 else Blob(body[: 1024 * 1024])


# ------------------------------------------------------------------- seals

SEALS = ("none", "sealed", "sealed", "sealed", "damaged", "other-key", "other-subject")


def header_text() -> st.SearchStrategy[str]:
    """Text a header value may carry (no line breaks: they would break the protocol)."""
    safe = st.characters(codec="utf-8", exclude_characters="\r\n\x00")
    return st.one_of(st.text(safe, max_size=40), st.sampled_from(["", "1", ".", "1....", "é"]))


@st.composite
def seal_headers(
    draw: st.DrawFn, auth: ClusterAuth, subject: str, body: bytes, request: bool
) -> dict[str, str] | None:
    """The headers a message goes with: none, a good seal, or a bad one."""
    how = draw(st.sampled_from(SEALS), label="seal")
    event(f"seal: {how}")
    within = 5.0 if request else None
    if how == "none":
        return None
    if how == "other-key":
        other = ClusterAuth(parse_keys([generate_key()]))
        return other.seal(subject, body, within=within)
    if how == "other-subject":
        return auth.seal(subject + ".x", body, within=within)
    headers = auth.seal(subject, body, within=within)
    if how == "damaged":
        parts = headers[SEAL_HEADER].split(".")
        damage = draw(st.sampled_from(["part", "whole", "extra", "upper"]))
        if damage == "part":
            parts[draw(st.integers(0, len(parts) - 1))] = draw(header_text())
        elif damage == "extra":
            parts.insert(draw(st.integers(0, len(parts))), draw(header_text()))
        elif damage == "upper":
            parts[-1] = parts[-1].upper()
        else:
            parts = [draw(header_text())]
        headers[SEAL_HEADER] = ".".join(parts).strip()
    if draw(st.booleans()):
        headers[draw(st.sampled_from(["X-Fuzz", "Nats-Msg-Id", "conveyor-seal"]))] = draw(
            header_text()
        )
    return headers


# --------------------------------------------------------------- the test


@pytest.fixture
async def fuzzer(stack: Stack) -> AsyncIterator[NatsClient]:
    nc = await connect_nats(stack.cluster.nats_url, name="fuzzer")
    yield nc
    await close_nats(nc, drain=False)


async def first_register(nc: NatsClient, queue: str, within: float = 30.0) -> str:
    """The gateway id of the first registration on ``queue``."""
    seen: list[str] = []

    async def on_msg(msg: Msg) -> None:
        with contextlib.suppress(DecodeError):
            seen.append(cluster_pb2.Register.FromString(msg.data).gateway)

    sub = await nc.subscribe(SUBJECTS.register(queue), cb=on_msg)
    try:
        await poll(lambda: bool(seen), f"a registration on {queue}", within=within)
    finally:
        await sub.unsubscribe()
    return seen[0]


class Drain:
    """Reads a server stream in the background until cancelled; remembers how it ended."""

    def __init__(self, source: Any) -> None:
        self.frames = 0
        self.error: grpc.aio.AioRpcError | None = None
        self.ended = False
        self._source = source
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                frame = await self._source()
                if frame is None or frame is grpc.aio.EOF:
                    self.ended = True
                    return
                self.frames += 1
        except grpc.aio.AioRpcError as exc:
            self.error = exc
            self.ended = True

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@dataclass
class Open:
    """A raw worker session on the targets' queue and a WatchEvents stream, open for the
    whole test and read in the background."""

    targets: Targets
    session: RawSession
    frames: Drain
    watch: Drain


@pytest.fixture
async def open_clients(stack: Stack, fuzzer: NatsClient) -> AsyncIterator[Open]:
    """What the messages name: a queue served by a raw worker session of the test (and its
    gateway), the webhook registration's gateway, name and queue. The session and a
    WatchEvents stream stay open throughout, and must still be when the test ends."""
    queue = f"fzn-{uuid.uuid4().hex}"
    session = RawSession(stack.channel, timeout=None)
    hello = service_pb2.Hello(queues={queue: 1}, concurrency=4, sdk_version="0.1.0")
    await session.send(service_pb2.WorkerFrame(hello=hello).SerializeToString())
    welcome = await session.read()
    assert welcome is not None
    webhook_gateway = await first_register(fuzzer, stack.webhook_queue)
    watch: Any = stack.channel.unary_stream("/conveyor.v1.AdminService/WatchEvents")
    watch_call: Any = watch(service_pb2.WatchEventsRequest().SerializeToString())
    await watch_call.initial_metadata()
    targets = Targets(
        queue,
        welcome.welcome.session_id,
        webhook_gateway,
        stack.webhook_name,
        stack.webhook_queue,
    )
    # No timeout on these reads: grpc cancels the call when a read is cancelled.
    opened = Open(targets, session, Drain(session.call.read), Drain(watch_call.read))
    yield opened
    assert not opened.frames.ended, opened.frames.error
    assert not opened.watch.ended, opened.watch.error
    await opened.watch.stop()
    watch_call.cancel()
    await session.close()
    await opened.frames.task
    assert await session.call.code() == grpc.StatusCode.OK, await session.call.details()


@fuzz(2.0)
@given(data=st.data())
async def test_hostile_messages_on_every_subject(
    stack: Stack, fuzzer: NatsClient, open_clients: Open, data: st.DataObject
) -> None:
    targets = open_clients.targets
    for _ in range(data.draw(st.integers(1, 4), label="messages")):
        kind = data.draw(st.sampled_from(KINDS), label="kind")
        event(f"subject: {kind}")
        subject = data.draw(subjects(kind, targets), label="subject")
        body = data.draw(payloads(kind, targets), label="body")
        request = kind in ("dispatch", "callback")
        headers = data.draw(seal_headers(stack.auth, subject, body, request), label="headers")
        answered = _answered(stack, subject, targets, headers, body)
        await _send(fuzzer, subject, body, headers, request, expect_reply=answered)
    await fuzzer.flush()
    assert not stack.dead(), stack.dead()
    # The worker session and the watcher are still there.
    assert not open_clients.frames.ended, open_clients.frames.error
    assert not open_clients.watch.ended, open_clients.watch.error


def _answered(
    stack: Stack,
    subject: str,
    targets: Targets,
    headers: dict[str, str] | None,
    body: bytes,
) -> bool:
    """True when the request must be answered: sealed properly, to a live gateway or to
    the webhook registration."""
    if headers is None or stack.auth.check(subject, body, headers) is not None:
        return False
    live = {SUBJECTS.dispatch(targets.gateway), SUBJECTS.dispatch(targets.webhook_gateway)}
    live.add(SUBJECTS.webhook_callback(targets.webhook_name))
    return subject in live


async def _send(
    nc: NatsClient,
    subject: str,
    body: bytes,
    headers: dict[str, str] | None,
    request: bool,
    *,
    expect_reply: bool,
) -> None:
    if not request or not expect_reply:
        await nc.publish(subject, bytes(body), headers=headers)
        return
    event("a sealed request to a live subscriber")
    reply = await nc.request(subject, bytes(body), timeout=10, headers=headers)
    if ".dispatch" in subject:
        cluster_pb2.DispatchReply.FromString(reply.data)
    else:
        answer = cluster_pb2.WebhookCallbackReply.FromString(reply.data)
        assert answer.status in cluster_pb2.WebhookCallbackReply.Status.values(), answer
