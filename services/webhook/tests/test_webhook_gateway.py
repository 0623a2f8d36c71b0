"""A webhook gateway end to end: a real dispatcher leases tasks to it over a private
nats-server, it POSTs them to a real aiohttp endpoint, and the endpoint's answers (or
its callbacks, sent here over NATS as the api would) finish them in the broker.

The broker runs on a FakeClock: leases never lapse by themselves, and retry delays are
exact. Tests marked with ``memory_only`` skip the Postgres run where it adds nothing.
"""

from __future__ import annotations

import base64
import socket
import time
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from aiohttp import web
from conveyor_api.coalesce import WakePublisher
from conveyor_api.gateway import GatewayConfig
from conveyor_api.group_commit import AckBatcher
from conveyor_broker import Broker, FakeClock, NewTask, TaskState
from conveyor_broker.ids import new_id
from conveyor_dispatcher import Dispatcher
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime.nats_connect import NatsClient, close_nats, connect_nats
from conveyor_runtime.settings import DispatcherSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.testing import eventually
from conveyor_runtime.webhook_auth import verify_delivery, verify_lease_token
from conveyor_webhook import WebhookConfig, WebhookGateway
from conveyor_webhook.testing import (
    Delivery,
    Endpoint,
    Managers,
    register,
    rpc,
    rpc_error,
    running_gateway,
    send_callback,
    status,
    submit,
)
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError

QUEUE = "hooks"
NAME = "billing"
NEWEST = "newest-secret"
memory_only = pytest.mark.parametrize("broker_dsn", ["memory"], indirect=True)
Reply = cluster_pb2.WebhookCallbackReply


# ----------------------------------------------------------------- fixtures


@pytest.fixture
async def endpoint() -> AsyncIterator[Endpoint]:
    """A real HTTP endpoint on a free local port."""
    async with Endpoint() as ep:
        yield ep


@pytest.fixture
async def dispatcher(
    broker: Broker, nc: NatsClient, clock: FakeClock, subjects: Subjects, nats_url: str
) -> AsyncIterator[Dispatcher]:
    """A real dispatcher, in this process."""
    settings = DispatcherSettings(
        nats_url=nats_url,
        subject_prefix=subjects.prefix,
        broker="memory",
        instance_id=f"disp-{uuid.uuid4().hex[:6]}",
        owner_ttl=2.0,
        register_tick=5.0,
    )
    d = Dispatcher(settings, broker, nc, clock)
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


@pytest.fixture
async def managers(
    broker: Broker, nc: NatsClient, clock: FakeClock, subjects: Subjects, nats_url: str
) -> AsyncIterator[Managers]:
    """Start WebhookManagers (settings overrides as keywords); each is stopped after."""
    async with Managers(broker, nc, clock, nats_url, subjects) as make:
        yield make


async def start_gateway(
    broker: Broker,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
    *,
    manager_options: dict[str, object] | None = None,
    **registration: object,
) -> WebhookGateway:
    await register(broker, endpoint.url, NAME, **registration)
    manager = await managers(**(manager_options or {}))
    return await running_gateway(manager, dispatcher, NAME, QUEUE)


async def state_of(broker: Broker, task_id: str) -> TaskState:
    return (await broker.get_task(task_id)).state


async def wait_state(broker: Broker, task_id: str, state: TaskState) -> None:
    async def reached() -> bool:
        return await state_of(broker, task_id) == state

    await eventually(reached)


async def callback(
    nc: NatsClient,
    subjects: Subjects,
    delivery: Delivery,
    *,
    beat: bytes | None = None,
    outcome: cluster_pb2.WebhookOutcome | None = None,
    lease_id: str | None = None,
    task_id: str | None = None,
    queue: str = QUEUE,
) -> cluster_pb2.WebhookCallbackReply:
    """Send a WebhookCallback the way the api's WebhookService does."""
    return await send_callback(
        nc,
        subjects,
        NAME,
        task_id=task_id or delivery.task_id,
        lease_id=lease_id or delivery.lease_id,
        queue=queue,
        beat=beat,
        outcome=outcome,
    )


# ------------------------------------------------------------- sync outcomes


async def test_a_task_is_posted_signed_and_acked_on_success(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.answer = rpc("success", result=b'{"charged": true}')
    gateway = await start_gateway(broker, endpoint, managers, dispatcher)
    task_id = await submit(broker, nc, subjects, QUEUE, headers={"trace": "t1"})

    await wait_state(broker, task_id, TaskState.COMPLETED)
    task = await broker.get_task(task_id)
    assert task.result == b'{"charged": true}'
    (delivery,) = endpoint.deliveries
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
    await eventually(lambda: gateway.gateway.in_flight == 0)


async def test_failure_retries_after_the_endpoints_retry_after(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.answer = rpc("failure", error="card declined", retry_after=120)
    await start_gateway(broker, endpoint, managers, dispatcher)
    task_id = await submit(broker, nc, subjects, QUEUE)

    await wait_state(broker, task_id, TaskState.RETRY)
    task = await broker.get_task(task_id)
    assert task.last_error == "card declined"
    assert task.retried == 1
    assert task.available_at == clock.now() + timedelta(seconds=120)


@memory_only
async def test_skip_retry_archives(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.answer = rpc("skip_retry", error="no such customer")
    await start_gateway(broker, endpoint, managers, dispatcher)
    task_id = await submit(broker, nc, subjects, QUEUE, max_retry=5)

    await wait_state(broker, task_id, TaskState.ARCHIVED)
    task = await broker.get_task(task_id)
    assert (task.last_error, task.retried) == ("no such customer", 0)


@memory_only
async def test_release_gives_the_task_back_untouched(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    answers = [rpc("release"), rpc("success")]

    async def answer(delivery: Delivery) -> web.StreamResponse:
        return await answers.pop(0)(delivery)

    endpoint.answer = answer
    await start_gateway(broker, endpoint, managers, dispatcher)
    task_id = await submit(broker, nc, subjects, QUEUE)

    await wait_state(broker, task_id, TaskState.COMPLETED)
    assert [d.task_id for d in endpoint.deliveries] == [task_id, task_id]
    assert endpoint.deliveries[0].lease_id != endpoint.deliveries[1].lease_id
    assert (await broker.get_task(task_id)).retried == 0


@memory_only
async def test_a_json_rpc_error_fails_with_its_message_and_backoff(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.answer = rpc_error("handler exploded")
    gateway = await start_gateway(broker, endpoint, managers, dispatcher)
    task_id = await submit(broker, nc, subjects, QUEUE)

    await wait_state(broker, task_id, TaskState.RETRY)
    task = await broker.get_task(task_id)
    assert task.last_error == "handler exploded"
    assert task.available_at > clock.now()  # the server's backoff
    assert gateway.breaker.failures == 0  # the endpoint answered


@memory_only
async def test_a_result_over_max_result_fails(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.answer = rpc("success", result=b"x" * 100)
    await start_gateway(broker, endpoint, managers, dispatcher, manager_options={"max_result": 10})
    task_id = await submit(broker, nc, subjects, QUEUE)

    await wait_state(broker, task_id, TaskState.RETRY)
    task = await broker.get_task(task_id)
    assert task.last_error == "result is 100 bytes; the limit is 10"
    assert task.result is None


@memory_only
async def test_the_registrations_timeout_fails_the_attempt(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.hold(rpc("success"))  # never answers in time
    gateway = await start_gateway(
        broker, endpoint, managers, dispatcher, timeout=timedelta(seconds=0.3)
    )
    task_id = await submit(broker, nc, subjects, QUEUE)

    await wait_state(broker, task_id, TaskState.RETRY)
    task = await broker.get_task(task_id)
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
async def test_an_unreachable_endpoint_fails_the_attempt(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.url = unused_url()  # nothing listens there
    gateway = await start_gateway(broker, endpoint, managers, dispatcher)
    task_id = await submit(broker, nc, subjects, QUEUE)

    await wait_state(broker, task_id, TaskState.RETRY)
    error = (await broker.get_task(task_id)).last_error or ""
    assert error.startswith("could not reach the endpoint"), error
    assert gateway.breaker.failures == 1


# --------------------------------------------------- async mode and callbacks


def outcome(
    kind: service_pb2.Outcome, *, result: bytes = b"", error: str = "", retry_after: float = -1
) -> cluster_pb2.WebhookOutcome:
    return cluster_pb2.WebhookOutcome(
        outcome=kind, result=result, error=error, retry_after=retry_after
    )


async def accepted_delivery(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> tuple[WebhookGateway, Delivery]:
    endpoint.answer = rpc("accepted")
    gateway = await start_gateway(broker, endpoint, managers, dispatcher)
    task_id = await submit(broker, nc, subjects, QUEUE)
    await eventually(lambda: gateway.parked == 1)
    (delivery,) = endpoint.deliveries
    assert delivery.task_id == task_id
    return gateway, delivery


async def test_accepted_holds_the_slot_until_a_result_callback_completes_it(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    gateway, delivery = await accepted_delivery(
        broker, nc, subjects, endpoint, managers, dispatcher
    )
    assert await state_of(broker, delivery.task_id) == TaskState.ACTIVE
    assert gateway.gateway.in_flight == 1  # the slot stays held
    assert gateway.open_deliveries == 0  # no HTTP request is open

    reply = await callback(
        nc, subjects, delivery, outcome=outcome(service_pb2.OUTCOME_SUCCESS, result=b"late")
    )
    assert reply.status == Reply.STATUS_OK, reply.message
    task = await broker.get_task(delivery.task_id)
    assert (task.state, task.result) == (TaskState.COMPLETED, b"late")
    assert gateway.gateway.in_flight == 0
    assert gateway.parked == 0


@memory_only
async def test_a_failure_callback_retries_after_its_retry_after(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    _, delivery = await accepted_delivery(broker, nc, subjects, endpoint, managers, dispatcher)
    reply = await callback(
        nc,
        subjects,
        delivery,
        outcome=outcome(service_pb2.OUTCOME_FAILURE, error="later", retry_after=30),
    )
    assert reply.status == Reply.STATUS_OK
    task = await broker.get_task(delivery.task_id)
    assert (task.state, task.last_error) == (TaskState.RETRY, "later")
    assert task.available_at == clock.now() + timedelta(seconds=30)


async def test_a_heartbeat_callback_extends_the_lease_and_stores_progress(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    _, delivery = await accepted_delivery(broker, nc, subjects, endpoint, managers, dispatcher)
    clock.advance(timedelta(seconds=20))

    reply = await callback(nc, subjects, delivery, beat=b'{"step": 2}')
    assert reply.status == Reply.STATUS_OK, reply.message
    expected = clock.now() + timedelta(seconds=30)  # the default lease_ttl
    assert reply.lease_expires_at == expected.timestamp()
    task = await broker.get_task(delivery.task_id)
    assert task.lease_expires_at == expected
    assert task.progress == b'{"step": 2}'


@memory_only
async def test_callbacks_for_an_unknown_lease_get_lease_lost(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    gateway, delivery = await accepted_delivery(
        broker, nc, subjects, endpoint, managers, dispatcher
    )
    stranger = new_id(clock.now())
    beat = await callback(nc, subjects, delivery, lease_id=stranger)
    assert beat.status == Reply.STATUS_LEASE_LOST
    result = await callback(
        nc, subjects, delivery, lease_id=stranger, outcome=outcome(service_pb2.OUTCOME_SUCCESS)
    )
    assert result.status == Reply.STATUS_LEASE_LOST
    unknown_task = await callback(
        nc, subjects, delivery, task_id=new_id(clock.now()), lease_id=stranger
    )
    assert unknown_task.status == Reply.STATUS_LEASE_LOST
    # The real delivery is untouched.
    assert await state_of(broker, delivery.task_id) == TaskState.ACTIVE
    assert gateway.gateway.in_flight == 1

    # Once finished, its own lease is lost too.
    done = await callback(nc, subjects, delivery, outcome=outcome(service_pb2.OUTCOME_SUCCESS))
    assert done.status == Reply.STATUS_OK
    again = await callback(nc, subjects, delivery, outcome=outcome(service_pb2.OUTCOME_FAILURE))
    assert again.status == Reply.STATUS_LEASE_LOST
    late_beat = await callback(nc, subjects, delivery)
    assert late_beat.status == Reply.STATUS_LEASE_LOST


@memory_only
async def test_a_callback_that_is_not_final_is_invalid(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    _, delivery = await accepted_delivery(broker, nc, subjects, endpoint, managers, dispatcher)
    reply = await callback(nc, subjects, delivery, outcome=outcome(service_pb2.OUTCOME_UNSPECIFIED))
    assert reply.status == Reply.STATUS_INVALID
    assert await state_of(broker, delivery.task_id) == TaskState.ACTIVE


@memory_only
async def test_a_heartbeat_for_a_lease_the_gateway_does_not_hold_adopts_it(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    # A delivery made by an earlier incarnation (gone without releasing it).
    gateway = await start_gateway(broker, endpoint, managers, dispatcher)
    task_id = (await broker.enqueue(NewTask(queue=QUEUE, type="invoice.charge"))).task.id
    (leased,) = await broker.lease(QUEUE, 1, timedelta(seconds=30))
    assert leased.lease_id is not None
    orphan = Delivery({}, b"", {"id": leased.lease_id, "params": {"task_id": task_id}})
    assert gateway.gateway.in_flight == 0

    clock.advance(timedelta(seconds=5))
    beat = await callback(nc, subjects, orphan, beat=b"")
    assert beat.status == Reply.STATUS_OK
    assert beat.lease_expires_at == (clock.now() + timedelta(seconds=30)).timestamp()
    # It counts against the concurrency again, as a parked delivery.
    assert (gateway.gateway.in_flight, gateway.parked) == (1, 1)
    assert gateway.gateway.free(QUEUE) == 3

    reply = await callback(nc, subjects, orphan, outcome=outcome(service_pb2.OUTCOME_SKIP_RETRY))
    assert reply.status == Reply.STATUS_OK
    task = await broker.get_task(task_id)
    assert task.state == TaskState.ARCHIVED
    assert task.last_error == "handler asked to skip retries"
    assert (gateway.gateway.in_flight, gateway.parked) == (0, 0)


@memory_only
async def test_a_result_for_a_lease_the_gateway_does_not_hold_is_still_applied(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    gateway = await start_gateway(broker, endpoint, managers, dispatcher)
    task_id = (await broker.enqueue(NewTask(queue=QUEUE, type="invoice.charge"))).task.id
    (leased,) = await broker.lease(QUEUE, 1, timedelta(seconds=30))
    assert leased.lease_id is not None
    orphan = Delivery({}, b"", {"id": leased.lease_id, "params": {"task_id": task_id}})

    reply = await callback(nc, subjects, orphan, outcome=outcome(service_pb2.OUTCOME_SUCCESS))
    assert reply.status == Reply.STATUS_OK
    assert await state_of(broker, task_id) == TaskState.COMPLETED
    assert gateway.gateway.in_flight == 0


@memory_only
async def test_callbacks_for_a_task_of_a_queue_the_worker_does_not_serve_are_invalid(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    gateway = await start_gateway(broker, endpoint, managers, dispatcher)
    task_id = (await broker.enqueue(NewTask(queue="elsewhere", type="x"))).task.id
    (leased,) = await broker.lease("elsewhere", 1, timedelta(seconds=30))
    assert leased.lease_id is not None
    foreign = Delivery({}, b"", {"id": leased.lease_id, "params": {"task_id": task_id}})
    clock.advance(timedelta(seconds=5))

    beat = await callback(nc, subjects, foreign, queue="elsewhere", beat=b"progress")
    result = await callback(
        nc, subjects, foreign, queue="elsewhere", outcome=outcome(service_pb2.OUTCOME_SUCCESS)
    )
    for reply in (beat, result):
        assert reply.status == Reply.STATUS_INVALID
        assert "'elsewhere'" in reply.message
    task = await broker.get_task(task_id)
    assert (task.state, task.lease_id, task.progress) == (TaskState.ACTIVE, leased.lease_id, None)
    assert task.lease_expires_at == leased.lease_expires_at
    assert gateway.gateway.in_flight == 0


@memory_only
async def test_a_result_over_this_services_max_result_is_invalid_and_changes_nothing(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.answer = rpc("accepted")
    gateway = await start_gateway(
        broker, endpoint, managers, dispatcher, manager_options={"max_result": 10}
    )
    task_id = await submit(broker, nc, subjects, QUEUE)
    await eventually(lambda: gateway.parked == 1)
    (delivery,) = endpoint.deliveries

    big = outcome(service_pb2.OUTCOME_SUCCESS, result=b"x" * 11)
    reply = await callback(nc, subjects, delivery, outcome=big)
    assert reply.status == Reply.STATUS_INVALID
    assert reply.message == "result is 11 bytes; the limit is 10"
    assert await state_of(broker, task_id) == TaskState.ACTIVE
    assert (gateway.gateway.in_flight, gateway.parked) == (1, 1)
    # The endpoint reports a failure instead.
    failed = await callback(
        nc, subjects, delivery, outcome=outcome(service_pb2.OUTCOME_FAILURE, error="too big")
    )
    assert failed.status == Reply.STATUS_OK
    assert await state_of(broker, task_id) == TaskState.RETRY


@memory_only
async def test_accepted_without_a_callback_address_fails_the_attempt(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.answer = rpc("accepted")
    gateway = await start_gateway(
        broker, endpoint, managers, dispatcher, manager_options={"callback_address": ""}
    )
    task_id = await submit(broker, nc, subjects, QUEUE)

    await wait_state(broker, task_id, TaskState.RETRY)
    task = await broker.get_task(task_id)
    assert task.last_error == "endpoint answered accepted but no callback address is configured"
    assert (gateway.gateway.in_flight, gateway.parked) == (0, 0)
    assert gateway.breaker.failures == 0  # the endpoint answered


@memory_only
async def test_the_bulk_heartbeat_extends_open_deliveries_but_not_parked_ones(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    gateway, parked = await accepted_delivery(broker, nc, subjects, endpoint, managers, dispatcher)
    endpoint.hold(rpc("success"))
    open_id = await submit(broker, nc, subjects, QUEUE)
    await eventually(lambda: gateway.open_deliveries == 1)
    parked_before = (await broker.get_task(parked.task_id)).lease_expires_at
    clock.advance(timedelta(seconds=10))

    gateway.gateway.on_frame(service_pb2.WorkerFrame(heartbeat=service_pb2.Heartbeat()))

    expected = clock.now() + timedelta(seconds=30)

    async def extended() -> bool:
        return (await broker.get_task(open_id)).lease_expires_at == expected

    await eventually(extended)
    assert (await broker.get_task(parked.task_id)).lease_expires_at == parked_before
    endpoint.release.set()
    await wait_state(broker, open_id, TaskState.COMPLETED)


@memory_only
async def test_a_parked_delivery_whose_lease_lapsed_frees_its_slot_and_fails_the_attempt(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    gateway, delivery = await accepted_delivery(
        broker, nc, subjects, endpoint, managers, dispatcher
    )
    assert await gateway.sweep_lapsed() == 0  # still leased
    assert gateway.gateway.in_flight == 1
    clock.advance(timedelta(seconds=31))

    assert await gateway.sweep_lapsed() == 1
    assert gateway.gateway.in_flight == 0
    assert gateway.parked == 0
    # The lease is ended in the broker (no reaper runs here), with the usual backoff...
    task = await broker.get_task(delivery.task_id)
    assert (task.state, task.retried) == (TaskState.RETRY, 1)
    assert task.last_error == "webhook delivery stopped heartbeating"
    assert task.available_at > clock.now()
    # ...so a late callback cannot revive an attempt nobody counts any more.
    late_beat = await callback(nc, subjects, delivery)
    assert late_beat.status == Reply.STATUS_LEASE_LOST
    late = await callback(nc, subjects, delivery, outcome=outcome(service_pb2.OUTCOME_SUCCESS))
    assert late.status == Reply.STATUS_LEASE_LOST
    assert (await broker.get_task(delivery.task_id)).state == TaskState.RETRY


@memory_only
async def test_a_lapsed_parked_delivery_someone_else_extended_is_kept(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    gateway, delivery = await accepted_delivery(
        broker, nc, subjects, endpoint, managers, dispatcher
    )
    clock.advance(timedelta(seconds=29))
    # Extended behind this gateway's back (another instance's responder, mid hand-over).
    await broker.extend_lease(delivery.task_id, delivery.lease_id, timedelta(seconds=30))
    clock.advance(timedelta(seconds=2))

    assert await gateway.sweep_lapsed() == 0
    assert gateway.parked == 1
    assert gateway.parked_until(delivery.lease_id) == clock.now() + timedelta(seconds=28)
    assert await state_of(broker, delivery.task_id) == TaskState.ACTIVE


@memory_only
async def test_open_deliveries_are_heartbeaten_every_third_of_the_lease_ttl(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.hold(rpc("success"))
    gateway = await start_gateway(
        broker, endpoint, managers, dispatcher, manager_options={"lease_ttl": 0.3}
    )
    task_id = await submit(broker, nc, subjects, QUEUE)
    await eventually(lambda: gateway.open_deliveries == 1)
    clock.advance(timedelta(seconds=60))  # the broker's time; the heartbeat runs on its own
    expected = clock.now() + timedelta(seconds=0.3)

    async def extended() -> bool:
        return (await broker.get_task(task_id)).lease_expires_at == expected

    await eventually(extended)
    endpoint.release.set()
    await wait_state(broker, task_id, TaskState.COMPLETED)


# ------------------------------------------------------------ cancellation


@memory_only
async def test_an_operator_cancel_aborts_the_open_request(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.hold(rpc("success"))
    gateway = await start_gateway(broker, endpoint, managers, dispatcher)
    task_id = await submit(broker, nc, subjects, QUEUE)
    await eventually(lambda: gateway.open_deliveries == 1)

    task = await broker.cancel_task(task_id)  # what AdminService does, then it broadcasts
    assert task.state == TaskState.ARCHIVED
    broadcast = cluster_pb2.CancelBroadcast(task_id=task_id, reason="canceled")
    await nc.publish(subjects.cancel(), broadcast.SerializeToString())

    await eventually(lambda: gateway.open_deliveries == 0)
    assert gateway.gateway.in_flight == 0
    assert len(endpoint.deliveries) == 1


# ---------------------------------------------------------- circuit breaker


@memory_only
async def test_the_breaker_announces_zero_capacity_then_probes_then_closes(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    announced: list[cluster_pb2.Register] = []

    async def on_register(msg: Msg) -> None:
        announced.append(cluster_pb2.Register.FromString(msg.data))

    await nc.subscribe(subjects.register(QUEUE), cb=on_register)
    endpoint.answer = status(503)
    gateway = await start_gateway(
        broker,
        endpoint,
        managers,
        dispatcher,
        manager_options={"breaker_threshold": 2, "breaker_cooldown": 1.0},
        concurrency=4,
    )
    failing = [await submit(broker, nc, subjects, QUEUE) for _ in range(4)]

    def announced_capacity(capacity: int) -> bool:
        return any(r.gateway == gateway.id and r.capacity == capacity for r in announced)

    # Transport failures open it: capacity 0 on the queue, announced at once.
    await eventually(lambda: announced_capacity(0))
    assert gateway.gateway.concurrency == 0
    assert gateway.gateway.free(QUEUE) == 0
    for task_id in failing:
        await wait_state(broker, task_id, TaskState.RETRY)  # backoff: not due again
    assert {d.task_id for d in endpoint.deliveries} == set(failing)

    # After the cooldown: a single probe slot, whatever the registration's concurrency.
    endpoint.hold(rpc("success"))
    later = [await submit(broker, nc, subjects, QUEUE) for _ in range(2)]
    await eventually(lambda: announced_capacity(1) and gateway.open_deliveries == 1)
    assert gateway.gateway.concurrency == 1
    states = sorted([await state_of(broker, t) for t in later], key=lambda s: s.value)
    assert states == sorted([TaskState.ACTIVE, TaskState.PENDING], key=lambda s: s.value)

    # The probe succeeds: closed, full capacity again, the rest flows.
    endpoint.release.set()
    for task_id in later:
        await wait_state(broker, task_id, TaskState.COMPLETED)
    assert gateway.gateway.concurrency == 4
    assert announced_capacity(4)


@memory_only
async def test_parked_deliveries_do_not_block_the_breakers_probe(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    endpoint.answer = rpc("accepted")
    gateway = await start_gateway(
        broker,
        endpoint,
        managers,
        dispatcher,
        manager_options={"breaker_threshold": 1, "breaker_cooldown": 0.5},
        concurrency=4,
    )
    await submit(broker, nc, subjects, QUEUE)
    await eventually(lambda: gateway.parked == 1)

    # A transport failure opens the breaker: no synchronous slot, the parked one kept.
    endpoint.answer = status(503)
    failed = await submit(broker, nc, subjects, QUEUE)
    await wait_state(broker, failed, TaskState.RETRY)
    assert gateway.gateway.free(QUEUE) == 0
    assert gateway.parked == 1

    # After the cooldown the probe goes out although the parked delivery holds a slot.
    endpoint.answer = rpc("success")
    probe = await submit(broker, nc, subjects, QUEUE)
    await wait_state(broker, probe, TaskState.COMPLETED)
    await eventually(lambda: gateway.gateway.concurrency == 4)  # closed again
    assert gateway.parked == 1


@memory_only
async def test_no_connection_pool_limit_holds_deliveries_back(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> None:
    # More open deliveries than aiohttp's default pool (100) allows at once.
    many = 110
    endpoint.hold(rpc("success"))
    gateway = await start_gateway(broker, endpoint, managers, dispatcher, concurrency=many)
    ids = [await submit(broker, nc, subjects, QUEUE) for _ in range(many)]

    await eventually(lambda: len(endpoint.deliveries) == many)
    assert gateway.open_deliveries == many
    endpoint.release.set()
    for task_id in ids:
        await wait_state(broker, task_id, TaskState.COMPLETED)


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
        )
    )
    acks, wakes = AckBatcher(broker), WakePublisher(gone, subjects)
    gateway = WebhookGateway(
        worker, broker=broker, nc=gone, subjects=subjects, config=config, acks=acks, wakes=wakes
    )

    with pytest.raises(ConnectionClosedError):
        await gateway.start()
    assert gateway.http_closed
    assert gateway.gateway.closed
    assert not gateway.serving
