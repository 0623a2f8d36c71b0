"""The dispatcher facing a hostile gateway: the fuzzer registers a gateway of its own
(sealed Registers with hostile capacities, weights, in-flight counts and running totals),
sends it hostile Dones, and answers each dispatch offer with a hostile reply on the
dispatcher's ``_INBOX`` (accepting ids never offered, some twice, none, negative or huge
credits and totals; sealed, unsealed, or bytes that do not decode).

The dispatcher must not die or log an unhandled error, and every task it offered and the
reply did not accept goes back to pending at once (a reply that could not be believed: at
the dispatch timeout). A well-behaved worker is still served afterwards
(``tests/fuzz/conftest.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from conveyor_protos.v1 import cluster_pb2, task_pb2
from conveyor_runtime.nats_connect import close_nats, connect_nats
from conveyor_runtime.subjects import Subjects
from google.protobuf.message import DecodeError
from hypothesis import event, given
from hypothesis import strategies as st
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from tests.fuzz.profile import fuzz
from tests.fuzz.stack import Stack, poll
from tests.fuzz.strategies import arbitrary_bytes, int32s, names, text

pytestmark = [pytest.mark.fuzz, pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

SUBJECTS = Subjects()
_U64 = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))


@dataclass(frozen=True)
class Answer:
    """How the fake gateway answers one offer, decided before it comes."""

    take: tuple[bool, ...]  # per offered task, in order (cycled)
    extra: tuple[str, ...]  # ids never offered
    twice: bool  # every accepted id twice
    credits: int
    returned: int
    how: str  # "sealed", "unsealed", "garbage" (sealed bytes that do not decode)
    garbage: bytes = b""


answers = st.builds(
    Answer,
    take=st.lists(st.booleans(), min_size=1, max_size=4).map(tuple),
    extra=st.lists(st.one_of(names(), text()), max_size=2).map(tuple),
    twice=st.booleans(),
    credits=int32s(),
    returned=_U64,
    how=st.sampled_from(["sealed"] * 8 + ["unsealed", "garbage"]),
    garbage=arbitrary_bytes().map(lambda b: b[:4096]),
)


@dataclass
class FakeGateway:
    """Answers the dispatcher's offers to gateway ``name`` as ``plan`` says, in order."""

    stack: Stack
    nc: NatsClient
    name: str
    plan: list[Answer]
    offers: list[tuple[list[str], set[str] | None]] = field(default_factory=list)

    async def on_offer(self, msg: Msg) -> None:
        try:
            request = cluster_pb2.DispatchRequest.FromString(msg.data)
        except DecodeError:
            return
        offered = [env.id for env in request.tasks]
        answer = self.plan[min(len(self.offers), len(self.plan) - 1)]
        accepted = [
            task_id for n, task_id in enumerate(offered) if answer.take[n % len(answer.take)]
        ]
        ids = [*accepted, *answer.extra]
        if answer.twice:
            ids += accepted
        reply = cluster_pb2.DispatchReply(
            accepted=ids, credits=answer.credits, returned=answer.returned
        ).SerializeToString()
        believed = answer.how == "sealed"
        # What the dispatcher keeps: the accepted ids of a reply it believes; None: it
        # times out (or cannot decode the reply) and keeps nothing.
        self.offers.append((offered, set(accepted) if believed else None))
        body = answer.garbage if answer.how == "garbage" else reply
        headers = None if answer.how == "unsealed" else self.stack.auth.seal(msg.reply, body)
        if answer.how == "garbage":
            try:
                cluster_pb2.DispatchReply.FromString(body)
            except DecodeError:
                self.offers[-1] = (offered, None)
            else:
                decoded = cluster_pb2.DispatchReply.FromString(body)
                self.offers[-1] = (offered, set(decoded.accepted) & set(offered))
        await self.nc.publish(msg.reply, body, headers=headers)


async def send_sealed(stack: Stack, nc: NatsClient, subject: str, body: bytes) -> None:
    await nc.publish(subject, body, headers=stack.auth.seal(subject, body))


@pytest.fixture
async def fuzzer(stack: Stack) -> AsyncIterator[NatsClient]:
    nc = await connect_nats(stack.cluster.nats_url, name="fake-gateway")
    yield nc
    await close_nats(nc, drain=False)


@fuzz()
@given(data=st.data())
async def test_a_hostile_gateway(stack: Stack, fuzzer: NatsClient, data: st.DataObject) -> None:
    queue = f"fzd-{uuid.uuid4().hex}"
    gateway = f"fzgw-{uuid.uuid4().hex}"
    count = data.draw(st.integers(1, 4), label="tasks")
    plan = data.draw(st.lists(answers, min_size=1, max_size=3), label="answers")
    fake = FakeGateway(stack, fuzzer, gateway, plan)
    sub = await fuzzer.subscribe(SUBJECTS.dispatch(gateway), cb=fake.on_offer)
    ids = [
        (await stack.client.enqueue("fuzz.dispatch", {"n": n}, queue=queue)).id
        for n in range(count)
    ]
    register = cluster_pb2.Register(
        gateway=gateway,
        queue=queue,
        capacity=data.draw(st.one_of(*[st.integers(1, 8)] * 3, int32s()), label="capacity"),
        weight=data.draw(st.one_of(*[st.just(1)] * 3, int32s()), label="weight"),
        in_flight=data.draw(st.one_of(*[st.just(0)] * 3, int32s()), label="in_flight"),
        returned=data.draw(_U64, label="returned"),
    )
    await send_sealed(stack, fuzzer, SUBJECTS.register(queue), register.SerializeToString())
    for _ in range(data.draw(st.integers(0, 2), label="dones")):
        done = cluster_pb2.Done(
            gateway=gateway, queue=queue, n=data.draw(int32s()), returned=data.draw(_U64)
        )
        await send_sealed(stack, fuzzer, SUBJECTS.done(queue), done.SerializeToString())

    # An offer, if the registration left any credit: wait a moment for it (one that
    # comes later finds no gateway, and its tasks go back as well).
    async def offered() -> bool:
        return len(fake.offers) >= 1

    # (A registration with no capacity gets none: a short look is enough then.)
    try:
        await poll(offered, "an offer", within=1.5 if register.capacity > 0 else 0.3)
    except TimeoutError:
        event("no offer (no credit, or not yet)")
    # The gateway leaves (which stops further offers) and stops answering.
    closing = cluster_pb2.Register(gateway=gateway, queue=queue, closing=True)
    await send_sealed(stack, fuzzer, SUBJECTS.register(queue), closing.SerializeToString())
    await fuzzer.flush()
    await sub.unsubscribe()
    assert not stack.dead(), stack.dead()
    # A task a believed reply accepted stays leased to the fake gateway (until its lease
    # expires: the dispatcher never offers it again); every other one goes back to
    # pending, at once or, after a reply the dispatcher could not believe, at its timeout.
    kept = {i for _, accepted in fake.offers if accepted is not None for i in accepted}
    if any(accepted is None for _, accepted in fake.offers):
        event("a reply the dispatcher could not believe")
    for task_id in ids:
        if task_id in kept:
            event("a task accepted")
            continue
        await _pending(stack, task_id)


async def _pending(stack: Stack, task_id: str) -> None:
    async def pending() -> bool:
        return await stack.task_state(task_id) == task_pb2.TASK_STATE_PENDING

    await poll(pending, f"task {task_id} pending again", within=15)
