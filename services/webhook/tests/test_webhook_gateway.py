"""A webhook gateway end to end: a real dispatcher leases tasks to it over a private
nats-server, it POSTs them to a real aiohttp endpoint, and the endpoint's answers (or
its callbacks, sent here over NATS as the api would) finish them in the broker.

The broker runs on a FakeClock: leases never lapse by themselves, and retry delays are
exact. Tests marked with ``memory_only`` skip the Postgres run where it adds nothing.
The fixtures (``rig`` and the parts it bundles) are in :mod:`conveyor_testkit.fixtures`.
"""

from __future__ import annotations

import base64
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta

import pytest
from aiohttp import web
from conveyor_broker import Broker, FakeClock, GroupConfig, NewTask, Task, TaskState
from conveyor_broker.ids import new_id
from conveyor_gateway import AckBatcher, GatewayConfig, WakePublisher
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.nats_connect import close_nats, connect_nats
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.webhook_auth import verify_delivery, verify_lease_token
from conveyor_runtime.webhook_urls import AddressPolicy
from conveyor_testkit.cluster_keys import cluster_auth
from conveyor_testkit.fixtures import (  # noqa: F401  (pytest fixtures)
    dispatcher_fixture,
    endpoint_fixture,
    managers_fixture,
    rig_fixture,
)
from conveyor_testkit.polling import wait_until
from conveyor_testkit.webhooks import (
    LOCAL_ENDPOINTS,
    SECRET,
    Delivery,
    Endpoint,
    Rig,
    register,
    rpc,
    rpc_error,
    status,
)
from conveyor_webhook import WebhookConfig, WebhookGateway, Wiring
from nats.errors import ConnectionClosedError
from prometheus_client import REGISTRY

QUEUE = "hooks"
NAME = "billing"
NEWEST = SECRET
memory_only = pytest.mark.parametrize("broker_dsn", ["memory"], indirect=True)
Reply = cluster_pb2.WebhookCallbackReply


# ------------------------------------------------------------- sync outcomes


async def test_a_task_is_posted_signed_and_acked_on_success(rig: Rig) -> None:
    rig.endpoint.answer = rpc("success", result=b'{"charged": true}')
    gateway = await rig.start_gateway()
    task_id = await rig.submit(headers={"trace": "t1"})

    await rig.wait_state(task_id, TaskState.COMPLETED)
    task = await rig.broker.get_task(task_id)
    assert task.result == b'{"charged": true}'
    (delivery,) = rig.endpoint.deliveries
    # Signed with the newest secret over the exact body, recently.
    signature = delivery.headers["Conveyor-Signature"]
    assert verify_delivery(signature, delivery.body, [NEWEST], now=time.time())
    assert delivery.headers["Conveyor-Delivery"] == task_id
    assert delivery.headers["Content-Type"] == "application/json"
    assert delivery.headers["User-Agent"].startswith("conveyor-webhook/")
    call = delivery.call
    assert (call["jsonrpc"], call["method"]) == ("2.0", "conveyor.task")
    params = call["params"]
    assert params["task_id"] == task_id
    assert params["queue"] == QUEUE
    assert params["type"] == "invoice.charge"
    assert base64.b64decode(params["payload"]) == b'{"amount": 42}'
    assert params["headers"] == {"trace": "t1"}
    assert (params["attempt"], params["deadline"]) == (1, None)
    assert params["lease_expires_at"].endswith("Z")
    assert params["callback"] == "api.test:50051"
    claims = verify_lease_token(params["lease_token"], [NEWEST])
    assert (claims.worker, claims.task_id, claims.lease_id) == (NAME, task_id, call["id"])
    await wait_until(lambda: gateway.gateway.in_flight == 0)


async def test_failure_retries_after_the_endpoints_retry_after(rig: Rig) -> None:
    rig.endpoint.answer = rpc("failure", error="card declined", retry_after=120)
    await rig.start_gateway()
    task_id = await rig.submit()

    await rig.wait_state(task_id, TaskState.RETRY)
    task = await rig.broker.get_task(task_id)
    assert task.last_error == "card declined"
    assert task.retried == 1
    assert task.available_at == rig.clock.now() + timedelta(seconds=120)


@memory_only
async def test_skip_retry_archives(rig: Rig) -> None:
    rig.endpoint.answer = rpc("skip_retry", error="no such customer")
    await rig.start_gateway()
    task_id = await rig.submit(max_retry=5)

    await rig.wait_state(task_id, TaskState.ARCHIVED)
    task = await rig.broker.get_task(task_id)
    assert (task.last_error, task.retried) == ("no such customer", 0)


@memory_only
async def test_release_gives_the_task_back_untouched(rig: Rig) -> None:
    answers = [rpc("release"), rpc("success")]

    async def answer(delivery: Delivery) -> web.StreamResponse:
        return await answers.pop(0)(delivery)

    rig.endpoint.answer = answer
    await rig.start_gateway()
    task_id = await rig.submit()

    await rig.wait_state(task_id, TaskState.COMPLETED)
    deliveries = rig.endpoint.deliveries
    assert [d.task_id for d in deliveries] == [task_id, task_id]
    assert deliveries[0].lease_id != deliveries[1].lease_id
    assert (await rig.broker.get_task(task_id)).retried == 0


async def failed_attempt(rig: Rig, task_id: str) -> Task:
    """The task once its attempt failed (back in RETRY)."""
    await rig.wait_state(task_id, TaskState.RETRY)
    return await rig.broker.get_task(task_id)


@memory_only
async def test_a_json_rpc_error_fails_with_its_message_and_backoff(rig: Rig) -> None:
    rig.endpoint.answer = rpc_error("handler exploded")
    gateway = await rig.start_gateway()

    task = await failed_attempt(rig, await rig.submit())
    assert task.last_error == "handler exploded"
    assert task.available_at > rig.clock.now()  # the server's backoff
    assert gateway.breaker.failures == 0  # the endpoint answered


@memory_only
async def test_a_result_over_max_result_fails(rig: Rig) -> None:
    rig.endpoint.answer = rpc("success", result=b"x" * 100)
    await rig.start_gateway(manager_options={"max_result": 10})

    task = await failed_attempt(rig, await rig.submit())
    assert task.last_error == "result is 100 bytes; the limit is 10"
    assert task.result is None


@memory_only
async def test_the_registrations_timeout_fails_the_attempt(rig: Rig) -> None:
    rig.endpoint.hold(rpc("success"))  # never answers in time
    gateway = await rig.start_gateway(timeout=timedelta(seconds=0.3))

    task = await failed_attempt(rig, await rig.submit())
    assert task.last_error == "endpoint did not answer within 0.3 s"
    assert gateway.breaker.failures == 1  # a transport failure
    assert gateway.open_deliveries == 0


def unused_url() -> str:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}/hook"


@memory_only
async def test_an_unreachable_endpoint_fails_the_attempt(rig: Rig) -> None:
    rig.endpoint.url = unused_url()  # nothing listens there
    gateway = await rig.start_gateway()

    error = (await failed_attempt(rig, await rig.submit())).last_error or ""
    assert error.startswith("could not reach the endpoint"), error
    assert gateway.breaker.failures == 1


# ------------------------------------------------------- aggregation groups

# These rest on the server core of aggregation-group delivery (issue 14): the dispatcher
# leasing a due group whole, the Gateway holding it as one batch (Gateway.on_batch_result).


async def hand_due_groups(rig: Rig) -> None:
    """The sweeper's part (maintenance's group pass): hand every due group of the rig's
    queue to its dispatcher (nothing when none is due)."""
    due = await rig.broker.due_groups()
    hints = [
        cluster_pb2.DueGroupHint(group=g.group, size=g.size, max_size=g.max_size)
        for g in due
        if g.queue == rig.queue
    ]
    if hints:
        await rig.bus.publish(cluster_pb2.GroupsDue(queue=rig.queue, groups=hints))
        await rig.bus.nc.flush()


async def sweep_until(rig: Rig, done: Callable[[], Awaitable[bool]]) -> None:
    """Hand the due groups over again at every poll (the sweeper's tick: a hint the
    dispatcher could not act on yet is sent again) until ``done()``."""

    async def swept() -> bool:
        await hand_due_groups(rig)
        return await done()

    await wait_until(swept, interval=0.05)


def members_in(rig: Rig, ids: list[str], state: TaskState) -> Callable[[], Awaitable[bool]]:
    async def reached() -> bool:
        return all([await rig.state_of(task_id) == state for task_id in ids])

    return reached


async def test_a_due_group_is_one_call_and_every_member_completes(rig: Rig) -> None:
    async def answer(delivery: Delivery) -> web.StreamResponse:
        if delivery.call["method"] == "conveyor.task":
            return await rpc("success")(delivery)
        tasks = delivery.call["params"]["tasks"]
        # Each member's payload back as its result; the last one refused for good.
        results: list[dict[str, object]] = [
            {"task_id": t["task_id"], "result": t["payload"]}
            for t in tasks
            if t["task_id"] != ids[-1]
        ]
        results.append({"task_id": ids[-1], "error": "bounced", "retry": False})
        reply = {"outcome": "success", "results": results}
        return web.json_response({"jsonrpc": "2.0", "id": delivery.lease_id, "result": reply})

    ids: list[str] = []
    rig.endpoint.answer = answer
    await rig.broker.set_group_config(GroupConfig(rig.queue, max_size=3))
    gateway = await rig.start_gateway(batch_types=("digest.send",))
    for n in range(3):
        payload = f'{{"n": {n}}}'.encode()
        ids.append(await rig.submit(type="digest.send", group="user-42", payload=payload))
    # A task of a type the endpoint takes one at a time goes on as a single call.
    single = await rig.submit(type="invoice.charge")
    await rig.wait_state(single, TaskState.COMPLETED)

    await sweep_until(rig, members_in(rig, ids[:-1], TaskState.COMPLETED))
    await rig.wait_state(ids[-1], TaskState.ARCHIVED)
    batches = [d for d in rig.endpoint.deliveries if d.call["method"] == "conveyor.batch"]
    [call] = batches
    params = call.call["params"]
    assert (params["queue"], params["group"], params["type"]) == (
        rig.queue,
        "user-42",
        "digest.send",
    )
    assert sorted(t["task_id"] for t in params["tasks"]) == sorted(ids)
    assert call.headers["webhook-id"] == call.lease_id
    for n, task_id in enumerate(ids[:-1]):
        assert (await rig.broker.get_task(task_id)).result == f'{{"n": {n}}}'.encode()
    assert (await rig.broker.get_task(ids[-1])).last_error == "bounced"
    await wait_until(lambda: gateway.gateway.in_flight == 0)


@memory_only
async def test_a_failed_group_call_fails_every_member(rig: Rig) -> None:
    rig.endpoint.answer = status(503)
    await rig.broker.set_group_config(GroupConfig(rig.queue, max_size=2))
    gateway = await rig.start_gateway(batch_types=("digest.send",))
    ids = [await rig.submit(type="digest.send", group="g") for _ in range(2)]

    async def failed() -> bool:
        return all([(await rig.broker.get_task(task_id)).retried == 1 for task_id in ids])

    await sweep_until(rig, failed)
    for task_id in ids:
        task = await rig.broker.get_task(task_id)
        # A failed member waits in its group again (delivered with it after its backoff).
        assert task.state == TaskState.AGGREGATING
        assert task.last_error == "endpoint answered HTTP 503"
        assert task.available_at > rig.clock.now()  # the server's backoff
    [call] = rig.endpoint.deliveries
    assert call.call["method"] == "conveyor.batch"
    # One call, one failure for the breaker.
    assert gateway.breaker.failures == 1


# --------------------------------------------------- async mode and callbacks


def outcome(
    kind: service_pb2.Outcome, *, result: bytes = b"", error: str = "", retry_after: float = -1
) -> cluster_pb2.WebhookOutcome:
    return cluster_pb2.WebhookOutcome(
        outcome=kind, result=result, error=error, retry_after=retry_after
    )


SUCCESS = outcome(service_pb2.OUTCOME_SUCCESS)


async def test_accepted_holds_the_slot_until_a_result_callback_completes_it(rig: Rig) -> None:
    gateway, delivery = await rig.accepted_delivery()
    assert await rig.state_of(delivery.task_id) == TaskState.ACTIVE
    assert gateway.gateway.in_flight == 1  # the slot stays held
    assert gateway.open_deliveries == 0  # no HTTP request is open

    reply = await rig.callback(
        delivery, outcome=outcome(service_pb2.OUTCOME_SUCCESS, result=b"late")
    )
    assert reply.status == Reply.STATUS_OK, reply.message
    task = await rig.broker.get_task(delivery.task_id)
    assert (task.state, task.result) == (TaskState.COMPLETED, b"late")
    assert gateway.gateway.in_flight == 0
    assert gateway.parked == 0


@memory_only
async def test_a_failure_callback_retries_after_its_retry_after(rig: Rig) -> None:
    _, delivery = await rig.accepted_delivery()
    reply = await rig.callback(
        delivery, outcome=outcome(service_pb2.OUTCOME_FAILURE, error="later", retry_after=30)
    )
    assert reply.status == Reply.STATUS_OK
    task = await rig.broker.get_task(delivery.task_id)
    assert (task.state, task.last_error) == (TaskState.RETRY, "later")
    assert task.available_at == rig.clock.now() + timedelta(seconds=30)


async def test_a_heartbeat_callback_extends_the_lease_and_stores_progress(rig: Rig) -> None:
    _, delivery = await rig.accepted_delivery()
    rig.clock.advance(timedelta(seconds=20))

    reply = await rig.callback(delivery, beat=b'{"step": 2}')
    assert reply.status == Reply.STATUS_OK, reply.message
    expected = rig.clock.now() + timedelta(seconds=30)  # the default lease_ttl
    assert reply.lease_expires_at == expected.timestamp()
    task = await rig.broker.get_task(delivery.task_id)
    assert task.lease_expires_at == expected
    assert task.progress == b'{"step": 2}'


@memory_only
async def test_callbacks_for_an_unknown_lease_get_lease_lost(rig: Rig) -> None:
    gateway, delivery = await rig.accepted_delivery()
    stranger = new_id(rig.clock.now())
    beat = await rig.callback(delivery, lease_id=stranger)
    assert beat.status == Reply.STATUS_LEASE_LOST
    result = await rig.callback(delivery, lease_id=stranger, outcome=SUCCESS)
    assert result.status == Reply.STATUS_LEASE_LOST
    unknown_task = await rig.callback(delivery, task_id=new_id(rig.clock.now()), lease_id=stranger)
    assert unknown_task.status == Reply.STATUS_LEASE_LOST
    # The real delivery is untouched.
    assert await rig.state_of(delivery.task_id) == TaskState.ACTIVE
    assert gateway.gateway.in_flight == 1

    # Once finished, its own lease is lost too.
    done = await rig.callback(delivery, outcome=SUCCESS)
    assert done.status == Reply.STATUS_OK
    again = await rig.callback(delivery, outcome=outcome(service_pb2.OUTCOME_FAILURE))
    assert again.status == Reply.STATUS_LEASE_LOST
    late_beat = await rig.callback(delivery)
    assert late_beat.status == Reply.STATUS_LEASE_LOST


@memory_only
async def test_a_callback_that_is_not_final_is_invalid(rig: Rig) -> None:
    _, delivery = await rig.accepted_delivery()
    reply = await rig.callback(delivery, outcome=outcome(service_pb2.OUTCOME_UNSPECIFIED))
    assert reply.status == Reply.STATUS_INVALID
    assert await rig.state_of(delivery.task_id) == TaskState.ACTIVE


async def lease_elsewhere(rig: Rig, queue: str = QUEUE, type_: str = "invoice.charge") -> Task:
    """A task on ``queue`` leased past every gateway (as by an earlier incarnation gone
    without releasing it); the leased task."""
    task_id = (await rig.broker.enqueue(NewTask(queue=queue, type=type_))).task.id
    (leased,) = await rig.broker.lease(queue, 1, timedelta(seconds=30))
    assert (leased.id, leased.state) == (task_id, TaskState.ACTIVE)
    assert leased.lease_id is not None
    return leased


def delivery_of(leased: Task) -> Delivery:
    """What a delivery of ``leased`` would have carried (for :meth:`Rig.callback`)."""
    return Delivery({}, b"", {"id": leased.lease_id, "params": {"task_id": leased.id}})


@memory_only
async def test_a_heartbeat_for_a_lease_the_gateway_does_not_hold_adopts_it(rig: Rig) -> None:
    # A delivery made by an earlier incarnation (gone without releasing it).
    gateway = await rig.start_gateway()
    orphan = delivery_of(await lease_elsewhere(rig))
    assert gateway.gateway.in_flight == 0

    rig.clock.advance(timedelta(seconds=5))
    beat = await rig.callback(orphan, beat=b"")
    assert beat.status == Reply.STATUS_OK
    assert beat.lease_expires_at == (rig.clock.now() + timedelta(seconds=30)).timestamp()
    # It counts against the concurrency again, as a parked delivery.
    assert (gateway.gateway.in_flight, gateway.parked) == (1, 1)
    assert gateway.gateway.free(QUEUE) == 3

    reply = await rig.callback(orphan, outcome=outcome(service_pb2.OUTCOME_SKIP_RETRY))
    assert reply.status == Reply.STATUS_OK
    task = await rig.broker.get_task(orphan.task_id)
    assert task.state == TaskState.ARCHIVED
    assert task.last_error == "handler asked to skip retries"
    assert (gateway.gateway.in_flight, gateway.parked) == (0, 0)


@memory_only
async def test_a_result_for_a_lease_the_gateway_does_not_hold_is_still_applied(rig: Rig) -> None:
    gateway = await rig.start_gateway()
    orphan = delivery_of(await lease_elsewhere(rig))

    reply = await rig.callback(orphan, outcome=SUCCESS)
    assert reply.status == Reply.STATUS_OK
    assert await rig.state_of(orphan.task_id) == TaskState.COMPLETED
    assert gateway.gateway.in_flight == 0


@memory_only
async def test_callbacks_for_a_task_of_a_queue_the_worker_does_not_serve_are_invalid(
    rig: Rig,
) -> None:
    gateway = await rig.start_gateway()
    leased = await lease_elsewhere(rig, "elsewhere", "x")
    foreign = delivery_of(leased)
    rig.clock.advance(timedelta(seconds=5))

    beat = await rig.callback(foreign, queue="elsewhere", beat=b"progress")
    result = await rig.callback(foreign, queue="elsewhere", outcome=SUCCESS)
    for reply in (beat, result):
        assert reply.status == Reply.STATUS_INVALID
        assert "'elsewhere'" in reply.message
    task = await rig.broker.get_task(leased.id)
    assert (task.state, task.lease_id, task.progress) == (TaskState.ACTIVE, leased.lease_id, None)
    assert task.lease_expires_at == leased.lease_expires_at
    assert gateway.gateway.in_flight == 0


@memory_only
async def test_a_result_over_this_services_max_result_is_invalid_and_changes_nothing(
    rig: Rig,
) -> None:
    gateway, delivery = await rig.accepted_delivery(manager_options={"max_result": 10})

    big = outcome(service_pb2.OUTCOME_SUCCESS, result=b"x" * 11)
    reply = await rig.callback(delivery, outcome=big)
    assert reply.status == Reply.STATUS_INVALID
    assert reply.message == "result is 11 bytes; the limit is 10"
    assert await rig.state_of(delivery.task_id) == TaskState.ACTIVE
    assert (gateway.gateway.in_flight, gateway.parked) == (1, 1)
    # The endpoint reports a failure instead.
    failed = await rig.callback(
        delivery, outcome=outcome(service_pb2.OUTCOME_FAILURE, error="too big")
    )
    assert failed.status == Reply.STATUS_OK
    assert await rig.state_of(delivery.task_id) == TaskState.RETRY


@memory_only
async def test_accepted_without_a_callback_address_fails_the_attempt(rig: Rig) -> None:
    rig.endpoint.answer = rpc("accepted")
    gateway = await rig.start_gateway(manager_options={"callback_address": ""})

    task = await failed_attempt(rig, await rig.submit())
    assert task.last_error == "endpoint answered accepted but no callback address is configured"
    assert (gateway.gateway.in_flight, gateway.parked) == (0, 0)
    assert gateway.breaker.failures == 0  # the endpoint answered


@memory_only
async def test_the_bulk_heartbeat_extends_open_deliveries_but_not_parked_ones(rig: Rig) -> None:
    gateway, parked = await rig.accepted_delivery()
    rig.endpoint.hold(rpc("success"))
    open_id = await rig.submit()
    await wait_until(lambda: gateway.open_deliveries == 1)
    parked_before = (await rig.broker.get_task(parked.task_id)).lease_expires_at
    rig.clock.advance(timedelta(seconds=10))

    gateway.gateway.on_heartbeat()

    await rig.wait_lease(open_id, rig.clock.now() + timedelta(seconds=30))
    assert (await rig.broker.get_task(parked.task_id)).lease_expires_at == parked_before
    rig.endpoint.release.set()
    await rig.wait_state(open_id, TaskState.COMPLETED)


@memory_only
async def test_a_parked_delivery_whose_lease_lapsed_frees_its_slot_and_fails_the_attempt(
    rig: Rig,
) -> None:
    gateway, delivery = await rig.accepted_delivery()
    assert await gateway.sweep_lapsed() == 0  # still leased
    assert gateway.gateway.in_flight == 1
    rig.clock.advance(timedelta(seconds=31))

    assert await gateway.sweep_lapsed() == 1
    assert gateway.gateway.in_flight == 0
    assert gateway.parked == 0
    # The lease is ended in the broker (no reaper runs here), with the usual backoff...
    task = await rig.broker.get_task(delivery.task_id)
    assert (task.state, task.retried) == (TaskState.RETRY, 1)
    assert task.last_error == "webhook delivery stopped heartbeating"
    assert task.available_at > rig.clock.now()
    # ...so a late callback cannot revive an attempt nobody counts any more.
    late_beat = await rig.callback(delivery)
    assert late_beat.status == Reply.STATUS_LEASE_LOST
    late = await rig.callback(delivery, outcome=SUCCESS)
    assert late.status == Reply.STATUS_LEASE_LOST
    assert (await rig.broker.get_task(delivery.task_id)).state == TaskState.RETRY


@memory_only
async def test_a_lapsed_parked_delivery_someone_else_extended_is_kept(rig: Rig) -> None:
    gateway, delivery = await rig.accepted_delivery()
    rig.clock.advance(timedelta(seconds=29))
    # Extended behind this gateway's back (another instance's responder, mid hand-over).
    await rig.broker.extend_lease(delivery.task_id, delivery.lease_id, timedelta(seconds=30))
    rig.clock.advance(timedelta(seconds=2))

    assert await gateway.sweep_lapsed() == 0
    assert gateway.parked == 1
    assert gateway.parked_until(delivery.lease_id) == rig.clock.now() + timedelta(seconds=28)
    assert await rig.state_of(delivery.task_id) == TaskState.ACTIVE


@memory_only
async def test_open_deliveries_are_heartbeaten_every_third_of_the_lease_ttl(rig: Rig) -> None:
    rig.endpoint.hold(rpc("success"))
    gateway = await rig.start_gateway(manager_options={"lease_ttl": 0.3})
    task_id = await rig.submit()
    await wait_until(lambda: gateway.open_deliveries == 1)
    rig.clock.advance(timedelta(seconds=60))  # the broker's time; the heartbeat runs on its own

    await rig.wait_lease(task_id, rig.clock.now() + timedelta(seconds=0.3))
    rig.endpoint.release.set()
    await rig.wait_state(task_id, TaskState.COMPLETED)


# ------------------------------------------------------------ cancellation


@memory_only
async def test_an_operator_cancel_aborts_the_open_request(rig: Rig) -> None:
    rig.endpoint.hold(rpc("success"))
    gateway = await rig.start_gateway()
    task_id = await rig.submit()
    await wait_until(lambda: gateway.open_deliveries == 1)

    task = await rig.broker.cancel_task(task_id)  # what AdminService does, then it broadcasts
    assert task.state == TaskState.ARCHIVED
    await rig.bus.publish(cluster_pb2.CancelBroadcast(task_id=task_id, reason="canceled"))

    await wait_until(lambda: gateway.open_deliveries == 0)
    assert gateway.gateway.in_flight == 0
    assert len(rig.endpoint.deliveries) == 1


# ---------------------------------------------------------- circuit breaker


@memory_only
async def test_the_breaker_announces_zero_capacity_then_probes_then_closes(rig: Rig) -> None:
    announced: list[cluster_pb2.Register] = []
    await rig.bus.subscribe(cluster_pb2.Register, announced.append, queue=QUEUE)
    rig.endpoint.answer = status(503)
    gateway = await rig.start_gateway(
        manager_options={"breaker_threshold": 2, "breaker_cooldown": 1.0}, concurrency=4
    )
    failing = [await rig.submit() for _ in range(4)]

    def announced_capacity(capacity: int) -> bool:
        return any(r.gateway == gateway.id and r.capacity == capacity for r in announced)

    # Transport failures open it: capacity 0 on the queue, announced at once.
    await wait_until(lambda: announced_capacity(0))
    assert gateway.gateway.concurrency == 0
    assert gateway.gateway.free(QUEUE) == 0
    for task_id in failing:
        await rig.wait_state(task_id, TaskState.RETRY)  # backoff: not due again
    assert {d.task_id for d in rig.endpoint.deliveries} == set(failing)

    # After the cooldown: a single probe slot, whatever the registration's concurrency.
    rig.endpoint.hold(rpc("success"))
    later = [await rig.submit() for _ in range(2)]
    await wait_until(lambda: announced_capacity(1) and gateway.open_deliveries == 1)
    assert gateway.gateway.concurrency == 1
    states = sorted([await rig.state_of(t) for t in later], key=lambda s: s.value)
    assert states == sorted([TaskState.ACTIVE, TaskState.PENDING], key=lambda s: s.value)

    # The probe succeeds: closed, full capacity again, the rest flows.
    rig.endpoint.release.set()
    for task_id in later:
        await rig.wait_state(task_id, TaskState.COMPLETED)
    assert gateway.gateway.concurrency == 4
    assert announced_capacity(4)


@memory_only
async def test_parked_deliveries_do_not_block_the_breakers_probe(rig: Rig) -> None:
    rig.endpoint.answer = rpc("accepted")
    gateway = await rig.start_gateway(
        manager_options={"breaker_threshold": 1, "breaker_cooldown": 0.5}, concurrency=4
    )
    await rig.submit()
    await wait_until(lambda: gateway.parked == 1)

    # A transport failure opens the breaker: no synchronous slot, the parked one kept.
    rig.endpoint.answer = status(503)
    failed = await rig.submit()
    await rig.wait_state(failed, TaskState.RETRY)
    assert gateway.gateway.free(QUEUE) == 0
    assert gateway.parked == 1

    # After the cooldown the probe goes out although the parked delivery holds a slot.
    rig.endpoint.answer = rpc("success")
    probe = await rig.submit()
    await rig.wait_state(probe, TaskState.COMPLETED)
    await wait_until(lambda: gateway.gateway.concurrency == 4)  # closed again
    assert gateway.parked == 1


@memory_only
async def test_no_connection_pool_limit_holds_deliveries_back(rig: Rig) -> None:
    # More open deliveries than aiohttp's default pool (100) allows at once.
    many = 110
    rig.endpoint.hold(rpc("success"))
    gateway = await rig.start_gateway(concurrency=many)
    ids = [await rig.submit() for _ in range(many)]

    await wait_until(lambda: len(rig.endpoint.deliveries) == many)
    assert gateway.open_deliveries == many
    rig.endpoint.release.set()
    for task_id in ids:
        await rig.wait_state(task_id, TaskState.COMPLETED)


@memory_only
async def test_a_gateway_that_fails_to_start_closes_what_it_opened(
    broker: Broker, nats_url: str, subjects: Subjects, clock: FakeClock, endpoint: Endpoint
) -> None:
    worker = await register(broker, endpoint.url, NAME)
    gone = await connect_nats(nats_url, name="closed-already")
    await close_nats(gone)
    config = WebhookConfig(
        gateway=GatewayConfig(
            lease_ttl=timedelta(seconds=30), register_tick=5.0, max_result=1024, clock=clock
        ),
        policy=AddressPolicy.from_networks([LOCAL_ENDPOINTS]),
    )
    bus = Bus(gone, subjects, cluster_auth())
    acks, wakes = AckBatcher(broker), WakePublisher(bus)
    gateway = WebhookGateway(worker, Wiring(broker, bus, config, acks, wakes))

    with pytest.raises(ConnectionClosedError):
        await gateway.start()
    assert gateway.http_closed
    assert gateway.gateway.closed
    assert not gateway.serving


# ------------------------------------------------------------------- metrics


def _sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def _count(name: str, **labels: str) -> float:
    return _sample(name, **labels) or 0.0


@memory_only
async def test_deliveries_callbacks_and_the_breaker_are_counted_by_registration(rig: Rig) -> None:
    deliveries = "conveyor_webhook_deliveries_total"
    outcomes = ("success", "error", "transport", "accepted")
    before = {o: _count(deliveries, worker=NAME, outcome=o) for o in outcomes}
    timed = _count("conveyor_webhook_delivery_seconds_count", worker=NAME)
    transitions = "conveyor_webhook_breaker_transitions_total"
    opened = _count(transitions, worker=NAME, event="opened")
    closed = _count(transitions, worker=NAME, event="closed")
    callbacks = _count("conveyor_webhook_callbacks_total", worker=NAME, kind="result", status="ok")
    state = "conveyor_webhook_breaker_state"
    gateway = await rig.start_gateway(
        manager_options={"breaker_threshold": 1, "breaker_cooldown": 0.5}
    )
    assert _sample(state, worker=NAME) == 0

    rig.endpoint.answer = rpc("success")
    await rig.wait_state(await rig.submit(), TaskState.COMPLETED)
    rig.endpoint.answer = rpc_error("declined")
    await rig.wait_state(await rig.submit(), TaskState.RETRY)
    # A transport failure opens the breaker (threshold 1).
    rig.endpoint.answer = status(503)
    await rig.wait_state(await rig.submit(), TaskState.RETRY)
    assert _sample(state, worker=NAME) == 2
    assert _count(transitions, worker=NAME, event="opened") == opened + 1
    # After the cool-down the probe goes; the endpoint's answer (accepted) closes it.
    rig.endpoint.answer = rpc("accepted")
    parked = await rig.submit()
    await wait_until(lambda: gateway.parked == 1)
    assert _sample(state, worker=NAME) == 0
    assert _count(transitions, worker=NAME, event="closed") == closed + 1
    [delivery] = [d for d in rig.endpoint.deliveries if d.task_id == parked]
    assert (await rig.callback(delivery, outcome=SUCCESS)).status == Reply.STATUS_OK

    after = {o: _count(deliveries, worker=NAME, outcome=o) for o in outcomes}
    assert {o: after[o] - before[o] for o in outcomes} == dict.fromkeys(outcomes, 1)
    assert _count("conveyor_webhook_delivery_seconds_count", worker=NAME) == timed + 4
    assert (
        _count("conveyor_webhook_callbacks_total", worker=NAME, kind="result", status="ok")
        == callbacks + 1
    )
    # A drained gateway's breaker is no one's to report.
    await gateway.drain()
    assert _sample(state, worker=NAME) is None
