"""WorkerService.Session over a real gRPC socket, with this test acting as the dispatcher
over the private nats-server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import grpc
import pytest
from conveyor_api import ApiServer
from conveyor_broker import FakeClock, NewTask, TaskState
from conveyor_broker.ids import is_ulid
from conveyor_protos.v1 import cluster_pb2, service_pb2, service_pb2_grpc, task_pb2
from conveyor_runtime import wire
from conveyor_runtime.bus import Bus
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.polling import wait_until
from conveyor_testkit.stream import MakeApi, Recorder, WorkerStream, dispatch
from nats import errors as nats_errors

TTL = timedelta(seconds=30)


@dataclass
class Session:
    """An open worker session and what the cluster saw of it."""

    worker: WorkerStream
    welcome: service_pb2.Welcome
    registers: Recorder[cluster_pb2.Register]
    dones: Recorder[cluster_pb2.Done]

    @property
    def gateway(self) -> str:
        return self.welcome.session_id


@pytest.fixture
async def open_session(channel: grpc.aio.Channel, bus: Bus) -> AsyncIterator[Any]:
    """Open worker sessions whose gateway has registered (so it can take dispatches)."""
    opened: list[Session] = []

    async def open_(queues: Mapping[str, int], concurrency: int, **hello: Any) -> Session:
        registers = await Recorder(cluster_pb2.Register).start(bus)
        dones = await Recorder(cluster_pb2.Done).start(bus)
        worker = WorkerStream(channel)
        welcome = await worker.hello(queues, concurrency, **hello)
        await registers.wait_for(lambda m: m.gateway == welcome.session_id, count=len(queues))
        session = Session(worker, welcome, registers, dones)
        opened.append(session)
        return session

    yield open_
    for session in opened:
        session.worker.cancel()
        await session.registers.stop()
        await session.dones.stop()


async def leased(broker: CountingBroker, queue: str, n: int) -> list[task_pb2.TaskEnvelope]:
    """Enqueue ``n`` tasks and lease them, as the dispatcher would; their envelopes."""
    await broker.enqueue_batch([NewTask(queue=queue, type="job", payload=b"p") for _ in range(n)])
    tasks = await broker.lease(queue, n, TTL)
    assert len(tasks) == n
    return [wire.task_to_envelope(t) for t in tasks]


async def state_of(broker: CountingBroker, task_id: str) -> TaskState:
    return (await broker.get_task(task_id)).state


async def wait_state(broker: CountingBroker, task_id: str, state: TaskState) -> None:
    async def reached() -> bool:
        return await state_of(broker, task_id) is state

    await wait_until(reached, message=f"task {task_id} {state}")


async def dispatch_all(
    bus: Bus, session: Session, envs: list[task_pb2.TaskEnvelope]
) -> cluster_pb2.DispatchReply:
    """Dispatch ``envs`` and read the Dispatch frames of the accepted ones."""
    reply = await dispatch(bus, session.gateway, envs[0].queue, envs)
    for expected in reply.accepted:
        frame = await session.worker.read_kind("dispatch")
        assert frame.dispatch.task.id == expected
    return reply


# --------------------------------------------------------------- handshake


async def test_first_frame_must_be_hello(channel: grpc.aio.Channel) -> None:
    worker = WorkerStream(channel)
    await worker.send(service_pb2.WorkerFrame(heartbeat=service_pb2.Heartbeat()))
    assert await worker.status() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first frame must be Hello" in await worker.details()

    empty = WorkerStream(channel)
    await empty.close()
    assert await empty.status() == grpc.StatusCode.INVALID_ARGUMENT


async def test_no_hello_in_time_ends_the_stream(make_api: MakeApi) -> None:
    api = await make_api(hello_timeout=0.2)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        worker = WorkerStream(ch)
        assert await worker.status() == grpc.StatusCode.INVALID_ARGUMENT
        assert "first frame must be Hello" in await worker.details()


@pytest.mark.parametrize(
    ("queues", "concurrency", "hello", "code", "text"),
    [
        ({"bad queue": 1}, 1, {}, grpc.StatusCode.INVALID_ARGUMENT, "invalid queue name"),
        ({"q": 0}, 1, {}, grpc.StatusCode.INVALID_ARGUMENT, "weight"),
        ({"q": 1}, 0, {}, grpc.StatusCode.INVALID_ARGUMENT, "concurrency"),
        ({}, 1, {}, grpc.StatusCode.INVALID_ARGUMENT, "at least one queue"),
        ({"q": 1}, 1, {"sdk_version": "0.0.1"}, grpc.StatusCode.FAILED_PRECONDITION, "0.0.1"),
        (
            {"q": 1},
            1,
            {"min_server_version": "2.0.0"},
            grpc.StatusCode.FAILED_PRECONDITION,
            "0.1.0",
        ),
        ({"q": 1}, 1, {"sdk_version": "latest"}, grpc.StatusCode.FAILED_PRECONDITION, "latest"),
        # Names are matched whole, and every field of a Hello is bounded.
        ({"0\n": 1}, 1, {}, grpc.StatusCode.INVALID_ARGUMENT, "invalid queue name '0\\n'"),
        ({"\u0430": 1}, 1, {}, grpc.StatusCode.INVALID_ARGUMENT, "invalid queue name"),
        ({"q": 1001}, 1, {}, grpc.StatusCode.INVALID_ARGUMENT, "must be 1..1000, got 1001"),
        ({"q": 1}, 10_001, {}, grpc.StatusCode.INVALID_ARGUMENT, "concurrency must be 1..10000"),
        (
            {f"q{n}": 1 for n in range(1001)},
            1,
            {},
            grpc.StatusCode.INVALID_ARGUMENT,
            "1001 queues; at most 1000",
        ),
        (
            {"q": 1},
            1,
            {"labels": {f"k{n}": "v" for n in range(17)}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "17 labels; at most 16",
        ),
        (
            {"q": 1},
            1,
            {"labels": {"k" * 65: "v"}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "label key 'kkkk",
        ),
        (
            {"q": 1},
            1,
            {"labels": {"zone": "v" * 257}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "label 'zone' is 257 characters; at most 256",
        ),
        (
            {"q": 1},
            1,
            {"labels": {"zone": "eu\x00"}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "label 'zone' contains the control character",
        ),
        (
            {"q": 1},
            1,
            {"worker_id": "w" * 257},
            grpc.StatusCode.INVALID_ARGUMENT,
            "worker_id is 257 characters; at most 256",
        ),
        (
            {"q": 1},
            1,
            {"worker_id": "w\nforged log line"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "worker_id contains the control character",
        ),
        (
            {"q": 1},
            1,
            {"sdk_version": "1." * 40},
            grpc.StatusCode.INVALID_ARGUMENT,
            "sdk_version is 80 characters; at most 64",
        ),
        (
            # Found by the fuzz suite: the refusal quoted the whole name, too long a status
            # for the client to read (it saw RESOURCE_EXHAUSTED); now it is cut.
            {"x" * 70_000: 1},
            1,
            {},
            grpc.StatusCode.INVALID_ARGUMENT,
            "characters)",
        ),
        (
            {"q": 1},
            1,
            {"sdk_version": "\u0661.\u0660.\u0660"},
            grpc.StatusCode.FAILED_PRECONDITION,
            "not a semantic version",
        ),
    ],
)
async def test_bad_hello_is_refused(
    channel: grpc.aio.Channel,
    queues: dict[str, int],
    concurrency: int,
    hello: dict[str, str],
    code: grpc.StatusCode,
    text: str,
) -> None:
    worker = WorkerStream(channel)
    with pytest.raises(EOFError):
        await worker.hello(queues, concurrency, **hello)  # type: ignore[arg-type]
    assert await worker.status() == code
    assert text in await worker.details()


async def test_welcome_and_register(api: ApiServer, open_session: Any, bus: Bus) -> None:
    session: Session = await open_session({"a": 3, "b": 1}, 8, labels={"zone": "eu"})
    welcome = session.welcome
    assert is_ulid(welcome.session_id)
    assert welcome.lease_ttl.ToTimedelta() == TTL
    assert welcome.heartbeat_interval.ToTimedelta() == TTL / 3
    assert welcome.server_version == "0.1.0"
    assert welcome.min_sdk_version == "0.1.0"

    registers = {m.queue: m for m in session.registers.messages if m.gateway == session.gateway}
    assert registers["a"].capacity == 6
    assert registers["a"].weight == 3
    assert registers["b"].capacity == 2
    assert registers["b"].weight == 1
    assert dict(registers["a"].labels) == {"zone": "eu"}
    assert not registers["a"].closing
    assert api.registry.gateways[session.gateway].capacity == {"a": 6, "b": 2}

    # A new dispatcher owner asks for registrations: the gateway answers at once.
    before = len(session.registers.messages)
    await bus.publish_owner_changed("b")
    await session.registers.wait_for(lambda m: m.queue == "b", count=2)
    assert [m.queue for m in session.registers.messages[before:]] == ["b"]

    # A starting dispatcher calls the roll: the gateway announces every queue at once.
    before = len(session.registers.messages)
    await bus.publish_roll_call()
    await session.registers.wait_for(lambda m: m.queue == "a", count=2)
    await session.registers.wait_for(lambda m: m.queue == "b", count=3)
    answers = [m for m in session.registers.messages[before:] if m.gateway == session.gateway]
    assert sorted(m.queue for m in answers) == ["a", "b"]
    assert answers[0].capacity == registers[answers[0].queue].capacity


# ---------------------------------------------------------------- dispatch


async def test_dispatch_is_capped_at_free_capacity(
    open_session: Any, broker: CountingBroker, bus: Bus
) -> None:
    session: Session = await open_session({"q": 1}, 2)
    envs = await leased(broker, "q", 3)
    reply = await dispatch_all(bus, session, envs)
    assert list(reply.accepted) == [envs[0].id, envs[1].id]
    assert reply.credits == 0
    # Full: a further offer is refused outright.
    more = await dispatch(bus, session.gateway, "q", envs[2:])
    assert list(more.accepted) == []
    assert more.credits == 0
    # A queue the worker does not serve gets nothing either.
    other = await dispatch(bus, session.gateway, "elsewhere", envs[2:])
    assert list(other.accepted) == []


async def test_accepts_dispatches_gets_one_dispatches_frame(
    open_session: Any, broker: CountingBroker, bus: Bus
) -> None:
    session: Session = await open_session({"q": 1}, 3, accepts_dispatches=True)
    envs = await leased(broker, "q", 4)
    reply = await dispatch(bus, session.gateway, "q", envs)
    assert list(reply.accepted) == [env.id for env in envs[:3]]
    frame = await session.worker.read_kind("dispatches")
    assert [t.id for t in frame.dispatches.tasks] == list(reply.accepted)
    assert [t.lease_id for t in frame.dispatches.tasks] == [env.lease_id for env in envs[:3]]
    # Still one credit per task: the session is full, and each Result frees one slot.
    assert reply.credits == 0
    first = frame.dispatches.tasks[0]
    await session.worker.result(first, service_pb2.OUTCOME_SUCCESS)
    await wait_state(broker, first.id, TaskState.COMPLETED)
    more = await dispatch(bus, session.gateway, "q", envs[3:])
    assert list(more.accepted) == [envs[3].id]
    again = await session.worker.read_kind("dispatches")
    assert [t.id for t in again.dispatches.tasks] == [envs[3].id]


async def test_without_accepts_dispatches_each_task_is_its_own_frame(
    open_session: Any, broker: CountingBroker, bus: Bus
) -> None:
    session: Session = await open_session({"q": 1}, 3)
    envs = await leased(broker, "q", 3)
    reply = await dispatch(bus, session.gateway, "q", envs)
    assert len(reply.accepted) == 3
    for expected in reply.accepted:
        frame = await session.worker.read_kind("dispatch")
        assert frame.dispatch.task.id == expected


async def test_session_cap_holds_across_queues(
    open_session: Any, broker: CountingBroker, bus: Bus
) -> None:
    # Three queues, two slots: each queue gets a slot, but never more than two in total.
    session: Session = await open_session({"a": 1, "b": 1, "c": 1}, 2)
    for queue, accepted in (("a", 1), ("b", 1), ("c", 0)):
        envs = await leased(broker, queue, 2)
        reply = await dispatch_all(bus, session, envs)
        assert len(reply.accepted) == accepted, queue


# ------------------------------------------------------------------ results


async def test_success_acks_and_publishes_done(
    open_session: Any, broker: CountingBroker, bus: Bus
) -> None:
    session: Session = await open_session({"q": 1}, 1)
    [env] = await leased(broker, "q", 1)
    await dispatch_all(bus, session, [env])
    await session.worker.result(env, service_pb2.OUTCOME_SUCCESS, result=b"42")
    await wait_state(broker, env.id, TaskState.COMPLETED)
    assert (await broker.get_task(env.id)).result == b"42"
    [done] = await session.dones.wait_for(lambda m: m.gateway == session.gateway)
    assert done.queue == "q"
    assert done.n == 1
    # The slot is free again.
    [env2] = await leased(broker, "q", 1)
    reply = await dispatch_all(bus, session, [env2])
    assert list(reply.accepted) == [env2.id]


async def test_concurrent_acks_share_a_commit(
    open_session: Any, broker: CountingBroker, bus: Bus
) -> None:
    session: Session = await open_session({"q": 1}, 50)
    envs = await leased(broker, "q", 50)
    await dispatch_all(bus, session, envs)
    batch = service_pb2.BatchResult(
        results=[
            service_pb2.Result(
                task_id=e.id, lease_id=e.lease_id, outcome=service_pb2.OUTCOME_SUCCESS
            )
            for e in envs
        ]
    )
    await session.worker.send(service_pb2.WorkerFrame(batch_result=batch))
    await wait_until(lambda: sum(broker.ack_batch_sizes) == 50, message="50 acks committed")
    assert len(broker.ack_batch_sizes) <= 5, broker.ack_batch_sizes
    stats = (await broker.queue_stats("q"))[0]
    assert stats.count(TaskState.COMPLETED) == 50
    await wait_until(
        lambda: sum(m.n for m in session.dones.messages if m.gateway == session.gateway) == 50
    )
    assert len(session.dones.messages) < 50


async def test_result_over_max_result_fails_the_task(
    make_api: MakeApi, broker: CountingBroker, bus: Bus
) -> None:
    api = await make_api(max_result=8)
    registers = await Recorder(cluster_pb2.Register).start(bus, queue="q")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        worker = WorkerStream(ch)
        welcome = await worker.hello({"q": 1}, 1)
        await registers.wait_for(lambda m: m.gateway == welcome.session_id)
        [env] = await leased(broker, "q", 1)
        await dispatch(bus, welcome.session_id, "q", [env])
        await worker.read_kind("dispatch")
        await worker.result(env, service_pb2.OUTCOME_SUCCESS, result=b"x" * 9)
        await wait_state(broker, env.id, TaskState.RETRY)
        task = await broker.get_task(env.id)
        assert task.result is None
        assert "the limit is 8" in (task.last_error or "")
        worker.cancel()
    await registers.stop()


async def test_failure_retries_with_the_requested_delay(
    open_session: Any, broker: CountingBroker, bus: Bus, clock: FakeClock
) -> None:
    session: Session = await open_session({"q": 1}, 2)
    env_after, env_backoff = await leased(broker, "q", 2)
    await dispatch_all(bus, session, [env_after, env_backoff])
    await session.worker.result(
        env_after, service_pb2.OUTCOME_FAILURE, error="boom", retry_after=120
    )
    await session.worker.result(env_backoff, service_pb2.OUTCOME_FAILURE, error="again")
    await wait_state(broker, env_after.id, TaskState.RETRY)
    await wait_state(broker, env_backoff.id, TaskState.RETRY)
    task = await broker.get_task(env_after.id)
    assert task.retried == 1
    assert task.last_error == "boom"
    assert task.available_at == clock.now() + timedelta(seconds=120)
    backed_off = await broker.get_task(env_backoff.id)
    # Default backoff for the first retry: 1 s, minus at most half as jitter.
    assert clock.now() + timedelta(seconds=0.5) <= backed_off.available_at
    assert backed_off.available_at <= clock.now() + timedelta(seconds=1)


async def test_skip_retry_archives_and_release_returns_pending(
    open_session: Any, broker: CountingBroker, bus: Bus
) -> None:
    wakes = await Recorder(cluster_pb2.Wake).start(bus, queue="q")
    session: Session = await open_session({"q": 1}, 2)
    skip, give_back = await leased(broker, "q", 2)
    await dispatch_all(bus, session, [skip, give_back])
    await session.worker.result(skip, service_pb2.OUTCOME_SKIP_RETRY, error="bad input")
    await session.worker.result(give_back, service_pb2.OUTCOME_RELEASE)
    await wait_state(broker, skip.id, TaskState.ARCHIVED)
    await wait_state(broker, give_back.id, TaskState.PENDING)
    assert (await broker.get_task(skip.id)).last_error == "bad input"
    assert (await broker.get_task(give_back.id)).retried == 0
    # A released task is due at once: its queue is woken for another worker.
    await wakes.wait_for()
    await wakes.stop()


async def test_bad_frames_are_ignored_and_the_stream_stays_up(
    open_session: Any, broker: CountingBroker, bus: Bus
) -> None:
    session: Session = await open_session({"q": 1}, 1)
    [env] = await leased(broker, "q", 1)
    await dispatch_all(bus, session, [env])
    worker = session.worker
    # A Result for a lease this session does not hold, a malformed one, a second
    # Hello, and an empty frame: each is logged and dropped.
    await worker.send(
        service_pb2.WorkerFrame(
            result=service_pb2.Result(
                task_id=env.id, lease_id="someone-else", outcome=service_pb2.OUTCOME_SUCCESS
            )
        )
    )
    await worker.send(
        service_pb2.WorkerFrame(result=service_pb2.Result(task_id=env.id, lease_id=env.lease_id))
    )
    await worker.send(service_pb2.WorkerFrame(hello=service_pb2.Hello(queues={"q": 1})))
    await worker.send(service_pb2.WorkerFrame())
    await worker.result(env, service_pb2.OUTCOME_SUCCESS)
    await wait_state(broker, env.id, TaskState.COMPLETED)
    assert broker.ack_batch_sizes == [1]


async def test_progress_is_stored(open_session: Any, broker: CountingBroker, bus: Bus) -> None:
    session: Session = await open_session({"q": 1}, 1)
    [env] = await leased(broker, "q", 1)
    await dispatch_all(bus, session, [env])
    progress = service_pb2.Progress(task_id=env.id, lease_id=env.lease_id, progress=b"50%")
    await session.worker.send(service_pb2.WorkerFrame(progress=progress))

    async def stored() -> bool:
        return (await broker.get_task(env.id)).progress == b"50%"

    await wait_until(stored, message="progress stored")


# ------------------------------------------------------------------- leases


async def test_heartbeat_extends_every_lease(
    open_session: Any, broker: CountingBroker, bus: Bus, clock: FakeClock
) -> None:
    session: Session = await open_session({"q": 1}, 2)
    envs = await leased(broker, "q", 2)
    await dispatch_all(bus, session, envs)
    clock.advance(timedelta(seconds=20))
    await session.worker.send(service_pb2.WorkerFrame(heartbeat=service_pb2.Heartbeat()))

    async def extended() -> bool:
        tasks = [await broker.get_task(e.id) for e in envs]
        return all(t.lease_expires_at == clock.now() + TTL for t in tasks)

    await wait_until(extended, message="leases extended")


async def test_a_lost_lease_is_cancelled_on_the_worker(
    open_session: Any, broker: CountingBroker, bus: Bus, clock: FakeClock
) -> None:
    session: Session = await open_session({"q": 1}, 1)
    [env] = await leased(broker, "q", 1)
    await dispatch_all(bus, session, [env])
    clock.advance(TTL + timedelta(seconds=1))
    reaped = await broker.reap_expired_leases()
    assert [r.task_id for r in reaped] == [env.id]

    await session.worker.send(service_pb2.WorkerFrame(heartbeat=service_pb2.Heartbeat()))
    cancel = (await session.worker.read_kind("cancel")).cancel
    assert cancel.task_id == env.id
    assert cancel.lease_id == env.lease_id
    # The slot was refunded: the dispatcher hears of it, and the gateway takes a new task.
    await session.dones.wait_for(lambda m: m.gateway == session.gateway)
    clock.advance(timedelta(hours=2))
    [env2] = await leased(broker, "q", 1)
    assert env2.id == env.id  # the same task, redelivered under a new lease
    reply = await dispatch_all(bus, session, [env2])
    assert list(reply.accepted) == [env.id]
    # A late Result for the old lease is dropped; the new delivery is unaffected.
    await session.worker.result(env, service_pb2.OUTCOME_SUCCESS)
    await session.worker.result(env2, service_pb2.OUTCOME_SUCCESS)
    await wait_state(broker, env.id, TaskState.COMPLETED)
    assert sum(broker.ack_batch_sizes) == 1


async def test_a_lease_reaped_while_the_worker_is_silent_is_cancelled(
    open_session: Any, broker: CountingBroker, bus: Bus, clock: FakeClock
) -> None:
    """No heartbeat comes at all (the worker hangs): once the reaper has released the
    task, the gateway finds the lease gone on its own, sends Cancel and frees the slot."""
    session: Session = await open_session({"q": 1}, 1)
    [env] = await leased(broker, "q", 1)
    await dispatch_all(bus, session, [env])
    clock.advance(TTL + timedelta(seconds=5))
    assert [r.task_id for r in await broker.reap_expired_leases()] == [env.id]

    cancel = (await session.worker.read_kind("cancel", within=10)).cancel
    assert (cancel.task_id, cancel.lease_id) == (env.id, env.lease_id)
    await session.dones.wait_for(lambda m: m.gateway == session.gateway)
    # A late Result for it is ignored: the task stays as the reaper left it.
    await session.worker.result(env, service_pb2.OUTCOME_SUCCESS)
    assert await state_of(broker, env.id) is TaskState.RETRY  # as the reaper left it


async def test_a_draining_session_gets_no_new_tasks_but_its_results_count(
    open_session: Any, broker: CountingBroker, bus: Bus
) -> None:
    session: Session = await open_session({"q": 1}, 2)
    envs = await leased(broker, "q", 3)
    await dispatch_all(bus, session, envs[:1])
    await session.worker.send(service_pb2.WorkerFrame(drain=service_pb2.Drain()))
    await session.registers.wait_for(lambda m: m.gateway == session.gateway and m.capacity == 0)
    # A slot is free, but a draining worker takes nothing: refused, no credit.
    reply = await dispatch(bus, session.gateway, "q", envs[1:2])
    assert (list(reply.accepted), reply.credits) == ([], 0)
    # A Credit opens nothing either.
    await session.worker.send(service_pb2.WorkerFrame(credit=service_pb2.Credit(queue="q", n=5)))
    reply = await dispatch(bus, session.gateway, "q", envs[1:2])
    assert list(reply.accepted) == []
    # What it holds still completes.
    await session.worker.result(envs[0], service_pb2.OUTCOME_SUCCESS)
    await wait_state(broker, envs[0].id, TaskState.COMPLETED)


async def test_cancel_broadcast_reaches_the_worker(
    open_session: Any, broker: CountingBroker, bus: Bus
) -> None:
    session: Session = await open_session({"q": 1}, 1)
    [env] = await leased(broker, "q", 1)
    await dispatch_all(bus, session, [env])
    await bus.publish(cluster_pb2.CancelBroadcast(task_id=env.id, reason="operator"))
    cancel = (await session.worker.read_kind("cancel")).cancel
    assert (cancel.task_id, cancel.lease_id, cancel.reason) == (env.id, env.lease_id, "operator")
    await session.dones.wait_for(lambda m: m.gateway == session.gateway)


# --------------------------------------------------------------- stream end


@pytest.mark.parametrize("how", ["half_close", "cancel"])
async def test_stream_end_releases_everything_and_says_goodbye(
    open_session: Any, broker: CountingBroker, bus: Bus, how: str
) -> None:
    session: Session = await open_session({"a": 1, "b": 1}, 4)
    envs_a = await leased(broker, "a", 2)
    envs_b = await leased(broker, "b", 1)
    await dispatch_all(bus, session, envs_a)
    await dispatch_all(bus, session, envs_b)
    if how == "half_close":
        await session.worker.close()
    else:
        session.worker.cancel()
    for env in envs_a + envs_b:
        await wait_state(broker, env.id, TaskState.PENDING)
        assert (await broker.get_task(env.id)).retried == 0
    closing = await session.registers.wait_for(
        lambda m: m.gateway == session.gateway and m.closing, count=2
    )
    assert sorted(m.queue for m in closing) == ["a", "b"]


async def test_server_stop_releases_and_tells_the_worker_to_reconnect(
    make_api: MakeApi, broker: CountingBroker, bus: Bus
) -> None:
    api = await make_api()
    registers = await Recorder(cluster_pb2.Register).start(bus, queue="q")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        worker = WorkerStream(ch)
        welcome = await worker.hello({"q": 1}, 1)
        await registers.wait_for(lambda m: m.gateway == welcome.session_id)
        [env] = await leased(broker, "q", 1)
        await dispatch(bus, welcome.session_id, "q", [env])
        await worker.read_kind("dispatch")
        await api.stop()
        assert await state_of(broker, env.id) is TaskState.PENDING
        assert await worker.status() == grpc.StatusCode.UNAVAILABLE
    await registers.wait_for(lambda m: m.closing)
    await registers.stop()


async def test_dispatch_after_close_is_refused(
    open_session: Any, broker: CountingBroker, api: ApiServer
) -> None:
    session: Session = await open_session({"q": 1}, 1)
    gateway = api.registry.gateways[session.gateway]
    session.worker.cancel()
    await wait_until(lambda: gateway.closed, message="gateway closed")
    [env] = await leased(broker, "q", 1)
    assert list(gateway.accept(cluster_pb2.DispatchRequest(queue="q", tasks=[env]))) == []


async def test_many_sessions_in_parallel(
    open_session: Any, broker: CountingBroker, bus: Bus
) -> None:
    sessions: list[Session] = await asyncio.gather(*(open_session({"p": 1}, 2) for _ in range(5)))
    assert len({s.gateway for s in sessions}) == 5
    for session in sessions:
        envs = await leased(broker, "p", 2)
        reply = await dispatch_all(bus, session, envs)
        assert len(reply.accepted) == 2
        for env in envs:
            await session.worker.result(env, service_pb2.OUTCOME_SUCCESS)
    await wait_until(lambda: sum(broker.ack_batch_sizes) == 10, message="10 acks")


async def test_register_is_repeated_every_tick(make_api: MakeApi, bus: Bus) -> None:
    api = await make_api(register_tick=0.05)
    registers = await Recorder(cluster_pb2.Register).start(bus, queue="q")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        worker = WorkerStream(ch)
        welcome = await worker.hello({"q": 1}, 1)
        ticks = await registers.wait_for(lambda m: m.gateway == welcome.session_id, count=4)
        assert not any(m.closing for m in ticks)
        worker.cancel()
    await registers.stop()


async def test_a_hello_with_too_many_batch_types_is_refused(channel: grpc.aio.Channel) -> None:
    worker = WorkerStream(channel)
    hello = service_pb2.Hello(
        queues={"q": 1},
        concurrency=1,
        sdk_version="0.1.0",
        batch_types=[f"t{n}" for n in range(101)],
    )
    await worker.send(service_pb2.WorkerFrame(hello=hello))
    assert await worker.status() == grpc.StatusCode.INVALID_ARGUMENT
    assert "101 batch_types; at most 100" in await worker.details()


# ------------------------------------------------------------ slow readers


async def _read_to_the_end(worker: WorkerStream) -> None:
    while await worker.call.read() is not grpc.aio.EOF:
        pass


@pytest.mark.parametrize(
    "bounds",
    [
        pytest.param({"session_max_pending_frames": 4}, id="too-many-pending-frames"),
        pytest.param({"session_write_timeout": 1.0}, id="write-stuck"),
    ],
)
async def test_a_worker_that_stops_reading_is_disconnected_and_its_tasks_released(
    make_api: MakeApi, broker: CountingBroker, bus: Bus, bounds: dict[str, Any]
) -> None:
    api = await make_api(**bounds)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        registers = await Recorder(cluster_pb2.Register).start(bus)
        worker = WorkerStream(channel)
        welcome = await worker.hello({"q": 1}, 200)
        await registers.wait_for(lambda m: m.gateway == welcome.session_id)
        # Far more than any flow-control window: the worker reads none of it.
        payload = b"x" * (256 * 1024)
        await broker.enqueue_batch([NewTask(queue="q", type="job", payload=payload)] * 60)
        envs = [wire.task_to_envelope(t) for t in await broker.lease("q", 60, TTL)]
        accepted: list[str] = []
        for first in range(0, 60, 2):  # two at a time: one NATS message each
            try:
                reply = await dispatch(bus, welcome.session_id, "q", envs[first : first + 2])
            except nats_errors.NoRespondersError:
                break  # the session has already been ended
            accepted += reply.accepted
        assert len(accepted) >= 6

        async def released() -> bool:
            # The worker still heartbeats all along: only not reading gives it away.
            if not worker.call.done():
                # A write can still race the server's end of the stream.
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await worker.send(service_pb2.WorkerFrame(heartbeat=service_pb2.Heartbeat()))
            states = [await state_of(broker, task_id) for task_id in accepted]
            return all(state is TaskState.PENDING for state in states)

        await wait_until(released, within=20, message="tasks released")
        # What the worker reads, once it reads: what got through, then the status.
        # What the worker reads, once it reads: what got through, then the status.
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await _read_to_the_end(worker)
        assert ended.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "not being read" in (ended.value.details() or "")
        await registers.stop()


async def test_calls_beyond_max_concurrent_rpcs_are_refused(make_api: MakeApi) -> None:
    api = await make_api(max_concurrent_rpcs=2)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        first, second = WorkerStream(channel), WorkerStream(channel)
        await first.hello({"q": 1}, 1)
        await second.hello({"q": 1}, 1)
        # Two sessions in progress: a third call of any kind is refused up front.
        make_stub: Any = service_pb2_grpc.TaskServiceStub
        stub = make_stub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetTask(service_pb2.GetTaskRequest(id="0" * 26))
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        third = WorkerStream(channel)
        with pytest.raises(EOFError, match="RESOURCE_EXHAUSTED"):
            await third.hello({"q": 1}, 1)
        # Once a session ends its slot is free again.
        first.cancel()

        async def served() -> bool:
            try:
                await stub.GetTask(service_pb2.GetTaskRequest(id="0" * 26))
            except grpc.aio.AioRpcError as exc:
                return exc.code() is grpc.StatusCode.NOT_FOUND
            return True

        await wait_until(served, message="a call served after a session ended")
        second.cancel()


async def test_an_idle_session_gets_a_ping_keepalive(
    api: ApiServer, open_session: Any, bus: Bus
) -> None:
    session: Session = await open_session({"a": 1}, 1)
    frame = await session.worker.read_kind("ping", within=30.0)
    assert frame.ping.sent_at.seconds > 0


async def test_credit_n_opens_and_closes_slots_at_run_time(
    open_session: Any, broker: CountingBroker, bus: Bus
) -> None:
    session: Session = await open_session({"q": 1}, 1)
    gateway = session.gateway

    async def credit(n: int, capacity: int) -> None:
        frame = service_pb2.WorkerFrame(credit=service_pb2.Credit(queue="q", n=n))
        await session.worker.send(frame)
        await session.registers.wait_for(
            lambda m: m.gateway == gateway and m.queue == "q" and m.capacity == capacity
        )

    # Two more slots: three tasks of four are taken.
    await credit(2, 3)
    envs = await leased(broker, "q", 4)
    reply = await dispatch_all(bus, session, envs)
    assert len(reply.accepted) == 3
    assert reply.credits == 0
    # Down to one slot: the three held run on, but nothing new is taken until results
    # bring the session under its new count.
    await credit(-2, 1)
    more = await dispatch(bus, gateway, "q", envs[3:])
    assert list(more.accepted) == []
    # Never below zero, and a queue the worker does not serve is ignored.
    await credit(-5, 0)
    await session.worker.send(
        service_pb2.WorkerFrame(credit=service_pb2.Credit(queue="elsewhere", n=3))
    )
    await credit(1, 1)
