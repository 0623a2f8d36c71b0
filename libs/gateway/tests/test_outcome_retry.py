"""Outcomes are never lost: a worker's outcome whose commit fails is retried until it
commits or its lease is gone, its lease extended meanwhile, and a full backlog of them
stops the gateway taking new work.

The broker is a MemoryBroker on a FakeClock that fails the calls it is told to (a
connection cut, as far as the gateway can tell); the bus is the session's nats-server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
from conveyor_broker import (
    AckItem,
    Backoff,
    BrokerClosed,
    FakeClock,
    LeaseReapParams,
    LeaseRef,
    NewTask,
    Task,
    TaskState,
)
from conveyor_broker.memory import MemoryBroker
from conveyor_gateway import AckBatcher, Gateway, GatewayConfig, WakePublisher, WorkerSpec
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.wire import task_to_envelope
from conveyor_testkit.polling import wait_until

TTL = timedelta(seconds=30)


class BrokenConnection(ConnectionError):
    """What the flaky broker raises for a call it fails."""


class FlakyBroker(MemoryBroker):
    """A MemoryBroker whose outcome calls fail while told to.

    ``failing[op]`` is how many more calls of ``op`` ("ack_batch", "fail", "archive",
    "release", "extend_leases") fail; ``down`` fails every one of them until cleared.
    Committed outcomes are counted per task in ``committed``; the leases each
    ``extend_leases`` call named are kept in ``extended``.
    """

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.failing: Counter[str] = Counter()
        self.down = False
        #: Calls refused on purpose (a BrokerError): not worth retrying.
        self.refusing: set[str] = set()
        self.refused: Counter[str] = Counter()
        self.committed: Counter[str] = Counter()
        self.extended: list[list[str]] = []

    def _trip(self, op: str) -> None:
        if op in self.refusing:
            self.refused[op] += 1
            raise BrokerClosed(f"{op}: refused")
        if self.down:
            raise BrokenConnection(f"{op}: connection lost")
        if self.failing[op] > 0:
            self.failing[op] -= 1
            raise BrokenConnection(f"{op}: connection lost")

    async def ack_batch(self, items: Sequence[AckItem]) -> list[bool]:
        self._trip("ack_batch")
        acked = await super().ack_batch(items)
        for item, ok in zip(items, acked, strict=True):
            if ok:
                self.committed[item.task_id] += 1
        return acked

    async def fail(
        self,
        task_id: str,
        lease_id: str,
        error: str,
        retry_delay: timedelta,
        *,
        skip_retry: bool = False,
    ) -> Task:
        self._trip("fail")
        task = await super().fail(task_id, lease_id, error, retry_delay, skip_retry=skip_retry)
        self.committed[task_id] += 1
        return task

    async def archive(self, task_id: str, lease_id: str, error: str) -> Task:
        self._trip("archive")
        task = await super().archive(task_id, lease_id, error)
        self.committed[task_id] += 1
        return task

    async def release(self, task_id: str, lease_id: str) -> Task:
        self._trip("release")
        task = await super().release(task_id, lease_id)
        self.committed[task_id] += 1
        return task

    async def extend_leases(self, leases: Sequence[LeaseRef], ttl: timedelta) -> list[LeaseRef]:
        self._trip("extend_leases")
        self.extended.append([ref.lease_id for ref in leases])
        return await super().extend_leases(leases, ttl)


class Rig:
    """A gateway (not started: offers go to :meth:`Gateway.accept`) over a FlakyBroker."""

    def __init__(self, bus: Bus, clock: FakeClock) -> None:
        self.clock = clock
        self.broker = FlakyBroker(clock)
        self.acks = AckBatcher(self.broker)
        self.wakes = WakePublisher(bus)
        self.bus = bus
        self.made: list[Gateway] = []

    def gateway(self, concurrency: int = 4, **config: Any) -> Gateway:
        gateway = Gateway(
            "gw-retry",
            WorkerSpec(queues={"q": 1}, concurrency=concurrency, worker_id="w"),
            broker=self.broker,
            bus=self.bus,
            config=GatewayConfig(
                lease_ttl=TTL,
                register_tick=60.0,
                max_result=100,
                backoff=Backoff(jitter=0.0),
                clock=self.clock,
                outcome_retry_first=0.005,
                outcome_retry_max=0.02,
                **config,
            ),
            acks=self.acks,
            wakes=self.wakes,
            transport=_Silent(),
            connected_at=self.clock.now(),
        )
        self.made.append(gateway)
        return gateway

    async def held(self, gateway: Gateway, n: int, **fields: Any) -> list[Task]:
        for _ in range(n):
            await self.broker.enqueue(NewTask(queue="q", type="t", **fields))
        tasks = await self.broker.lease("q", n, TTL)
        request = cluster_pb2.DispatchRequest(
            queue="q", dispatcher="test", tasks=[task_to_envelope(t) for t in tasks]
        )
        assert len(gateway.accept(request)) == n
        return tasks

    async def get(self, task: Task) -> Task:
        return await self.broker.get_task(task.id)


class _Silent:
    def dispatch(self, tasks: Any) -> None:
        pass

    def dispatch_batch(self, batch: service_pb2.BatchDispatch) -> None:
        pass

    def cancel(self, task_id: str, lease_id: str, reason: str) -> None:
        pass


@pytest.fixture
async def rig(bus: Bus, clock: FakeClock) -> AsyncIterator[Rig]:
    r = Rig(bus, clock)
    yield r
    r.broker.down = False
    r.broker.failing.clear()
    for gateway in r.made:
        await wait_until(_drained(gateway), message="backlog drained")
        await gateway.close()
    await r.acks.aclose()
    await r.wakes.aclose()
    await r.broker.close()


def _drained(gateway: Gateway) -> Callable[[], bool]:
    return lambda: gateway.backlog == 0


def result(task: Task, outcome: service_pb2.Outcome, **fields: Any) -> service_pb2.Result:
    assert task.lease_id is not None
    return service_pb2.Result(task_id=task.id, lease_id=task.lease_id, outcome=outcome, **fields)


# ------------------------------------------------------------ retried once each


async def test_each_outcome_is_retried_until_it_commits_once(rig: Rig) -> None:
    gateway = rig.gateway()
    acked, failed, skipped, released = await rig.held(gateway, 4, max_retry=3)
    for op in ("ack_batch", "fail", "archive", "release"):
        rig.broker.failing[op] = 3

    gateway.on_results(
        [
            result(acked, service_pb2.OUTCOME_SUCCESS, result=b"ok"),
            result(failed, service_pb2.OUTCOME_FAILURE, error="boom"),
            result(skipped, service_pb2.OUTCOME_SKIP_RETRY, error="no"),
            result(released, service_pb2.OUTCOME_RELEASE),
        ]
    )

    # The slots are free at once; the outcomes are held until they commit.
    assert gateway.free("q") == 4
    await wait_until(lambda: gateway.backlog == 4, message="all four pending")

    async def committed() -> bool:
        states = [(await rig.get(t)).state for t in (acked, failed, skipped, released)]
        return gateway.backlog == 0 and states == [
            TaskState.COMPLETED,
            TaskState.RETRY,
            TaskState.ARCHIVED,
            TaskState.PENDING,
        ]

    await wait_until(committed, message="every outcome committed")
    assert (await rig.get(acked)).result == b"ok"
    assert (await rig.get(failed)).last_error == "boom"
    assert (await rig.get(skipped)).last_error == "no"
    # Skip-retry stayed a skip-retry: archived with its retries left, not retried.
    assert (await rig.get(skipped)).retried == 0
    assert rig.broker.committed == {t.id: 1 for t in (acked, failed, skipped, released)}
    assert rig.broker.failing == Counter(dict.fromkeys(rig.broker.failing, 0))
    assert gateway.outcomes_retried >= 4


async def test_a_success_of_a_last_attempt_is_not_archived_while_its_ack_is_retried(
    rig: Rig,
) -> None:
    gateway = rig.gateway()
    (task,) = await rig.held(gateway, 1, max_retry=0)
    rig.clock.advance(timedelta(seconds=20))
    rig.broker.down = True
    gateway.on_results([result(task, service_pb2.OUTCOME_SUCCESS, result=b"done")])
    await wait_until(lambda: gateway.backlog == 1)

    # The database comes back for the lease extension only: the lease is carried past its
    # old expiry, so the reaper finds nothing to take back.
    rig.broker.down = False
    rig.broker.failing["ack_batch"] = 10**6
    await wait_until(lambda: any(task.lease_id in e for e in rig.broker.extended))
    stored = await rig.get(task)
    assert stored.lease_expires_at == rig.clock.now() + TTL
    rig.clock.advance(timedelta(seconds=15))  # past the lease the worker was given
    assert task.lease_expires_at is not None
    assert rig.clock.now() > task.lease_expires_at
    assert await rig.broker.reap_expired_leases(LeaseReapParams()) == []

    rig.broker.failing.clear()
    await wait_until(lambda: gateway.backlog == 0)
    stored = await rig.get(task)
    assert (stored.state, stored.result) == (TaskState.COMPLETED, b"done")
    assert rig.broker.committed[task.id] == 1


# ------------------------------------------------------------------ lease lost


async def test_a_lost_lease_stops_the_retry(rig: Rig) -> None:
    gateway = rig.gateway()
    acked, failed = await rig.held(gateway, 2, max_retry=5)
    rig.broker.down = True
    gateway.on_results(
        [
            result(acked, service_pb2.OUTCOME_SUCCESS, result=b"late"),
            result(failed, service_pb2.OUTCOME_FAILURE, error="boom"),
        ]
    )
    await wait_until(lambda: gateway.backlog == 2)

    # Nothing reached the database for longer than the lease: the reaper took both back.
    rig.clock.advance(TTL + timedelta(seconds=1))
    rig.broker.down = False
    rig.broker.failing["extend_leases"] = 10**6  # retries reach the broker's lease check
    reaped = await rig.broker.reap_expired_leases(LeaseReapParams())
    assert {r.task_id for r in reaped} == {acked.id, failed.id}

    await wait_until(lambda: gateway.backlog == 0, message="retries stopped")
    for task in (acked, failed):
        stored = await rig.get(task)
        assert stored.state == TaskState.RETRY
        assert stored.result is None
    assert rig.broker.committed == Counter()


async def test_a_lease_found_lost_on_extension_stops_the_retry(rig: Rig) -> None:
    gateway = rig.gateway()
    (task,) = await rig.held(gateway, 1, max_retry=5)
    rig.broker.down = True
    gateway.on_results([result(task, service_pb2.OUTCOME_RELEASE)])
    await wait_until(lambda: gateway.backlog == 1)
    rig.clock.advance(TTL + timedelta(seconds=1))
    rig.broker.down = False
    rig.broker.failing["release"] = 10**6
    await rig.broker.reap_expired_leases(LeaseReapParams())

    await wait_until(lambda: gateway.backlog == 0)
    assert (await rig.get(task)).state == TaskState.RETRY
    assert rig.broker.committed == Counter()


async def test_an_outcome_the_broker_refuses_on_purpose_is_not_retried(rig: Rig) -> None:
    gateway = rig.gateway()
    (task,) = await rig.held(gateway, 1)
    rig.broker.refusing.add("release")

    gateway.on_results([result(task, service_pb2.OUTCOME_RELEASE)])

    # The refusal is handled in the step that raised it: by the time it is seen here,
    # a retry would have been queued.
    await wait_until(lambda: rig.broker.refused["release"] == 1)
    assert (gateway.backlog, gateway.outcomes_retried) == (0, 0)
    assert (await rig.get(task)).state == TaskState.ACTIVE  # the reaper's, in time
    rig.broker.refusing.clear()


# ---------------------------------------------------------------- backpressure


async def test_a_full_backlog_stops_new_work_until_it_drains(rig: Rig) -> None:
    registers: list[cluster_pb2.Register] = []

    def heard(register: cluster_pb2.Register) -> None:
        if register.gateway == "gw-retry":
            registers.append(register)

    sub = await rig.bus.subscribe(cluster_pb2.Register, heard, queue="q")
    try:
        gateway = rig.gateway(concurrency=4, outcome_backlog=3)
        await gateway.start()
        tasks = await rig.held(gateway, 4)
        rig.broker.down = True

        gateway.on_results([result(t, service_pb2.OUTCOME_SUCCESS) for t in tasks[:2]])
        await wait_until(lambda: gateway.backlog == 2)
        assert (gateway.held_back, gateway.free("q")) == (False, 2)

        gateway.on_results([result(tasks[2], service_pb2.OUTCOME_SUCCESS)])
        await wait_until(lambda: gateway.backlog == 3)
        assert gateway.held_back
        assert gateway.free("q") == 0  # though three slots are empty
        await wait_until(lambda: bool(registers) and registers[-1].capacity == 0)
        # An offer gets nothing accepted.
        rig.broker.down = False
        await rig.broker.enqueue(NewTask(queue="q", type="t"))
        offered = await rig.broker.lease("q", 1, TTL)
        rig.broker.down = True
        refused = cluster_pb2.DispatchRequest(
            queue="q", dispatcher="test", tasks=[task_to_envelope(t) for t in offered]
        )
        assert gateway.accept(refused) == []

        rig.broker.down = False
        await wait_until(_drained(gateway))
        assert (gateway.held_back, gateway.free("q")) == (False, 3)
        await wait_until(lambda: registers[-1].capacity == 4)
    finally:
        await sub.unsubscribe()
