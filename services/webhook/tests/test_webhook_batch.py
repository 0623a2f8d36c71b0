"""Aggregation groups to a webhook endpoint: the ``conveyor.batch`` call and its answers.

The pure parts (the body, its headers, the parsing of the answer into a Result per
member, the metric label) are tested as functions. :class:`WebhookGateway`'s batch
transport is tested against a real aiohttp endpoint with a stand-in for the Gateway that
records what the transport hands back (``on_batch_result``), so that it needs no
dispatcher. The whole path (a dispatcher leasing a due group, the Gateway holding it) is
in ``test_webhook_gateway.py`` (``test_a_due_group_is_one_call_and_every_member_completes``).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from aiohttp import web
from conveyor_broker import FakeClock, WebhookWorker
from conveyor_broker.memory import MemoryBroker
from conveyor_gateway import GatewayConfig
from conveyor_protos.v1 import service_pb2, task_pb2
from conveyor_runtime import wire
from conveyor_runtime.webhook_auth import verify_standard
from conveyor_runtime.webhook_urls import AddressPolicy
from conveyor_testkit.polling import wait_until
from conveyor_testkit.webhooks import LOCAL_ENDPOINTS, SECRET, Delivery, Endpoint, rpc_error, status
from conveyor_webhook import WebhookConfig, WebhookGateway, Wiring
from conveyor_webhook.delivery import (
    BATCH_METHOD,
    DELIVERY_HEADER,
    USER_AGENT,
    batch_body,
    delivery_headers,
)
from conveyor_webhook.gateway import batch_outcome, batch_results
from conveyor_webhook.response import (
    ASYNC_BATCH_ERROR,
    MISSING_MEMBER_ERROR,
    BatchFinished,
    Broken,
    Finished,
    parse_batch_response,
)
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

LEASE = "01J0000000000000000000000L"
IDS = ("01J00000000000000000000001", "01J00000000000000000000002", "01J00000000000000000000003")
EXPIRES = datetime(2030, 1, 1, 0, 0, 30, tzinfo=UTC)
DEADLINE = datetime(2030, 1, 2, tzinfo=UTC)
OK = service_pb2.OUTCOME_SUCCESS
FAILURE = service_pb2.OUTCOME_FAILURE
SKIP = service_pb2.OUTCOME_SKIP_RETRY
RELEASE = service_pb2.OUTCOME_RELEASE


def member(n: int, **fields: object) -> task_pb2.TaskEnvelope:
    env = task_pb2.TaskEnvelope(
        id=IDS[n],
        queue="digests",
        type="digest.send",
        payload=f'{{"n": {n}}}'.encode() + b"\x00\xff",
        headers={"tenant": f"t{n}"},
        lease_id=LEASE,
        attempt=n + 1,
        max_retry=5,
        lease_expires_at=wire.timestamp(EXPIRES),
        group="user-42",
    )
    for name, value in fields.items():
        getattr(env, name).CopyFrom(value)
    return env


def group(count: int = 3, lease: str = LEASE) -> service_pb2.BatchDispatch:
    tasks = [member(n) for n in range(count)]
    for env in tasks:
        env.lease_id = lease
    return service_pb2.BatchDispatch(
        queue="digests", group="user-42", type="digest.send", tasks=tasks
    )


def answer(result: object = None, *, error: object = None, id_: object = LEASE) -> bytes:
    doc: dict[str, object] = {"jsonrpc": "2.0", "id": id_}
    if error is not None:
        doc["error"] = error
    else:
        doc["result"] = result
    return json.dumps(doc).encode()


def parsed(result: object, **options: Any) -> BatchFinished | Broken:
    return parse_batch_response(200, answer(result, **options), LEASE, IDS)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ------------------------------------------------------------------ the call


def test_the_batch_is_one_json_rpc_call_carrying_every_member() -> None:
    batch = group()
    batch.tasks[1].deadline.CopyFrom(wire.timestamp(DEADLINE))
    call = json.loads(batch_body(batch))
    assert (call["jsonrpc"], call["id"], call["method"]) == ("2.0", LEASE, BATCH_METHOD)
    assert BATCH_METHOD == "conveyor.batch"
    params = call["params"]
    assert set(params) == {"queue", "group", "type", "lease_expires_at", "tasks"}
    assert (params["queue"], params["group"], params["type"]) == (
        "digests",
        "user-42",
        "digest.send",
    )
    assert params["lease_expires_at"] == "2030-01-01T00:00:30Z"
    assert [t["task_id"] for t in params["tasks"]] == list(IDS)
    for n, task in enumerate(params["tasks"]):
        assert set(task) == {
            "task_id",
            "type",
            "payload",
            "headers",
            "attempt",
            "max_retry",
            "deadline",
        }
        assert base64.b64decode(task["payload"]) == f'{{"n": {n}}}'.encode() + b"\x00\xff"
        assert task["headers"] == {"tenant": f"t{n}"}
        assert (task["type"], task["attempt"], task["max_retry"]) == ("digest.send", n + 1, 5)
    assert [t["deadline"] for t in params["tasks"]] == [None, "2030-01-02T00:00:00Z", None]
    # No lease token, no callback: a batch is finished by its answer alone.
    assert "lease_token" not in batch_body(batch).decode()
    assert "callback" not in params


def test_the_batch_is_signed_under_its_lease_and_names_no_single_task() -> None:
    batch = group()
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    batch.tasks[0].headers["traceparent"] = traceparent
    body = batch_body(batch)
    headers = delivery_headers(
        body,
        task_id=None,
        delivery_id=LEASE,
        secret="newest",
        timestamp=1_900_000_000,
        task_headers=batch.tasks[0].headers,
    )
    assert headers["webhook-id"] == LEASE
    expected = hmac.new(b"newest", f"{LEASE}.1900000000.".encode() + body, "sha256").digest()
    assert headers["webhook-signature"] == "v1," + base64.b64encode(expected).decode()
    assert verify_standard(headers, body, ["newest"], now=1_900_000_000)
    assert DELIVERY_HEADER not in headers
    assert headers["User-Agent"] == USER_AGENT
    assert headers["traceparent"] == traceparent


# ---------------------------------------------------------------- the answer


def test_a_batch_outcome_applies_to_every_member() -> None:
    reply = parsed({"outcome": "success", "result": b64(b"done")})
    assert reply == BatchFinished(dict.fromkeys(IDS, Finished(OK, b"done")))
    failed = parsed({"outcome": "failure", "error": "smtp down", "retry_after": 60})
    assert failed == BatchFinished(dict.fromkeys(IDS, Finished(FAILURE, b"", "smtp down", 60.0)))


def test_results_give_each_member_its_own_outcome() -> None:
    reply = parsed(
        {
            "results": [
                {"task_id": IDS[2], "result": b64(b"third")},
                {"task_id": IDS[0], "error": "bounced", "retry": True, "retry_after": 5},
                {"task_id": IDS[1], "error": "no such user", "retry": False},
            ]
        }
    )
    assert reply == BatchFinished(
        {
            IDS[0]: Finished(FAILURE, b"", "bounced", 5.0),
            IDS[1]: Finished(SKIP, b"", "no such user"),
            IDS[2]: Finished(OK, b"third"),
        }
    )


def test_results_may_name_outcomes_as_a_single_answer_does() -> None:
    reply = parsed(
        {
            "results": [
                {"task_id": IDS[0], "outcome": "release"},
                {"task_id": IDS[1], "outcome": "skip_retry", "error": "bad"},
                {"task_id": IDS[2], "outcome": "failure", "error": "later", "retry_after": 1.5},
            ]
        }
    )
    assert reply == BatchFinished(
        {
            IDS[0]: Finished(RELEASE),
            IDS[1]: Finished(SKIP, b"", "bad"),
            IDS[2]: Finished(FAILURE, b"", "later", 1.5),
        }
    )


def test_members_left_out_take_the_batch_outcome_or_fail() -> None:
    some = [{"task_id": IDS[1], "error": "nope"}]
    with_default = parsed({"outcome": "success", "results": some})
    assert with_default == BatchFinished(
        {IDS[0]: Finished(OK), IDS[1]: Finished(FAILURE, b"", "nope"), IDS[2]: Finished(OK)}
    )
    without = parsed({"results": some})
    missing = Finished(FAILURE, b"", MISSING_MEMBER_ERROR)
    assert without == BatchFinished(
        {IDS[0]: missing, IDS[1]: Finished(FAILURE, b"", "nope"), IDS[2]: missing}
    )


@pytest.mark.parametrize(
    "result",
    [
        {"outcome": "accepted"},
        {"outcome": "success", "results": [{"task_id": IDS[0], "outcome": "accepted"}]},
    ],
    ids=["batch", "member"],
)
def test_accepted_is_refused_for_a_batch(result: object) -> None:
    assert parsed(result) == Broken(ASYNC_BATCH_ERROR)


def test_failures_of_the_whole_call_are_one_broken_answer() -> None:
    assert parsed(None, error={"code": -32000, "message": "overloaded"}) == Broken("overloaded")
    server = parse_batch_response(503, b"", LEASE, IDS)
    assert server == Broken("endpoint answered HTTP 503", transport=True)
    client = parse_batch_response(404, b"", LEASE, IDS)
    assert client == Broken("endpoint answered HTTP 404")


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (answer({"outcome": "success"}, id_="other"), '"id" is'),
        (answer({}), 'needs an "outcome" or "results"'),
        (answer({"outcome": "done"}), "\"outcome\" 'done' is not one of"),
        (answer({"results": {}}), '"results" is not a list'),
        (answer({"results": ["x"]}), "results[0]: not an object"),
        (answer({"results": [{"result": ""}]}), 'results[0]: "task_id" None is not a task'),
        (answer({"results": [{"task_id": "01J0000000000000000000000X"}]}), "not a task of"),
        (
            answer({"results": [{"task_id": IDS[0]}, {"task_id": IDS[0]}]}),
            "results[1]: task 01J00000000000000000000001 is answered twice",
        ),
        (answer({"results": [{"task_id": IDS[0], "retry": "no"}]}), '"retry" must be'),
        (answer({"results": [{"task_id": IDS[0], "outcome": "maybe"}]}), "\"outcome\" 'maybe'"),
        (answer({"results": [{"task_id": IDS[0], "result": "!!"}]}), "not valid base64"),
        (answer({"results": [{"task_id": IDS[0], "error": 3}]}), '"error" must be a string'),
        (answer({"results": [{"task_id": IDS[0], "error": "x", "retry_after": -1}]}), ">= 0"),
        (answer("success"), '"result" is not an object'),
        (b"[" * 100_000, "nested too deeply"),
        (b"not json", "not JSON"),
    ],
)
def test_an_invalid_answer_fails_every_member_without_counting(body: bytes, complaint: str) -> None:
    reply = parse_batch_response(200, body, LEASE, IDS)
    assert isinstance(reply, Broken)
    assert not reply.transport
    assert reply.error.startswith("invalid JSON-RPC response from the endpoint: ")
    assert complaint in reply.error


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_entries = st.lists(
    st.fixed_dictionaries(
        {"task_id": st.sampled_from([*IDS, "x"])},
        optional={
            "outcome": st.sampled_from(["success", "failure", "skip_retry", "release", "?"]),
            "result": st.sampled_from(["", "eA==", "!", 1]),
            "error": st.sampled_from(["e", None, 2]),
            "retry": st.sampled_from([True, False, "no"]),
            "retry_after": st.sampled_from([0, 1.5, -1, "1", math.inf]),
        },
    ),
    max_size=4,
)


@given(
    result=st.fixed_dictionaries(
        {},
        optional={
            "outcome": st.sampled_from(["success", "failure", "accepted", "odd", None]),
            "results": _entries | _json,
            "error": _json,
        },
    )
    | _json
)
def test_any_answer_is_an_outcome_for_every_member_or_one_failure(result: object) -> None:
    reply = parsed(result)
    if isinstance(reply, BatchFinished):
        assert list(reply.outcomes) == list(IDS)
        assert all(isinstance(f, Finished) for f in reply.outcomes.values())
    else:
        assert isinstance(reply, Broken)
        assert reply.error
        assert not reply.transport
    results = batch_results(reply, group().tasks, LEASE)
    assert [(r.task_id, r.lease_id) for r in results] == [(task_id, LEASE) for task_id in IDS]
    assert all(r.outcome != service_pb2.OUTCOME_UNSPECIFIED for r in results)


def test_batch_results_are_one_result_per_member_under_the_batch_lease() -> None:
    batch = group()
    reply = parsed(
        {
            "results": [
                {"task_id": IDS[0], "result": b64(b"r0")},
                {"task_id": IDS[1], "error": "later", "retry_after": 30},
            ],
            "outcome": "skip_retry",
            "error": "the rest is junk",
        }
    )
    results = batch_results(reply, batch.tasks, LEASE)
    assert [(r.task_id, r.lease_id, r.outcome) for r in results] == [
        (IDS[0], LEASE, OK),
        (IDS[1], LEASE, FAILURE),
        (IDS[2], LEASE, SKIP),
    ]
    assert results[0].result == b"r0"
    assert results[1].error == "later"
    assert results[1].retry_after.ToTimedelta() == timedelta(seconds=30)
    assert results[2].error == "the rest is junk"
    broken = batch_results(Broken("could not reach", transport=True), batch.tasks, LEASE)
    assert [(r.task_id, r.lease_id, r.outcome, r.error) for r in broken] == [
        (task_id, LEASE, FAILURE, "could not reach") for task_id in IDS
    ]
    assert not any(r.HasField("retry_after") for r in broken)


def test_a_batch_counts_as_one_delivery_labelled_by_its_outcomes() -> None:
    assert batch_outcome(parsed({"outcome": "success"})) == "success"
    assert batch_outcome(parsed({"outcome": "failure"})) == "failure"
    mixed = parsed({"outcome": "success", "results": [{"task_id": IDS[0], "error": "x"}]})
    assert batch_outcome(mixed) == "mixed"
    assert batch_outcome(Broken("down", transport=True)) == "transport"
    assert batch_outcome(Broken(ASYNC_BATCH_ERROR)) == "error"


# ------------------------------------------------- the transport, over HTTP


@dataclass
class StandIn:
    """What a WebhookGateway calls on its Gateway, recorded; holds every lease."""

    id: str = "wh-batchy-test"
    closed: bool = False
    batches: list[list[service_pb2.Result]] = field(default_factory=list)
    results: list[service_pb2.Result] = field(default_factory=list)
    caps: list[int] = field(default_factory=list)
    answered: asyncio.Event = field(default_factory=asyncio.Event)

    def on_batch_result(self, results: Sequence[service_pb2.Result]) -> None:
        self.batches.append(list(results))
        self.answered.set()

    def on_results(self, results: Sequence[service_pb2.Result]) -> None:
        self.results.extend(results)
        self.answered.set()

    def on_heartbeat(self) -> None:
        pass

    def holds_lease(self, lease_id: str) -> bool:
        return True

    def cap_concurrency(self, cap: int | None, *, kept: Collection[str] = ()) -> None:
        self.caps.append(-1 if cap is None else cap)

    def forget(self, lease_id: str) -> bool:
        return False

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


@dataclass
class StandInWiring:
    """A :class:`Wiring` whose gateways are :class:`StandIn`s."""

    config: WebhookConfig
    broker: MemoryBroker
    made: list[StandIn] = field(default_factory=list)

    def gateway(self, worker: WebhookWorker, transport: object, **_: object) -> StandIn:
        self.made.append(StandIn())
        return self.made[-1]


@pytest.fixture
async def endpoint() -> AsyncIterator[Endpoint]:
    async with Endpoint() as ep:
        yield ep


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


MakeGateway = Callable[..., Awaitable[tuple[WebhookGateway, StandIn]]]


@pytest.fixture
async def make_gateway(endpoint: Endpoint, clock: FakeClock) -> AsyncIterator[MakeGateway]:
    """Starts a WebhookGateway of registration ``name`` (default ``batchy``, batch type
    ``digest.send``, breaker threshold 1) for the endpoint, over a :class:`StandIn`."""
    made: list[WebhookGateway] = []

    async def make(**worker: Any) -> tuple[WebhookGateway, StandIn]:
        config = WebhookConfig(
            gateway=GatewayConfig(
                lease_ttl=timedelta(seconds=300),
                register_tick=5.0,
                max_result=1024,
                clock=clock,
            ),
            policy=AddressPolicy.from_networks([LOCAL_ENDPOINTS]),
            breaker_threshold=1,
            breaker_cooldown=60.0,
        )
        now = clock.now()
        registration = WebhookWorker(
            name=worker.pop("name", "batchy"),
            url=endpoint.url,
            queues={"digests": 1},
            concurrency=4,
            timeout=worker.pop("timeout", timedelta(seconds=10)),
            paused=False,
            secrets=(SECRET,),
            created_at=now,
            updated_at=now,
            batch_types=("digest.send",),
        )
        wiring = StandInWiring(config, MemoryBroker(clock))
        gateway = WebhookGateway(registration, cast(Wiring, wiring))
        await gateway.start()
        made.append(gateway)
        return gateway, wiring.made[-1]

    yield make
    for gateway in made:
        await gateway.drain()


def _count(outcome: str, worker: str = "batchy") -> float:
    labels = {"worker": worker, "outcome": outcome}
    return REGISTRY.get_sample_value("conveyor_webhook_deliveries_total", labels) or 0.0


def batch_rpc(result: dict[str, object]) -> Any:
    async def reply(delivery: Delivery) -> web.StreamResponse:
        return web.json_response({"jsonrpc": "2.0", "id": delivery.lease_id, "result": result})

    return reply


async def test_a_batch_is_one_signed_post_and_each_member_gets_its_result(
    endpoint: Endpoint, make_gateway: MakeGateway
) -> None:
    endpoint.answer = batch_rpc(
        {
            "outcome": "success",
            "results": [{"task_id": IDS[1], "error": "bounced", "retry": False}],
        }
    )
    before = _count("mixed")
    gateway, stand_in = await make_gateway()
    try:
        gateway.dispatch_batch(group())
        await wait_until(stand_in.answered.is_set)
    finally:
        await gateway.drain()
    [delivery] = endpoint.deliveries
    assert delivery.call["method"] == "conveyor.batch"
    assert delivery.lease_id == LEASE
    assert [t["task_id"] for t in delivery.call["params"]["tasks"]] == list(IDS)
    headers = {k.lower(): v for k, v in delivery.headers.items()}
    assert headers["webhook-id"] == LEASE
    assert verify_standard(headers, delivery.body, [SECRET], now=time.time())
    assert DELIVERY_HEADER.lower() not in headers
    [results] = stand_in.batches
    assert [(r.task_id, r.lease_id, r.outcome) for r in results] == [
        (IDS[0], LEASE, OK),
        (IDS[1], LEASE, SKIP),
        (IDS[2], LEASE, OK),
    ]
    assert stand_in.results == []
    assert _count("mixed") == before + 1
    assert gateway.open_deliveries == 0


async def test_a_failed_batch_fails_every_member_and_counts_for_the_breaker(
    endpoint: Endpoint, make_gateway: MakeGateway
) -> None:
    endpoint.answer = status(503)
    before = _count("transport", "batchy-down")
    gateway, stand_in = await make_gateway(name="batchy-down")
    try:
        gateway.dispatch_batch(group())
        await wait_until(stand_in.answered.is_set)
        # Threshold 1: the one failed call opened the breaker (no capacity announced).
        assert stand_in.caps[-1] == 0
    finally:
        await gateway.drain()
    [results] = stand_in.batches
    assert [(r.task_id, r.outcome, r.error) for r in results] == [
        (task_id, FAILURE, "endpoint answered HTTP 503") for task_id in IDS
    ]
    assert _count("transport", "batchy-down") == before + 1


async def test_a_json_rpc_error_or_accepted_fails_every_member_alike(
    endpoint: Endpoint, make_gateway: MakeGateway
) -> None:
    gateway, stand_in = await make_gateway(name="batchy-err")
    try:
        endpoint.answer = rpc_error("queue full")
        gateway.dispatch_batch(group())
        await wait_until(stand_in.answered.is_set)
        stand_in.answered.clear()
        endpoint.answer = batch_rpc({"outcome": "accepted"})
        gateway.dispatch_batch(group(lease="01J0000000000000000000000M"))
        await wait_until(stand_in.answered.is_set)
        # Neither is a transport failure: the breaker stays closed.
        assert 0 not in stand_in.caps
        assert gateway.parked == 0
    finally:
        await gateway.drain()
    errors = [[(r.outcome, r.error) for r in batch] for batch in stand_in.batches]
    assert errors == [[(FAILURE, "queue full")] * 3, [(FAILURE, ASYNC_BATCH_ERROR)] * 3]


async def test_a_batch_that_outlives_the_timeout_fails_every_member(
    endpoint: Endpoint, make_gateway: MakeGateway
) -> None:
    endpoint.hold(batch_rpc({"outcome": "success"}))
    gateway, stand_in = await make_gateway(name="batchy-slow", timeout=timedelta(seconds=0.2))
    try:
        gateway.dispatch_batch(group())
        await wait_until(stand_in.answered.is_set)
    finally:
        await gateway.drain()
    [results] = stand_in.batches
    assert {(r.outcome, r.error) for r in results} == {
        (FAILURE, "endpoint did not answer within 0.2 s")
    }


async def test_a_cancel_of_the_batch_lease_aborts_its_request(
    endpoint: Endpoint, make_gateway: MakeGateway
) -> None:
    endpoint.hold(batch_rpc({"outcome": "success"}))
    before = _count("canceled", "batchy-cancel")
    gateway, stand_in = await make_gateway(name="batchy-cancel")
    try:
        gateway.dispatch_batch(group())
        await wait_until(lambda: len(endpoint.deliveries) == 1)
        assert gateway.open_deliveries == 1
        gateway.cancel(IDS[1], LEASE, "lease lost")
        await wait_until(lambda: gateway.open_deliveries == 0)
    finally:
        await gateway.drain()
    assert stand_in.batches == []
    assert _count("canceled", "batchy-cancel") == before + 1
