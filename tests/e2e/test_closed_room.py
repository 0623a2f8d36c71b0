"""NATS as a closed room, through real processes: a client that reaches NATS but does not
hold the cluster key (or replays what it captured) cannot make a service act.

The nats-server here is open (no users), as a misconfigured or breached one would be: the
intruder is the test's own connection, which reads the real traffic (gateway ids, queue
names) and forges messages with no seal, a seal of another key, or a seal of the right
key sent a minute ago (what a captured message replayed later looks like). Each test
also shows the door it checks is a real one: the same message sealed with the cluster
key now does act.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from conveyor import AsyncClient
from conveyor_broker import NewTask, TaskState
from conveyor_broker.ids import new_id
from conveyor_broker.postgres import PostgresBroker
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.cluster_key import ClusterAuth, generate_key, parse_keys
from conveyor_runtime.embedded_nats import EmbeddedNats
from conveyor_runtime.nats_connect import close_nats, connect_nats
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.polling import wait_until
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from tests.e2e.conftest import read_record
from tests.e2e.harness import POLL_INTERVAL, Cluster, Proc

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

SUBJECTS = Subjects()  # the services' default prefix


def auth_of(key: str, *, late_by: float = 0.0) -> ClusterAuth:
    """An auth with ``key`` whose clock is ``late_by`` seconds behind."""
    return ClusterAuth(parse_keys([key]), now=lambda: time.time() - late_by)


def forgers(cluster: Cluster) -> dict[str, ClusterAuth | None]:
    """How an intruder seals (by the reason code it is refused for): not at all, with a
    key of its own, with the cluster's key a minute ago (a replay)."""
    return {
        "unsealed": None,
        "unknown-key": auth_of(generate_key()),
        "expired": auth_of(cluster.cluster_key, late_by=60.0),
    }


async def send(nc: NatsClient, subject: str, body: bytes, auth: ClusterAuth | None) -> None:
    headers = auth.seal(subject, body) if auth is not None else None
    await nc.publish(subject, body, headers=headers)
    await nc.flush()


def refused(proc: Proc, kind: str, reason: str) -> bool:
    """True once ``proc`` logged refusing a ``kind`` message for ``reason``."""
    return any(
        f"bus.refused kind={kind} " in line and f" reason={reason} " in line
        for line in proc.log().splitlines()
    )


async def registrations(nc: NatsClient) -> list[cluster_pb2.Register]:
    """Every Register on the wire, as an intruder reads them (it learns gateway ids)."""
    seen: list[cluster_pb2.Register] = []

    async def on_msg(msg: Msg) -> None:
        seen.append(cluster_pb2.Register.FromString(msg.data))

    await nc.subscribe(SUBJECTS.queue_wildcard("register"), cb=on_msg)
    await nc.flush()
    return seen


def started(record: Path) -> list[str]:
    return [f[1] for f in read_record(record) if f[0] == "start"]


@pytest.fixture
async def intruder(nats_server: EmbeddedNats) -> AsyncIterator[NatsClient]:
    nc = await connect_nats(nats_server.url, name="intruder")
    yield nc
    await close_nats(nc, drain=False)


async def gateway_of(seen: list[cluster_pb2.Register], queue: str) -> str:
    await wait_until(
        lambda: any(r.queue == queue for r in seen),
        message="a registration",
        within=30,
        interval=POLL_INTERVAL,
    )
    return next(r.gateway for r in seen if r.queue == queue)


async def test_a_forged_dispatch_never_reaches_the_worker(
    cluster: Cluster, intruder: NatsClient, tmp_path: Path
) -> None:
    seen = await registrations(intruder)
    api = await cluster.start_api()
    record = tmp_path / "record.txt"
    cluster.start_worker(f"127.0.0.1:{api.port}", queues={"mail": 1}, concurrency=4, record=record)
    gateway = await gateway_of(seen, "mail")
    subject = SUBJECTS.dispatch(gateway)

    def forged(task_id: str) -> bytes:
        request = cluster_pb2.DispatchRequest(queue="mail", dispatcher="intruder")
        request.tasks.add(
            id=task_id, queue="mail", type="e2e.noop", payload=b"{}", lease_id="l", attempt=1
        )
        return request.SerializeToString()

    for how, auth in forgers(cluster).items():
        await send(intruder, subject, forged(new_id(datetime.now(UTC))), auth)
        await wait_until(
            lambda how=how: refused(api, "DispatchRequest", how),  # type: ignore[misc]
            message=how,
            within=30,
            interval=POLL_INTERVAL,
        )
    # The same dispatch sealed with the cluster key does reach the worker: the door the
    # forgeries knocked on is the real one.
    # (A gateway takes only task ids that are ULIDs, as the broker's are.)
    sealed = new_id(datetime.now(UTC))
    await send(intruder, subject, forged(sealed), auth_of(cluster.cluster_key))
    await wait_until(
        lambda: sealed in started(record),
        message="the sealed dispatch to run",
        within=30,
        interval=POLL_INTERVAL,
    )
    assert started(record) == [sealed]


async def test_a_forged_cancel_leaves_the_running_task_alone(
    cluster: Cluster, intruder: NatsClient, store: PostgresBroker, tmp_path: Path
) -> None:
    api = await cluster.start_api()
    cluster.start_dispatcher()
    record = tmp_path / "record.txt"
    target = f"127.0.0.1:{api.port}"
    cluster.start_worker(target, queues={"mail": 1}, concurrency=2, record=record)
    async with AsyncClient(target) as client:
        task = await client.enqueue("e2e.sleep", {"seconds": 600}, queue="mail")
    await wait_until(
        lambda: task.id in started(record),
        message="the task to start",
        within=30,
        interval=POLL_INTERVAL,
    )
    subject = SUBJECTS.cancel()
    body = cluster_pb2.CancelBroadcast(task_id=task.id, reason="forged").SerializeToString()
    for how, auth in forgers(cluster).items():
        await send(intruder, subject, body, auth)
        await wait_until(
            lambda how=how: refused(api, "CancelBroadcast", how),  # type: ignore[misc]
            message=how,
            within=30,
            interval=POLL_INTERVAL,
        )
    assert (await store.get_task(task.id)).state is TaskState.ACTIVE
    assert not [f for f in read_record(record) if f[0] == "cancelled"]
    # Sealed with the cluster key, the same broadcast does cancel it.
    await send(intruder, subject, body, auth_of(cluster.cluster_key))
    await wait_until(
        lambda: any(f[0] == "cancelled" for f in read_record(record)),
        message="the cancel",
        within=30,
        interval=POLL_INTERVAL,
    )


async def test_a_forged_closing_register_does_not_unregister_the_worker(
    cluster: Cluster, intruder: NatsClient, store: PostgresBroker, tmp_path: Path
) -> None:
    """A gateway re-registers only every CONVEYOR_REGISTER_TICK (a minute here): had the
    dispatcher believed a forged closing Register, the task enqueued after it would wait
    that long."""
    seen = await registrations(intruder)
    tick = {"CONVEYOR_REGISTER_TICK": "60"}
    api = await cluster.start_api(tick)
    dispatcher = cluster.start_dispatcher(tick)
    record = tmp_path / "record.txt"
    target = f"127.0.0.1:{api.port}"
    cluster.start_worker(target, queues={"mail": 1}, concurrency=2, record=record)
    gateway = await gateway_of(seen, "mail")
    async with AsyncClient(target) as client:
        first = await client.enqueue("e2e.noop", {}, queue="mail")
        await wait_until(
            lambda: first.id in started(record),
            message="the first task",
            within=30,
            interval=POLL_INTERVAL,
        )
        real = next(r for r in seen if r.gateway == gateway)
        closing = cluster_pb2.Register(gateway=gateway, queue="mail", closing=True)
        closing.labels.update(real.labels)
        subject = SUBJECTS.register("mail")
        for how, auth in forgers(cluster).items():
            await send(intruder, subject, closing.SerializeToString(), auth)
            await wait_until(
                lambda how=how: refused(dispatcher, "Register", how),  # type: ignore[misc]
                message=how,
                within=30,
                interval=POLL_INTERVAL,
            )
        second = await client.enqueue("e2e.noop", {}, queue="mail")
        await wait_until(
            lambda: second.id in started(record),
            within=20,
            message="the second",
            interval=POLL_INTERVAL,
        )


async def test_a_dispatch_past_its_deadline_is_refused_and_runs_once(
    cluster: Cluster, intruder: NatsClient, store: PostgresBroker, tmp_path: Path
) -> None:
    """Issue 11's double run: a dispatch the dispatcher gave up on (its gateway's process
    stood still past the dispatch timeout) reaches the gateway late, after the dispatcher
    released its task. The gateway refuses it; the task is dispatched again and runs once."""
    seen = await registrations(intruder)
    api = await cluster.start_api()
    dispatcher = cluster.start_dispatcher({"CONVEYOR_DISPATCH_TIMEOUT": "1"})
    record = tmp_path / "record.txt"
    cluster.start_worker(f"127.0.0.1:{api.port}", queues={"mail": 1}, concurrency=2, record=record)
    await gateway_of(seen, "mail")
    await wait_until(
        lambda: "dispatcher.gateway_registered" in dispatcher.log(),
        message="the dispatcher",
        within=30,
        interval=POLL_INTERVAL,
    )
    os.kill(api.pid, signal.SIGSTOP)
    try:
        [result] = await store.enqueue_batch(
            [NewTask(queue="mail", type="e2e.noop", payload=b"{}")]
        )
        task_id = result.task.id
        bus = Bus(intruder, SUBJECTS, auth_of(cluster.cluster_key))  # speaking as the api
        await bus.publish(cluster_pb2.Wake(queue="mail"))
        await wait_until(
            lambda: "dispatcher.dispatch_timeout" in dispatcher.log(),
            message="the timeout",
            within=30,
            interval=POLL_INTERVAL,
        )

        async def released() -> bool:
            return (await store.get_task(task_id)).state is TaskState.PENDING

        await wait_until(
            released,
            message="the dispatcher to release the task",
            within=30,
            interval=POLL_INTERVAL,
        )
    finally:
        os.kill(api.pid, signal.SIGCONT)

    async def completed() -> bool:
        return (await store.get_task(task_id)).state is TaskState.COMPLETED

    await wait_until(completed, within=30, message="the task to complete", interval=POLL_INTERVAL)
    # By now the late dispatch was refused, or it runs the task a second time.
    await wait_until(
        lambda: refused(api, "DispatchRequest", "late") or started(record).count(task_id) > 1,
        message="the late dispatch to be handled",
        within=30,
        interval=POLL_INTERVAL,
    )
    assert started(record).count(task_id) == 1, "the task ran twice"


async def test_services_mid_rotation_work_together(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    """The middle step of a key rotation: the api signs with the new key, the dispatcher
    still with the old one, both verify both; tasks run end to end."""
    old, new = cluster.cluster_key, generate_key()
    api = await cluster.start_api({"CONVEYOR_CLUSTER_KEY": f"{new},{old}"})
    cluster.start_dispatcher({"CONVEYOR_CLUSTER_KEY": f"{old},{new}"})
    record = tmp_path / "record.txt"
    target = f"127.0.0.1:{api.port}"
    cluster.start_worker(target, queues={"mail": 1}, concurrency=4, record=record)
    async with AsyncClient(target) as client:
        ids = [(await client.enqueue("e2e.noop", {}, queue="mail")).id for _ in range(5)]

    async def all_completed() -> bool:
        rows = [await store.get_task(task_id) for task_id in ids]
        return all(row.state is TaskState.COMPLETED for row in rows)

    await wait_until(
        all_completed, within=30, message="every task to complete", interval=POLL_INTERVAL
    )
    assert sorted(started(record)) == sorted(ids)
    assert "bus.refused" not in api.log()
