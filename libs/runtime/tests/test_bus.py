"""Bus: typed NATS messages against a real nats-server.

What NATS sees is checked on raw subscriptions (subjects, payload bytes, queue groups,
the seal header). Messages are sealed with the cluster key: what a test sends by hand it
seals with the bus's auth, except where the point is that an unsealed or forged message is
refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any

import nats.errors
import pytest
from conveyor_broker.types import TaskEvent, TaskState
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime.bus import (
    MALFORMED_CALLBACK,
    RESOLVE_GROUP,
    WEBHOOK_GROUP,
    Bus,
    Published,
)
from conveyor_runtime.cluster_key import SEAL_HEADER
from conveyor_runtime.nats_connect import NatsClient
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.wire import encode_events, event_to_proto
from conveyor_testkit.cluster_keys import cluster_auth
from conveyor_testkit.polling import wait_until
from google.protobuf.message import DecodeError
from nats.aio.msg import Msg

TIMEOUT = 10.0
AT = datetime(2030, 1, 1, tzinfo=UTC)
GARBAGE = b"\xff\xff not a protobuf"


class Raw:
    """Every message under the test's prefix, as NATS delivers it."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self.seals: list[str | None] = []

    async def start(self, nc: NatsClient, subjects: Subjects) -> Raw:
        async def on_msg(msg: Msg) -> None:
            self.messages.append((msg.subject, msg.data))
            self.seals.append((msg.headers or {}).get(SEAL_HEADER))

        await nc.subscribe(f"{subjects.prefix}.>", cb=on_msg)
        await nc.flush()
        return self

    async def wait_for(self, count: int) -> list[tuple[str, bytes]]:
        await wait_until(lambda: len(self.messages) >= count, within=TIMEOUT)
        return self.messages


def cluster_auth_key() -> str:
    """A key of another cluster (an intruder's)."""
    from conveyor_runtime.cluster_key import generate_key

    return generate_key()


async def sealed(nc: NatsClient, bus: Bus, subject: str, body: bytes) -> None:
    """Publish ``body`` by hand, sealed with ``bus``'s key."""
    await nc.publish(subject, body, headers=bus.auth.seal(subject, body))


def event(task_id: str, queue: str = "q", state: TaskState | None = TaskState.PENDING) -> TaskEvent:
    return TaskEvent(task_id, queue, "t", state, None, AT)


# ------------------------------------------------------------------ publish


async def test_each_message_type_goes_on_its_subject_with_its_bytes(
    bus: Bus, nc: NatsClient, subjects: Subjects
) -> None:
    raw = await Raw().start(nc, subjects)
    p = subjects.prefix
    sent: list[tuple[Published, str]] = [
        (cluster_pb2.Wake(queue="a"), f"{p}.q.a.wake"),
        (cluster_pb2.Register(gateway="g", queue="b", capacity=3, returned=7), f"{p}.q.b.register"),
        (cluster_pb2.Done(gateway="g", queue="c", n=2, returned=9), f"{p}.q.c.done"),
        (cluster_pb2.Control(queue="d", reason="paused"), f"{p}.q.d.control"),
        (cluster_pb2.CancelBroadcast(task_id="t1", reason="operator"), f"{p}.cancel"),
        (cluster_pb2.Resolve(task_ids=["t2", "t3"]), f"{p}.resolve"),
        (cluster_pb2.HolderBeat(holder="api-1"), f"{p}.holder.beat"),
        (cluster_pb2.DispatcherBeat(instance="d-1", leaving=True), f"{p}.dispatcher.beat"),
    ]
    for message, _ in sent:
        await bus.publish(message)
    got = await raw.wait_for(len(sent))
    assert got == [(subject, message.SerializeToString()) for message, subject in sent]
    # The same subjects the Subjects helpers spell.
    assert got[0][0] == subjects.wake("a")
    assert got[4][0] == subjects.cancel()
    # Each sealed: version, key id, sent, no deadline, MAC.
    for seal in raw.seals:
        assert seal is not None
        version, kid, sent_ms, deadline, mac = seal.split(".")
        assert (version, kid, deadline) == ("1", bus.auth.key_ids[0], "0")
        assert int(sent_ms) > 0
        assert len(mac) == 32


async def test_hints_and_events_go_on_their_subjects(
    bus: Bus, nc: NatsClient, subjects: Subjects
) -> None:
    raw = await Raw().start(nc, subjects)
    p = subjects.prefix
    run = [event("t1", "mail", TaskState.COMPLETED), event("t2", "mail", TaskState.COMPLETED)]
    await bus.publish_promote()
    await bus.publish_watch()
    await bus.publish_roll_call()
    await bus.publish_owner_changed("mail")
    await bus.publish_events(run)
    await bus.publish_events([event("t3", "mail", None)])
    assert await raw.wait_for(6) == [
        (f"{p}.promote", b""),
        (f"{p}.watch", b""),
        (f"{p}.rollcall", b""),
        (f"{p}.q.mail.owner", b""),
        (f"{p}.events.mail.completed", encode_events(run)),
        (f"{p}.events.mail.deleted", encode_events([event("t3", "mail", None)])),
    ]


def test_a_type_the_bus_does_not_publish_is_a_type_error(bus: Bus) -> None:
    request: Any = cluster_pb2.DispatchRequest(queue="q")
    with pytest.raises(TypeError, match="DispatchRequest"):
        bus.publish(request)


# ---------------------------------------------------------------- subscribe


async def test_every_type_round_trips_to_its_handler(bus: Bus, nc: NatsClient) -> None:
    got: list[object] = []

    async def collect_async(message: cluster_pb2.Register) -> None:
        await asyncio.sleep(0)
        got.append(message)

    await bus.subscribe(cluster_pb2.Wake, got.append)
    await bus.subscribe(cluster_pb2.Register, collect_async)
    await bus.subscribe(cluster_pb2.Done, got.append)
    await bus.subscribe(cluster_pb2.Control, got.append)
    await bus.subscribe(cluster_pb2.CancelBroadcast, got.append)
    await bus.subscribe(cluster_pb2.Resolve, got.append)
    await bus.subscribe(cluster_pb2.HolderBeat, got.append)
    await bus.subscribe(cluster_pb2.DispatcherBeat, got.append)
    await nc.flush()
    sent: list[Published] = [
        cluster_pb2.Wake(queue="a"),
        cluster_pb2.Register(gateway="g", queue="b", capacity=4, labels={"zone": "x"}),
        cluster_pb2.Done(gateway="g", queue="c", n=1, returned=1),
        cluster_pb2.Control(queue="d", reason="resumed"),
        cluster_pb2.CancelBroadcast(task_id="t1", reason="operator"),
        cluster_pb2.Resolve(task_ids=["t2", "t3"]),
        cluster_pb2.HolderBeat(holder="api-1"),
        cluster_pb2.DispatcherBeat(instance="d-1"),
    ]
    for message in sent:
        await bus.publish(message)
    await wait_until(lambda: len(got) == len(sent), within=TIMEOUT)
    assert {type(m): m for m in got} == {type(m): m for m in sent}


async def test_a_queue_subscription_gets_only_that_queue(bus: Bus, nc: NatsClient) -> None:
    mail: list[cluster_pb2.Done] = []
    await bus.subscribe(cluster_pb2.Done, mail.append, queue="mail")
    await nc.flush()
    await bus.publish(cluster_pb2.Done(gateway="g", queue="other", n=1))
    await bus.publish(cluster_pb2.Done(gateway="g", queue="mail", n=2))
    # One connection publishes both in order: "other" would have arrived first.
    await wait_until(lambda: len(mail) == 1, within=TIMEOUT)
    assert [d.queue for d in mail] == ["mail"]


async def test_messages_sent_by_hand_reach_a_bus_handler_only_sealed(
    bus: Bus, nc: NatsClient, subjects: Subjects
) -> None:
    got: list[cluster_pb2.Register] = []
    await bus.subscribe(cluster_pb2.Register, got.append)
    await nc.flush()
    subject = subjects.register("mail")
    unsealed = cluster_pb2.Register(gateway="old", queue="mail", capacity=2)
    await nc.publish(subject, unsealed.SerializeToString())
    register = cluster_pb2.Register(gateway="new", queue="mail", capacity=2)
    body = register.SerializeToString()
    await nc.publish(subject, body, headers=bus.auth.seal(subject, body))
    await wait_until(lambda: got == [register], within=TIMEOUT)
    assert bus.refusals.counts == {"Register": 1}


async def test_a_bus_that_allows_unsigned_messages_takes_unsealed_ones_too(
    nc: NatsClient, subjects: Subjects
) -> None:
    """A rolling upgrade: services with the key and allow_unsigned still hear the ones
    that do not seal yet, but a wrong seal is refused all the same."""
    upgrading = Bus(nc, subjects, cluster_auth(allow_unsigned=True))
    got: list[cluster_pb2.Register] = []
    await upgrading.subscribe(cluster_pb2.Register, got.append)
    await nc.flush()
    subject = subjects.register("mail")
    old = cluster_pb2.Register(gateway="old", queue="mail", capacity=2)
    await nc.publish(subject, old.SerializeToString())
    forged = cluster_pb2.Register(gateway="forged", queue="mail", closing=True)
    other_key = cluster_auth(cluster_auth_key())
    await nc.publish(
        subject,
        forged.SerializeToString(),
        headers=other_key.seal(subject, forged.SerializeToString()),
    )
    new = cluster_pb2.Register(gateway="new", queue="mail", capacity=2)
    await Bus(nc, subjects, cluster_auth()).publish(new)
    await wait_until(lambda: len(got) == 2, within=TIMEOUT)
    assert got == [old, new]
    assert upgrading.refusals.counts == {"Register": 1}


async def test_an_undecodable_payload_is_dropped_and_the_subscription_lives_on(
    bus: Bus, nc: NatsClient, subjects: Subjects, caplog: pytest.LogCaptureFixture
) -> None:
    got: list[cluster_pb2.Register] = []
    cancels: list[cluster_pb2.CancelBroadcast] = []
    await bus.subscribe(cluster_pb2.Register, got.append)
    await bus.subscribe(cluster_pb2.CancelBroadcast, cancels.append)
    await nc.flush()
    with caplog.at_level(logging.WARNING, logger="conveyor_runtime.bus"):
        await sealed(nc, bus, subjects.register("mail"), GARBAGE)
        await sealed(nc, bus, subjects.cancel(), GARBAGE)
        await bus.publish(cluster_pb2.Register(gateway="g", queue="mail", capacity=1))
        await bus.publish(cluster_pb2.CancelBroadcast(task_id="t"))
        await wait_until(lambda: len(got) == 1 and len(cancels) == 1, within=TIMEOUT)
    assert got[0].gateway == "g"
    assert cancels[0].task_id == "t"
    warnings = [r.getMessage() for r in caplog.records]
    assert any("bus.undecodable kind=Register" in w for w in warnings), warnings
    assert any("bus.undecodable kind=CancelBroadcast" in w for w in warnings), warnings


async def test_resolve_is_subscribed_in_its_queue_group(bus: Bus, nc: NatsClient) -> None:
    first: list[cluster_pb2.Resolve] = []
    second: list[cluster_pb2.Resolve] = []
    sub = await bus.subscribe(cluster_pb2.Resolve, first.append)
    await bus.subscribe(cluster_pb2.Resolve, second.append)
    await nc.flush()
    assert sub.queue == RESOLVE_GROUP
    for n in range(20):
        await bus.publish(cluster_pb2.Resolve(task_ids=[f"t{n}"]))
    await wait_until(lambda: len(first) + len(second) == 20, within=TIMEOUT)
    # One member of the group takes each: none arrives twice.
    assert sorted(r.task_ids[0] for r in first + second) == sorted(f"t{n}" for n in range(20))


async def test_subscribe_refuses_what_it_cannot_route(bus: Bus) -> None:
    kind: Any = cluster_pb2.DispatchRequest
    with pytest.raises(TypeError, match="DispatchRequest"):
        await bus.subscribe(kind, lambda _: None)
    with pytest.raises(ValueError, match="not a per-queue message"):
        await bus.subscribe(cluster_pb2.CancelBroadcast, lambda _: None, queue="mail")


# -------------------------------------------------------------------- hints


async def test_hints_reach_their_handlers(bus: Bus, nc: NatsClient) -> None:
    promotes: list[None] = []
    watches: list[None] = []
    roll_calls: list[None] = []
    owners: list[str] = []
    mail_owners: list[str] = []

    async def on_watch() -> None:
        watches.append(None)

    await bus.subscribe_promote(lambda: promotes.append(None))
    await bus.subscribe_watch(on_watch)
    await bus.subscribe_roll_call(lambda: roll_calls.append(None))
    await bus.subscribe_owner_changed(owners.append)
    await bus.subscribe_owner_changed(mail_owners.append, queue="mail")
    await nc.flush()
    await bus.publish_promote()
    await bus.publish_watch()
    await bus.publish_roll_call()
    await bus.publish_owner_changed("other")
    await bus.publish_owner_changed("mail")
    await wait_until(
        lambda: (
            (len(promotes), len(watches), len(roll_calls), len(owners), len(mail_owners))
            == (1, 1, 1, 2, 1)
        ),
        within=TIMEOUT,
    )
    assert owners == ["other", "mail"]
    assert mail_owners == ["mail"]


# ------------------------------------------------------------------- events


async def test_events_round_trip_and_filter_by_queue(
    bus: Bus, nc: NatsClient, subjects: Subjects, caplog: pytest.LogCaptureFixture
) -> None:
    every: list[list[service_pb2.TaskEvent]] = []
    mail: list[list[service_pb2.TaskEvent]] = []
    await bus.subscribe_events(every.append)
    await bus.subscribe_events(mail.append, queue="mail")
    await nc.flush()
    with caplog.at_level(logging.WARNING, logger="conveyor_runtime.bus"):
        await sealed(nc, bus, subjects.events("mail", "pending"), GARBAGE)
        await bus.publish_events([event("t1", "other")])
        await bus.publish_events([event("t2", "mail"), event("t3", "mail")])
        await wait_until(lambda: len(every) == 2 and len(mail) == 1, within=TIMEOUT)
    assert every == [
        [event_to_proto(event("t1", "other"))],
        [event_to_proto(event("t2", "mail")), event_to_proto(event("t3", "mail"))],
    ]
    assert mail == every[1:]
    assert any("bus.undecodable kind=TaskEvent" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------ request/reply


async def test_dispatch_request_and_reply(bus: Bus, nc: NatsClient, subjects: Subjects) -> None:
    seen: list[cluster_pb2.DispatchRequest] = []

    def answer(request: cluster_pb2.DispatchRequest) -> cluster_pb2.DispatchReply:
        seen.append(request)
        return cluster_pb2.DispatchReply(
            accepted=[env.id for env in request.tasks[:1]], credits=4, returned=2
        )

    await bus.serve_dispatch("gw-1", answer)
    await nc.flush()
    request = cluster_pb2.DispatchRequest(queue="mail", dispatcher="d")
    request.tasks.add(id="a", queue="mail")
    request.tasks.add(id="b", queue="mail")
    reply = await bus.dispatch("gw-1", request, within=TIMEOUT)
    assert seen == [request]
    assert reply == cluster_pb2.DispatchReply(accepted=["a"], credits=4, returned=2)

    # A requester that sends by hand, sealed, on the gateway's subject, gets the same
    # answer, sealed for its inbox.
    subject = subjects.dispatch("gw-1")
    body = request.SerializeToString()
    msg = await nc.request(subject, body, TIMEOUT, headers=bus.auth.seal(subject, body))
    assert cluster_pb2.DispatchReply.FromString(msg.data) == reply
    assert bus.auth.check(msg.subject, msg.data, msg.headers) is None

    # An undecodable request is answered as an empty one, at once.
    msg = await nc.request(subject, GARBAGE, TIMEOUT, headers=bus.auth.seal(subject, GARBAGE))
    assert seen[-1] == cluster_pb2.DispatchRequest()
    assert cluster_pb2.DispatchReply.FromString(msg.data).accepted == []

    # An unsealed one is not answered at all.
    with pytest.raises(nats.errors.TimeoutError):
        await nc.request(subject, body, 0.3)
    assert len(seen) == 3
    assert bus.refusals.counts == {"DispatchRequest": 1}

    with pytest.raises(nats.errors.NoRespondersError):
        await bus.dispatch("gw-gone", request, within=TIMEOUT)


async def test_an_undecodable_dispatch_reply_is_a_decode_error(
    bus: Bus, nc: NatsClient, subjects: Subjects
) -> None:
    async def garbage(msg: Msg) -> None:
        assert msg.reply
        await sealed(nc, bus, msg.reply, GARBAGE)

    await nc.subscribe(subjects.dispatch("gw-bad"), cb=garbage)
    await nc.flush()
    with pytest.raises(DecodeError):
        await bus.dispatch("gw-bad", cluster_pb2.DispatchRequest(queue="q"), within=TIMEOUT)


async def test_webhook_callbacks_request_and_reply_in_their_queue_group(
    bus: Bus, nc: NatsClient, subjects: Subjects
) -> None:
    seen: list[cluster_pb2.WebhookCallback] = []

    async def answer(callback: cluster_pb2.WebhookCallback) -> cluster_pb2.WebhookCallbackReply:
        seen.append(callback)
        return cluster_pb2.WebhookCallbackReply(lease_expires_at=12.5)

    sub = await bus.serve_webhook_callbacks("hooks", answer)
    await nc.flush()
    assert sub.queue == WEBHOOK_GROUP
    assert sub.subject == subjects.webhook_callback("hooks")
    callback = cluster_pb2.WebhookCallback(worker="hooks", task_id="t", lease_id="l", queue="q")
    callback.heartbeat.progress = b"half"
    reply = await bus.webhook_callback(callback, within=TIMEOUT)
    assert seen == [callback]
    assert reply.lease_expires_at == 12.5

    subject = subjects.webhook_callback("hooks")
    msg = await nc.request(subject, GARBAGE, TIMEOUT, headers=bus.auth.seal(subject, GARBAGE))
    assert cluster_pb2.WebhookCallbackReply.FromString(msg.data) == MALFORMED_CALLBACK
    assert len(seen) == 1

    with pytest.raises(nats.errors.NoRespondersError):
        await bus.webhook_callback(cluster_pb2.WebhookCallback(worker="nobody"), within=TIMEOUT)


async def test_spawned_webhook_answers_do_not_wait_for_each_other(bus: Bus, nc: NatsClient) -> None:
    release = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    async def answer(callback: cluster_pb2.WebhookCallback) -> cluster_pb2.WebhookCallbackReply:
        if callback.task_id == "slow":
            await release.wait()
        return cluster_pb2.WebhookCallbackReply(message=callback.task_id)

    def spawn(coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await bus.serve_webhook_callbacks("hooks", answer, spawn=spawn)
    await nc.flush()
    slow = asyncio.ensure_future(
        bus.webhook_callback(
            cluster_pb2.WebhookCallback(worker="hooks", task_id="slow"), within=TIMEOUT
        )
    )
    await wait_until(lambda: len(tasks) == 1, within=TIMEOUT)
    fast = await bus.webhook_callback(
        cluster_pb2.WebhookCallback(worker="hooks", task_id="fast"), within=TIMEOUT
    )
    assert fast.message == "fast"
    assert not slow.done()
    release.set()
    assert (await slow).message == "slow"


# ------------------------------------------------------------- the cluster key


async def test_forged_and_moved_messages_never_reach_a_handler(
    bus: Bus, nc: NatsClient, subjects: Subjects
) -> None:
    """Every kind the bus takes refuses a message sealed with another key, and a sealed
    message copied (headers and all) to another subject: another queue, another gateway."""
    got: list[object] = []
    hints: list[str] = []
    await bus.subscribe(cluster_pb2.Wake, got.append)
    await bus.subscribe(cluster_pb2.Register, got.append)
    await bus.subscribe(cluster_pb2.Done, got.append)
    await bus.subscribe(cluster_pb2.Control, got.append)
    await bus.subscribe(cluster_pb2.CancelBroadcast, got.append)
    await bus.subscribe_promote(lambda: hints.append("promote"))
    await bus.subscribe_watch(lambda: hints.append("watch"))
    await bus.subscribe_roll_call(lambda: hints.append("roll call"))
    await bus.subscribe_owner_changed(hints.append)
    await bus.subscribe_events(got.append)
    await bus.serve_dispatch("gw-1", lambda r: cluster_pb2.DispatchReply(accepted=["x"]))
    await nc.flush()
    intruder = Bus(nc, subjects, cluster_auth(cluster_auth_key()))
    for message in (
        cluster_pb2.Wake(queue="mail"),
        cluster_pb2.Register(gateway="g", queue="mail", closing=True),
        cluster_pb2.Done(gateway="g", queue="mail", n=5),
        cluster_pb2.Control(queue="mail", reason="forged"),
        cluster_pb2.CancelBroadcast(task_id="t"),
    ):
        await intruder.publish(message)
    await intruder.publish_promote()
    await intruder.publish_watch()
    await intruder.publish_roll_call()
    await intruder.publish_owner_changed("mail")
    await intruder.publish_events([event("t1", "mail")])
    with pytest.raises(nats.errors.TimeoutError):
        await intruder.dispatch("gw-1", cluster_pb2.DispatchRequest(queue="q"), within=0.2)
    # A real seal, lifted onto another subject.
    body = cluster_pb2.Register(gateway="g", queue="mail", closing=True).SerializeToString()
    seal = bus.auth.seal(subjects.register("mail"), body)
    await nc.publish(subjects.register("other"), body, headers=seal)
    request = cluster_pb2.DispatchRequest(queue="q").SerializeToString()
    seal = bus.auth.seal(subjects.dispatch("gw-2"), request, within=5.0)
    with pytest.raises(nats.errors.TimeoutError):
        await nc.request(subjects.dispatch("gw-1"), request, 0.3, headers=seal)
    expected = {
        "Wake": 1,
        "Register": 2,
        "Done": 1,
        "Control": 1,
        "CancelBroadcast": 1,
        "promote": 1,
        "watch": 1,
        "roll_call": 1,
        "owner": 1,
        "TaskEvent": 1,
        "DispatchRequest": 2,
    }
    await wait_until(lambda: bus.refusals.counts == expected, within=TIMEOUT)
    assert got == []
    assert hints == []


async def test_a_forged_reply_is_ignored_and_the_real_one_answers(
    bus: Bus, nc: NatsClient, subjects: Subjects
) -> None:
    """An intruder on the gateway's subject answers first (accepted=[], which would make
    the dispatcher release tasks the gateway took): the dispatcher waits on for the
    gateway's own reply."""
    requests: list[Msg] = []

    async def forge_and_hold(msg: Msg) -> None:
        assert msg.reply
        body = cluster_pb2.DispatchReply(accepted=[]).SerializeToString()
        forger = cluster_auth(cluster_auth_key())
        await nc.publish(msg.reply, body, headers=forger.seal(msg.reply, body))
        await nc.publish(msg.reply, body)  # and unsealed
        requests.append(msg)  # the gateway answers later

    await nc.subscribe(subjects.dispatch("gw-1"), cb=forge_and_hold)
    await nc.flush()
    request = cluster_pb2.DispatchRequest(queue="mail")
    request.tasks.add(id="a", queue="mail")
    pending = asyncio.ensure_future(bus.dispatch("gw-1", request, within=TIMEOUT))
    await wait_until(lambda: bus.refusals.counts.get("DispatchReply", 0) == 2, within=TIMEOUT)
    assert not pending.done()
    [msg] = requests
    assert msg.reply
    body = cluster_pb2.DispatchReply(accepted=["a"]).SerializeToString()
    await nc.publish(msg.reply, body, headers=bus.auth.seal(msg.reply, body))
    assert list((await pending).accepted) == ["a"]


async def test_a_request_past_its_deadline_is_not_answered(
    bus: Bus, nc: NatsClient, subjects: Subjects
) -> None:
    """A dispatch that arrives after its sender gave up (its clock says the deadline
    passed) is refused: the dispatcher released its tasks already."""
    seen: list[cluster_pb2.DispatchRequest] = []

    def answer(request: cluster_pb2.DispatchRequest) -> cluster_pb2.DispatchReply:
        seen.append(request)
        return cluster_pb2.DispatchReply()

    await bus.serve_dispatch("gw-1", answer)
    await nc.flush()
    # Sent 3 s ago with a 2 s deadline: it reaches the gateway 1 s late.
    late = Bus(nc, subjects, cluster_auth(now=lambda: time.time() - 3.0))
    with pytest.raises(nats.errors.TimeoutError):
        await late.dispatch("gw-1", cluster_pb2.DispatchRequest(queue="q"), within=2.0)
    assert seen == []
    assert bus.refusals.counts == {"DispatchRequest": 1}
    # In time, the same request is answered (and the reply, sealed with the requester's
    # clock 3 s behind, is still within its age).
    await late.dispatch("gw-1", cluster_pb2.DispatchRequest(queue="q"), within=5.0)
    assert len(seen) == 1


async def test_gather_nodes_collects_every_sealed_answer_and_drops_forged_ones(
    bus: Bus, nc: NatsClient, subjects: Subjects
) -> None:
    """Every process answers a NodesRequest (no queue group): the requester keeps each
    verified ClusterNode that arrives within the window; a forged or unsealed answer is
    refused and counted, and one that does not decode is skipped."""
    other = Bus(nc, subjects, bus.auth)
    subs = [
        await bus.serve_nodes(lambda: service_pb2.ClusterNode(instance="a", kind="api")),
        await other.serve_nodes(
            lambda: service_pb2.ClusterNode(instance="d", kind="dispatcher", owned_queues=["q"])
        ),
    ]

    async def intruder(msg: Msg) -> None:
        assert msg.reply
        body = service_pb2.ClusterNode(instance="forged", kind="api").SerializeToString()
        await nc.publish(msg.reply, body)  # unsealed
        forger = cluster_auth(cluster_auth_key())
        await nc.publish(msg.reply, body, headers=forger.seal(msg.reply, body))
        await nc.publish(msg.reply, GARBAGE, headers=bus.auth.seal(msg.reply, GARBAGE))

    await nc.subscribe(subjects.cluster_nodes(), cb=intruder)
    await nc.flush()
    nodes = await bus.gather_nodes(within=0.5)
    assert sorted((n.kind, n.instance) for n in nodes) == [("api", "a"), ("dispatcher", "d")]
    assert bus.refusals.counts.get("ClusterNode", 0) == 2
    # An unsealed request is refused by both responders, unanswered.
    await nc.publish(subjects.cluster_nodes(), b"", reply=nc.new_inbox())
    await wait_until(
        lambda: (
            bus.refusals.counts.get("NodesRequest", 0) == 1
            and other.refusals.counts.get("NodesRequest", 0) == 1
        ),
        within=TIMEOUT,
    )
    for sub in subs:
        await sub.unsubscribe()
