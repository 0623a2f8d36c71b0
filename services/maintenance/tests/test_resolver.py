"""The dependency resolver role and the reaper's sweep behind it, against a real
nats-server and a real broker (memory and Postgres) on a FakeClock."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from conveyor_broker.clock import FakeClock
from conveyor_broker.interface import Broker
from conveyor_broker.types import NewTask, OnFailure, Resolution, Task, TaskState
from conveyor_maintenance import Maintenance
from conveyor_maintenance.resolver import RESOLVER
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.nats_connect import NatsClient
from conveyor_runtime.settings import MaintenanceSettings
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.polling import wait_until
from nats.aio.msg import Msg

TTL = timedelta(seconds=30)


class WakeLog:
    """The queues of every Wake published under the test's prefix."""

    def __init__(self) -> None:
        self.queues: list[str] = []

    async def on_msg(self, msg: Msg) -> None:
        self.queues.append(cluster_pb2.Wake.FromString(msg.data).queue)


@pytest.fixture
async def wakes(nc: NatsClient, subjects: Subjects) -> WakeLog:
    log = WakeLog()
    await nc.subscribe(subjects.queue_wildcard("wake"), cb=log.on_msg)
    await nc.flush()
    return log


@pytest.fixture
async def maintenance(
    broker: Broker, nc: NatsClient, clock: FakeClock, nats_url: str, subjects: Subjects
) -> AsyncIterator[Callable[..., Awaitable[Maintenance]]]:
    started: list[Maintenance] = []

    async def start(**overrides: Any) -> Maintenance:
        fields: dict[str, Any] = {
            "nats_url": nats_url,
            "subject_prefix": subjects.prefix,
            "broker": "memory",
            "instance_id": f"maint-{uuid.uuid4().hex[:6]}",
            "promote_tick": 0.05,
            "reap_tick": 0.05,
            "storage_tick": 0.05,
            "leader_ttl": 1.0,
            # The resolver's, unless a test wants the sweep.
            "resolve_sweep_age": 3600.0,
            **overrides,
        }
        m = Maintenance(MaintenanceSettings(**fields), broker, nc, clock)
        await m.start()
        started.append(m)
        return m

    try:
        yield start
    finally:
        for m in started:
            await m.stop()


async def _end(broker: Broker, task: Task, *, ok: bool = True) -> None:
    [leased] = await broker.lease(task.queue, 1, TTL)
    assert leased.id == task.id
    if ok:
        await broker.ack(leased.id, leased.lease_id or "")
    else:
        await broker.fail(leased.id, leased.lease_id or "", "boom", TTL, skip_retry=True)


def _state_is(broker: Broker, task: Task, state: TaskState) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await broker.get_task(task.id)).state is state

    return check


async def _leading(m: Maintenance) -> None:
    await wait_until(lambda: m.resolver.leading, within=10)


async def test_a_resolve_promotes_the_dependents_and_wakes_their_queue(
    broker: Broker,
    bus: Bus,
    wakes: WakeLog,
    maintenance: Callable[..., Awaitable[Maintenance]],
) -> None:
    dep = (await broker.enqueue(NewTask("first", "t"))).task
    after = (await broker.enqueue(NewTask("after", "t", depends_on=(dep.id,)))).task
    m = await maintenance()
    await _leading(m)
    await _end(broker, dep)
    # What an api process publishes once the ack commits.
    await bus.publish(cluster_pb2.Resolve(task_ids=[dep.id]))
    await wait_until(_state_is(broker, after, TaskState.PENDING), within=10)
    await wait_until(lambda: "after" in wakes.queues, within=10)
    assert m.resolver.edges == 1


async def test_a_cascade_goes_down_every_level_from_one_resolve(
    broker: Broker, bus: Bus, maintenance: Callable[..., Awaitable[Maintenance]]
) -> None:
    root = (await broker.enqueue(NewTask("root", "t"))).task
    chain = [root]
    for level in range(3):
        new = NewTask(
            f"l{level}", "t", depends_on=(chain[-1].id,), on_failure=OnFailure.CASCADE_CANCEL
        )
        chain.append((await broker.enqueue(new)).task)
    m = await maintenance(sweep_limit=1)
    await _leading(m)
    await _end(broker, root, ok=False)
    await bus.publish(cluster_pb2.Resolve(task_ids=[root.id]))
    for task in chain[1:]:
        await wait_until(_state_is(broker, task, TaskState.CANCELED), within=10)
    # One level per call: bounded work, resumed from what each call returned.
    assert m.resolver.calls >= 3


async def test_the_ends_maintenance_makes_itself_are_resolved_at_once(
    broker: Broker, clock: FakeClock, maintenance: Callable[..., Awaitable[Maintenance]]
) -> None:
    dep = (await broker.enqueue(NewTask("doomed", "t", max_retry=0))).task
    runs = (
        await broker.enqueue(
            NewTask("runs", "t", depends_on=(dep.id,), on_failure=OnFailure.CONTINUE)
        )
    ).task
    await broker.lease("doomed", 1, TTL)
    m = await maintenance()
    await _leading(m)
    clock.advance(TTL)  # the reaper archives the task; its end reaches the resolver
    await wait_until(_state_is(broker, runs, TaskState.PENDING), within=10)


async def test_the_sweep_resolves_an_end_nobody_announced(
    broker: Broker, wakes: WakeLog, maintenance: Callable[..., Awaitable[Maintenance]]
) -> None:
    dep = (await broker.enqueue(NewTask("silent", "t"))).task
    after = (await broker.enqueue(NewTask("later", "t", depends_on=(dep.id,)))).task
    await _end(broker, dep)  # no Resolve: the api died right after the commit
    await maintenance(resolve_sweep_age=0.0)
    await wait_until(_state_is(broker, after, TaskState.PENDING), within=10)
    await wait_until(lambda: "later" in wakes.queues, within=10)


async def test_the_sweep_leaves_fresh_ends_to_the_resolver(
    broker: Broker, clock: FakeClock, maintenance: Callable[..., Awaitable[Maintenance]]
) -> None:
    dep = (await broker.enqueue(NewTask("fresh", "t"))).task
    after = (await broker.enqueue(NewTask("waits", "t", depends_on=(dep.id,)))).task
    await _end(broker, dep)
    m = await maintenance(resolve_sweep_age=5.0)
    report = await m.reaper_pass()
    assert report.resolved == 0
    assert (await broker.get_task(after.id)).state is TaskState.BLOCKED
    clock.advance(timedelta(seconds=5))
    # This pass or the leader's own, whichever comes first, resolves it now.
    await m.reaper_pass()
    await wait_until(_state_is(broker, after, TaskState.PENDING), within=10)


async def test_one_resolver_leads_and_a_survivor_takes_over(
    broker: Broker, bus: Bus, maintenance: Callable[..., Awaitable[Maintenance]]
) -> None:
    first, second = await maintenance(), await maintenance()
    await wait_until(lambda: first.resolver.leading or second.resolver.leading, within=10)
    leader, standby = (first, second) if first.resolver.leading else (second, first)
    assert not standby.resolver.leading
    assert leader.leads(RESOLVER)
    assert not standby.leads(RESOLVER)
    await leader.stop()
    await _leading(standby)
    dep = (await broker.enqueue(NewTask("a", "t"))).task
    after = (await broker.enqueue(NewTask("b", "t", depends_on=(dep.id,)))).task
    await _end(broker, dep)
    await bus.publish(cluster_pb2.Resolve(task_ids=[dep.id]))
    await wait_until(_state_is(broker, after, TaskState.PENDING), within=10)


async def test_a_failed_resolution_is_tried_again(
    broker: Broker,
    bus: Bus,
    maintenance: Callable[..., Awaitable[Maintenance]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dep = (await broker.enqueue(NewTask("flaky", "t"))).task
    after = (await broker.enqueue(NewTask("then", "t", depends_on=(dep.id,)))).task
    real = broker.resolve_dependents
    failures = [ConnectionError("database unavailable")]

    async def flaky(task_ids: list[str], limit: int = 1000) -> Resolution:
        if failures:
            raise failures.pop()
        return await real(task_ids, limit)

    monkeypatch.setattr(broker, "resolve_dependents", flaky)
    m = await maintenance()
    await _leading(m)
    await _end(broker, dep)
    await bus.publish(cluster_pb2.Resolve(task_ids=[dep.id]))
    await wait_until(_state_is(broker, after, TaskState.PENDING), within=10)
    assert not failures
