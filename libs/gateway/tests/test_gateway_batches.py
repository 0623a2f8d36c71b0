"""Aggregation-group batches in the Gateway: a MemoryBroker on a FakeClock, the session's
nats-server, and a transport that records what the worker would have been sent, as in
test_gateway.py.

A batch is an aggregation group's members leased together (``Broker.lease_group``: one
lease id for all of them) and offered in one DispatchRequest with ``group`` set: the
gateway takes it whole, for one slot, or refuses it whole; the worker answers it with one
BatchResult (:meth:`Gateway.on_batch_result`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from conveyor_broker import Backoff, FakeClock, NewTask, Task, TaskState
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.types import CANCELED_WHILE_RUNNING_ERROR
from conveyor_gateway import AckBatcher, Gateway, GatewayConfig, WakePublisher, WorkerSpec
from conveyor_gateway.attempt_bounds import SERVER_TIMEOUT_ERROR, TIMEOUT_CANCEL_REASON
from conveyor_gateway.credits import REDELIVERED_REASON
from conveyor_gateway.gateway import LEASE_LOST_REASON, MISSING_FROM_BATCH
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.wire import task_to_envelope
from conveyor_testkit.polling import wait_until
from conveyor_testkit.transport import RecordingTransport as Recording

TTL = timedelta(seconds=30)
#: One second, then two, ...: exact, so retry times can be checked.
BACKOFF = Backoff(jitter=0.0)
#: The task type the worker takes as batches.
BATCHED = "digest"


@dataclass
class Parts:
    """What a gateway is built from."""

    broker: MemoryBroker
    bus: Bus
    clock: FakeClock
    acks: AckBatcher
    wakes: WakePublisher
    #: Every gateway made, closed after the test: their attempt timers must not outlive it.
    made: list[Gateway] = field(default_factory=list)

    def config(self, **fields: Any) -> GatewayConfig:
        return GatewayConfig(
            lease_ttl=TTL,
            register_tick=60.0,
            max_result=100,
            backoff=BACKOFF,
            clock=self.clock,
            **fields,
        )

    def gateway(
        self,
        concurrency: int = 2,
        batch_types: tuple[str, ...] = (BATCHED,),
        config: GatewayConfig | None = None,
        **options: Any,
    ) -> tuple[Gateway, Recording]:
        transport = Recording()
        spec = WorkerSpec(
            queues={"q": 1}, concurrency=concurrency, worker_id="w", batch_types=batch_types
        )
        gateway = Gateway(
            "gw-batch",
            spec,
            broker=self.broker,
            bus=self.bus,
            config=config or self.config(),
            acks=self.acks,
            wakes=self.wakes,
            transport=transport,
            connected_at=self.clock.now(),
            **options,
        )
        self.made.append(gateway)
        return gateway, transport

    async def grouped(
        self,
        n: int,
        group: str = "g",
        task_type: str = BATCHED,
        *,
        types: Sequence[str] = (),
        **fields: Any,
    ) -> list[Task]:
        """``n`` members of ``group`` (of ``task_type``, or of ``types`` one apiece),
        leased together: the batch, under one lease id."""
        for i in range(n):
            kind = types[i] if types else task_type
            await self.broker.enqueue(NewTask(queue="q", type=kind, group=group, **fields))
            self.clock.advance(timedelta(milliseconds=1))  # leased in this order
        tasks = await self.broker.lease_group("q", group, n, TTL)
        assert len(tasks) == n
        return tasks

    async def single(self) -> Task:
        await self.broker.enqueue(NewTask(queue="q", type="single"))
        (task,) = await self.broker.lease("q", 1, TTL)
        return task

    async def state(self, task_id: str) -> TaskState:
        return (await self.broker.get_task(task_id)).state

    async def states(self, tasks: Sequence[Task]) -> list[TaskState]:
        return [await self.state(t.id) for t in tasks]


@pytest.fixture
async def parts(bus: Bus, clock: FakeClock) -> AsyncIterator[Parts]:
    broker = MemoryBroker(clock)
    p = Parts(broker, bus, clock, AckBatcher(broker), WakePublisher(bus))
    yield p
    for gateway in p.made:
        await gateway.close()
    await p.acks.aclose()
    await p.wakes.aclose()
    await broker.close()


def batch_offer(
    tasks: Sequence[Task] | Sequence[task_pb2.TaskEnvelope], group: str = "g"
) -> cluster_pb2.DispatchRequest:
    envelopes = [t if isinstance(t, task_pb2.TaskEnvelope) else task_to_envelope(t) for t in tasks]
    return cluster_pb2.DispatchRequest(queue="q", dispatcher="test", tasks=envelopes, group=group)


def offer(tasks: Sequence[Task]) -> cluster_pb2.DispatchRequest:
    return cluster_pb2.DispatchRequest(
        queue="q", dispatcher="test", tasks=[task_to_envelope(t) for t in tasks]
    )


def lease_of(task: Task) -> str:
    assert task.lease_id is not None
    return task.lease_id


def result(task: Task, outcome: service_pb2.Outcome, **fields: Any) -> service_pb2.Result:
    return service_pb2.Result(task_id=task.id, lease_id=lease_of(task), outcome=outcome, **fields)


def returned(gateway: Gateway) -> int:
    """The slots the gateway gave back on "q" so far (what its Dones count)."""
    return gateway._done.returned("q")


# ------------------------------------------------------------- accepting


async def test_a_batch_takes_one_slot_and_goes_to_the_worker_in_one_call(parts: Parts) -> None:
    gateway, transport = parts.gateway(concurrency=2)
    members = await parts.grouped(3)

    accepted = gateway.accept(batch_offer(members))

    assert accepted == [t.id for t in members]
    assert (gateway.in_flight, gateway.free("q")) == (1, 1)
    assert transport.dispatched == []
    (sent,) = transport.batches
    assert (sent.queue, sent.group, sent.type) == ("q", "g", BATCHED)
    assert [env.id for env in sent.tasks] == accepted
    assert {env.lease_id for env in sent.tasks} == {lease_of(members[0])}
    assert gateway.holds_lease(lease_of(members[0]))
    assert all(gateway.holds(t.id) for t in members)


async def test_a_batch_needs_only_one_free_slot_whatever_its_size(parts: Parts) -> None:
    gateway, transport = parts.gateway(concurrency=2)
    single = await parts.single()
    assert gateway.accept(offer([single])) == [single.id]
    members = await parts.grouped(5)

    assert gateway.accept(batch_offer(members)) == [t.id for t in members]
    assert (gateway.in_flight, gateway.free("q")) == (2, 0)
    assert len(transport.batches) == 1


async def test_a_batch_with_no_free_slot_is_refused_whole(parts: Parts) -> None:
    gateway, transport = parts.gateway(concurrency=1)
    single = await parts.single()
    gateway.accept(offer([single]))
    members = await parts.grouped(2)

    assert gateway.accept(batch_offer(members)) == []
    assert transport.batches == []
    assert not any(gateway.holds(t.id) for t in members)
    assert (gateway.in_flight, gateway.free("q")) == (1, 0)


async def test_a_batch_of_a_type_the_worker_takes_one_by_one_is_refused_whole(
    parts: Parts,
) -> None:
    gateway, transport = parts.gateway(concurrency=2, batch_types=("other",))
    members = await parts.grouped(2)

    assert gateway.accept(batch_offer(members)) == []
    assert transport.batches == []
    assert transport.dispatched == []
    assert (gateway.in_flight, gateway.free("q")) == (0, 2)
    # A worker that takes no batch at all refuses it too.
    plain, plain_transport = parts.gateway(concurrency=2, batch_types=())
    assert plain.accept(batch_offer(members)) == []
    assert plain_transport.batches == []
    assert plain.free("q") == 2


async def test_a_batch_mixing_types_is_refused_whole(parts: Parts) -> None:
    gateway, transport = parts.gateway(concurrency=2, batch_types=(BATCHED, "other"))
    members = await parts.grouped(3, types=[BATCHED, BATCHED, "other"])
    assert {lease_of(t) for t in members} == {lease_of(members[0])}

    assert gateway.accept(batch_offer(members)) == []
    assert transport.batches == []
    assert not any(gateway.holds(t.id) for t in members)
    assert (gateway.in_flight, gateway.free("q")) == (0, 2)


async def test_a_batch_mixing_leases_is_refused_whole(parts: Parts) -> None:
    gateway, transport = parts.gateway(concurrency=2)
    first = await parts.grouped(2, group="a")
    second = await parts.grouped(1, group="b")
    assert lease_of(first[0]) != lease_of(second[0])

    assert gateway.accept(batch_offer([*first, *second], group="a")) == []
    assert transport.batches == []
    assert not any(gateway.holds(t.id) for t in [*first, *second])
    assert (gateway.in_flight, gateway.free("q")) == (0, 2)


async def test_a_batch_whose_lease_is_held_already_is_refused_whole(parts: Parts) -> None:
    gateway, transport = parts.gateway(concurrency=3)
    members = await parts.grouped(2)
    assert gateway.accept(batch_offer(members)) == [t.id for t in members]

    # The same batch offered again (a dispatcher's retry, a forged offer).
    assert gateway.accept(batch_offer(members)) == []
    assert len(transport.batches) == 1
    assert (gateway.in_flight, gateway.free("q")) == (1, 2)
    # A batch whose lease one of the gateway's single deliveries holds.
    single = await parts.single()
    gateway.accept(offer([single]))
    forged = [task_to_envelope(t) for t in await parts.grouped(2, group="h")]
    for env in forged:
        env.lease_id = lease_of(single)
    assert gateway.accept(batch_offer(forged, group="h")) == []
    assert (gateway.in_flight, gateway.free("q")) == (2, 1)
    assert gateway.holds(single.id)
    assert len(transport.batches) == 1


async def test_an_empty_or_malformed_batch_is_refused(parts: Parts) -> None:
    gateway, transport = parts.gateway(concurrency=2)
    assert gateway.accept(batch_offer([])) == []
    members = await parts.grouped(2)
    envelopes = [task_to_envelope(t) for t in members]
    twice = [envelopes[0], envelopes[0]]
    assert gateway.accept(batch_offer(twice)) == []
    no_lease = [task_to_envelope(t) for t in members]
    for env in no_lease:
        env.lease_id = ""
    assert gateway.accept(batch_offer(no_lease)) == []
    elsewhere = [task_to_envelope(t) for t in members]
    elsewhere[1].queue = "elsewhere"
    assert gateway.accept(batch_offer(elsewhere)) == []
    assert transport.batches == []
    assert gateway.free("q") == 2


async def test_a_member_held_under_an_older_lease_is_dropped_on_the_worker(
    parts: Parts,
) -> None:
    gateway, transport = parts.gateway(concurrency=3)
    members = await parts.grouped(2)
    # Its first member was held alone (an older delivery the gateway never let go of).
    assert gateway.accept(offer(members[:1])) == [members[0].id]
    newer = [task_to_envelope(t) for t in members]
    for env in newer:
        env.lease_id = "a-newer-lease"

    assert gateway.accept(batch_offer(newer)) == [t.id for t in members]
    assert transport.canceled == [(members[0].id, lease_of(members[0]), REDELIVERED_REASON)]
    assert not gateway.holds_lease(lease_of(members[0]))
    assert gateway.holds_lease("a-newer-lease")
    assert (gateway.in_flight, gateway.free("q")) == (1, 2)


async def test_registrations_name_the_types_taken_as_batches(parts: Parts) -> None:
    heard: list[cluster_pb2.Register] = []
    await parts.bus.subscribe(cluster_pb2.Register, heard.append, queue="q")
    await parts.bus.nc.flush()
    gateway, _ = parts.gateway(batch_types=(BATCHED, "other"))
    await gateway.start()
    await wait_until(lambda: bool(heard), within=5)
    assert list(heard[0].batch_types) == [BATCHED, "other"]


# ---------------------------------------------------------------- results


async def test_a_batch_result_applies_each_members_outcome_and_frees_the_slot_once(
    parts: Parts,
) -> None:
    gateway, _ = parts.gateway(concurrency=2)
    done, failed, forgotten = members = await parts.grouped(3)
    gateway.accept(batch_offer(members))
    before = returned(gateway)

    gateway.on_batch_result(
        [
            result(done, service_pb2.OUTCOME_SUCCESS, result=b"ok"),
            result(failed, service_pb2.OUTCOME_FAILURE, error="boom"),
        ]
    )

    assert (gateway.in_flight, gateway.free("q")) == (0, 2)
    assert returned(gateway) == before + 1
    assert not any(gateway.holds(t.id) for t in members)

    async def applied() -> bool:
        return await parts.states(members) == [
            TaskState.COMPLETED,
            TaskState.AGGREGATING,
            TaskState.AGGREGATING,
        ]

    await wait_until(applied)
    assert (await parts.broker.get_task(done.id)).result == b"ok"
    retry_at = parts.clock.now() + BACKOFF.delay(0)
    for task, error in ((failed, "boom"), (forgotten, MISSING_FROM_BATCH)):
        stored = await parts.broker.get_task(task.id)
        assert (stored.last_error, stored.retried, stored.lease_id) == (error, 1, None)
        assert stored.available_at == retry_at
    # Back in their group, waiting out their retry.
    assert [(s.group, s.size) for s in await parts.broker.group_stats("q")] == [("g", 2)]
    # A second BatchResult for the same lease changes nothing (and frees nothing).
    gateway.on_batch_result([result(failed, service_pb2.OUTCOME_SUCCESS)])
    assert returned(gateway) == before + 1
    assert await parts.state(failed.id) == TaskState.AGGREGATING


async def test_a_batch_result_with_every_member_a_success_acks_them_all(parts: Parts) -> None:
    gateway, _ = parts.gateway(concurrency=1)
    members = await parts.grouped(4)
    gateway.accept(batch_offer(members))

    gateway.on_batch_result(
        [result(t, service_pb2.OUTCOME_SUCCESS, result=t.id.encode()) for t in members]
    )

    async def completed() -> bool:
        return await parts.states(members) == [TaskState.COMPLETED] * 4

    await wait_until(completed)
    assert [(await parts.broker.get_task(t.id)).result for t in members] == [
        t.id.encode() for t in members
    ]
    assert gateway.free("q") == 1


async def test_a_member_released_or_skipped_in_a_batch_result(parts: Parts) -> None:
    gateway, _ = parts.gateway(concurrency=1)
    released, skipped = members = await parts.grouped(2)
    gateway.accept(batch_offer(members))

    gateway.on_batch_result(
        [
            result(released, service_pb2.OUTCOME_RELEASE),
            result(skipped, service_pb2.OUTCOME_SKIP_RETRY, error="no"),
        ]
    )

    async def applied() -> bool:
        return await parts.states(members) == [TaskState.AGGREGATING, TaskState.ARCHIVED]

    await wait_until(applied)
    assert (await parts.broker.get_task(released.id)).retried == 0


async def test_results_under_another_lease_in_a_batch_result_are_ignored(parts: Parts) -> None:
    gateway, _ = parts.gateway(concurrency=2)
    members = await parts.grouped(2)
    single = await parts.single()
    gateway.accept(batch_offer(members))
    gateway.accept(offer([single]))

    gateway.on_batch_result(
        [
            result(members[0], service_pb2.OUTCOME_SUCCESS),
            result(single, service_pb2.OUTCOME_SUCCESS),
            result(members[1], service_pb2.OUTCOME_SUCCESS),
        ]
    )

    async def completed() -> bool:
        return await parts.states(members) == [TaskState.COMPLETED] * 2

    await wait_until(completed)
    # The single task's Result did not belong there: it is still held, still running.
    assert gateway.holds(single.id)
    assert await parts.state(single.id) == TaskState.ACTIVE
    assert (gateway.in_flight, gateway.free("q")) == (1, 1)


async def test_a_result_for_a_batch_member_alone_changes_nothing(parts: Parts) -> None:
    gateway, _ = parts.gateway(concurrency=2)
    members = await parts.grouped(2)
    gateway.accept(batch_offer(members))

    gateway.on_results([result(members[0], service_pb2.OUTCOME_SUCCESS)])

    assert gateway.holds_lease(lease_of(members[0]))
    assert (gateway.in_flight, gateway.free("q")) == (1, 1)
    assert await parts.states(members) == [TaskState.ACTIVE] * 2


async def test_a_batch_result_of_single_tasks_is_their_results(parts: Parts) -> None:
    gateway, _ = parts.gateway(concurrency=3)
    done, failed = [await parts.single(), await parts.single()]
    gateway.accept(offer([done, failed]))

    gateway.on_batch_result(
        [
            result(done, service_pb2.OUTCOME_SUCCESS),
            result(failed, service_pb2.OUTCOME_FAILURE, error="boom"),
        ]
    )

    assert (gateway.in_flight, gateway.free("q")) == (0, 3)

    async def applied() -> bool:
        return await parts.states([done, failed]) == [TaskState.COMPLETED, TaskState.RETRY]

    await wait_until(applied)
    gateway.on_batch_result([])  # nothing at all: nothing happens
    assert gateway.free("q") == 3


# ------------------------------------------------- leases, cancel, close


async def test_a_heartbeat_extends_every_members_lease(parts: Parts) -> None:
    extended: list[tuple[list[str], datetime]] = []

    def on_extended(leases: Collection[str], until: datetime) -> None:
        extended.append((sorted(leases), until))

    gateway, _ = parts.gateway(on_extended=on_extended)
    members = await parts.grouped(3)
    gateway.accept(batch_offer(members))
    parts.clock.advance(timedelta(seconds=10))

    gateway.on_heartbeat()

    await wait_until(lambda: bool(extended))
    until = parts.clock.now() + TTL
    assert extended == [([lease_of(members[0])], until)]  # the one lease, once
    for task in members:
        assert (await parts.broker.get_task(task.id)).lease_expires_at == until
    # The extension is known: a batch merely past its old expiry is not looked up.
    parts.clock.advance(TTL - timedelta(seconds=1))
    assert await gateway.check_leases() == 0
    assert gateway.holds_lease(lease_of(members[0]))


async def test_a_batch_is_lost_only_when_every_members_lease_is(parts: Parts) -> None:
    gateway, transport = parts.gateway(concurrency=2)
    members = await parts.grouped(2)
    gateway.accept(batch_offer(members))
    lease_id = lease_of(members[0])

    await parts.broker.cancel_task(members[0].id)  # an operator cancels one member
    gateway.on_heartbeat()
    await wait_until(lambda: not gateway._leases._extending)
    assert gateway.holds_lease(lease_id)
    assert transport.canceled == []

    await parts.broker.release(members[1].id, lease_id)  # behind the gateway's back
    gateway.on_heartbeat()
    await wait_until(lambda: not gateway.holds_lease(lease_id))
    assert transport.canceled == [(members[0].id, lease_id, LEASE_LOST_REASON)]
    assert (gateway.in_flight, gateway.free("q")) == (0, 2)


async def test_cancel_of_a_member_leaves_the_batch_running(parts: Parts) -> None:
    gateway, transport = parts.gateway(concurrency=2)
    canceled, kept = members = await parts.grouped(2)
    gateway.accept(batch_offer(members))
    await parts.broker.cancel_task(canceled.id)

    assert not gateway.cancel(canceled.id, "canceled by an operator")

    assert transport.canceled == []
    assert gateway.holds_lease(lease_of(kept))
    assert gateway.holds(canceled.id)
    assert gateway.holds(kept.id)
    assert (gateway.in_flight, gateway.free("q")) == (1, 1)
    # The batch's answer then applies to the member still leased; the other's is lost.
    gateway.on_batch_result([result(t, service_pb2.OUTCOME_SUCCESS) for t in members])

    async def applied() -> bool:
        return await parts.states(members) == [TaskState.ARCHIVED, TaskState.COMPLETED]

    await wait_until(applied)
    stored = await parts.broker.get_task(canceled.id)
    assert stored.last_error == CANCELED_WHILE_RUNNING_ERROR
    assert gateway.free("q") == 2


async def test_close_releases_every_member_back_to_its_group(parts: Parts) -> None:
    gateway, _ = parts.gateway(concurrency=2)
    members = await parts.grouped(3)
    single = await parts.single()
    gateway.accept(batch_offer(members))
    gateway.accept(offer([single]))

    await gateway.close()

    assert await parts.states(members) == [TaskState.AGGREGATING] * 3
    assert await parts.state(single.id) == TaskState.PENDING
    for task in members:
        stored = await parts.broker.get_task(task.id)
        assert (stored.lease_id, stored.retried) == (None, 0)
    assert [(s.group, s.size) for s in await parts.broker.group_stats("q")] == [("g", 3)]
    assert gateway.accept(batch_offer(await parts.grouped(1, group="h"), group="h")) == []


async def test_a_batch_that_overruns_its_bound_gives_up_every_member(parts: Parts) -> None:
    gateway, transport = parts.gateway(
        concurrency=2, config=parts.config(timeout_grace=timedelta(0))
    )
    # The shortest timeout of its members bounds the batch.
    members = await parts.grouped(2, timeout=timedelta(milliseconds=50))
    gateway.accept(batch_offer(members))
    assert gateway.timed == 1
    lease_id = lease_of(members[0])

    await wait_until(lambda: not gateway.holds_lease(lease_id), within=5)
    assert transport.canceled == [(members[0].id, lease_id, TIMEOUT_CANCEL_REASON)]
    assert (gateway.in_flight, gateway.free("q")) == (0, 2)

    async def given_up() -> bool:
        return await parts.states(members) == [TaskState.AGGREGATING] * 2

    await wait_until(given_up)
    for task in members:
        assert (await parts.broker.get_task(task.id)).last_error == SERVER_TIMEOUT_ERROR


# ------------------------------------------------------------ known gaps


async def test_a_batch_merely_late_is_kept_though_its_first_member_was_canceled(
    parts: Parts,
) -> None:
    """check_leases looks at the batch's first member only: once that one is canceled,
    a batch past its known expiry (a heartbeat late, the other members still leased to
    this worker) is dropped whole, though a batch is lost only when every member's lease
    is (as the heartbeat has it)."""
    gateway, transport = parts.gateway(concurrency=2)
    canceled, kept = members = await parts.grouped(2)
    gateway.accept(batch_offer(members))
    await parts.broker.cancel_task(canceled.id)
    parts.clock.advance(TTL + timedelta(seconds=5))
    assert await parts.state(kept.id) == TaskState.ACTIVE  # not reaped: still this worker's

    assert await gateway.check_leases() == 0
    assert transport.canceled == []
    assert gateway.holds_lease(lease_of(kept))


async def test_resolving_one_member_of_a_held_batch_leaves_the_batch_held(parts: Parts) -> None:
    """Gateway.resolve (a webhook's ReportResult callback) takes a Result naming the
    batch's first member for the whole batch: the batch is freed and let go of, its
    other members left leased with nobody extending them or applying their outcome. A
    batch is answered by one BatchResult; one member's out-of-band Result should be the
    lease-scoped call alone (as for any other member)."""
    gateway, _ = parts.gateway(concurrency=2)
    first, second = members = await parts.grouped(2)
    gateway.accept(batch_offer(members))

    assert await gateway.resolve(result(first, service_pb2.OUTCOME_SUCCESS), queue="q")

    assert await parts.state(first.id) == TaskState.COMPLETED
    assert gateway.holds_lease(lease_of(second))
    assert gateway.holds(second.id)
    assert (gateway.in_flight, gateway.free("q")) == (1, 1)


async def test_extend_held_of_a_batch_extends_every_member(parts: Parts) -> None:
    """Gateway.extend_held (a webhook's Heartbeat callback) names a task and a lease: for
    a batch's first member it extends that member's lease alone, yet records the batch's
    expiry as extended (so the other members' leases may run out unseen)."""
    gateway, _ = parts.gateway(concurrency=2)
    members = await parts.grouped(2)
    gateway.accept(batch_offer(members))
    parts.clock.advance(timedelta(seconds=10))

    expires = await gateway.extend_held(members[0].id, lease_of(members[0]))

    assert expires == parts.clock.now() + TTL
    for task in members:
        assert (await parts.broker.get_task(task.id)).lease_expires_at == expires
