"""Maintenance against a real nats-server and a real broker on a FakeClock.

Passes run on short real ticks; the broker's time only moves when the test advances the
clock, so "due", "expired" and "past retention" are exact.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from conveyor_broker.clock import FakeClock
from conveyor_broker.interface import Broker
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.postgres import PostgresBroker, upkeep
from conveyor_broker.types import LEASE_EXPIRED_ERROR, AckItem, NewTask, StorageUpkeep, TaskState
from conveyor_maintenance import REAPER, SCHEDULER, STORAGE, Maintenance
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.nats_connect import NatsClient
from conveyor_runtime.settings import MaintenanceSettings
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.cluster_keys import cluster_auth
from conveyor_testkit.polling import wait_until
from nats.aio.msg import Msg
from prometheus_client import REGISTRY

TIMEOUT = 10.0


class WakeLog:
    """Every Wake published under a prefix, by queue, read straight off NATS (so the
    subject is checked against the message too)."""

    def __init__(self) -> None:
        self.queues: list[str] = []

    async def on_msg(self, msg: Msg) -> None:
        wake = cluster_pb2.Wake.FromString(msg.data)
        assert Subjects.queue_of(msg.subject) == wake.queue
        self.queues.append(wake.queue)

    def count(self, queue: str) -> int:
        return self.queues.count(queue)


@pytest.fixture
async def wakes(nc: NatsClient, subjects: Subjects) -> WakeLog:
    log = WakeLog()
    await nc.subscribe(subjects.queue_wildcard("wake"), cb=log.on_msg)
    await nc.flush()
    return log


async def register(
    nc: NatsClient, subjects: Subjects, queue: str, *, closing: bool = False
) -> None:
    """A gateway's registration on ``queue`` (gateway ``gw-test``), as the api sends it."""
    reg = cluster_pb2.Register(gateway="gw-test", queue=queue, capacity=1, closing=closing)
    await Bus(nc, subjects, cluster_auth()).publish(reg)
    await nc.flush()


def serve(m: Maintenance, *queues: str) -> None:
    """Make ``m`` know ``queues`` as served, as their registrations would."""
    for queue in queues:
        m._on_register(cluster_pb2.Register(gateway="gw-test", queue=queue, capacity=1))


@pytest.fixture
def make_settings(nats_url: str, subjects: Subjects) -> Callable[..., MaintenanceSettings]:
    def make(**overrides: Any) -> MaintenanceSettings:
        fields: dict[str, Any] = {
            "nats_url": nats_url,
            "subject_prefix": subjects.prefix,
            "broker": "memory",
            "instance_id": f"maint-{uuid.uuid4().hex[:6]}",
            "promote_tick": 0.05,
            "reap_tick": 0.05,
            "storage_tick": 0.05,
            "leader_ttl": 1.0,
        }
        fields.update(overrides)
        return MaintenanceSettings(**fields)

    return make


@pytest.fixture
async def maintenance(
    broker: Broker,
    nc: NatsClient,
    clock: FakeClock,
    make_settings: Callable[..., MaintenanceSettings],
) -> AsyncIterator[Callable[..., Awaitable[Maintenance]]]:
    started: list[Maintenance] = []

    async def start(**overrides: Any) -> Maintenance:
        m = Maintenance(make_settings(**overrides), broker, nc, clock)
        await m.start()
        started.append(m)
        return m

    try:
        yield start
    finally:
        for m in started:
            await m.stop()


# --------------------------------------------------------------------- tests


async def test_a_due_scheduled_task_is_promoted_and_its_queue_woken(
    broker: Broker,
    clock: FakeClock,
    wakes: WakeLog,
    maintenance: Callable[..., Awaitable[Maintenance]],
) -> None:
    task = (
        await broker.enqueue(
            NewTask(queue="later", type="t", process_at=clock.now() + timedelta(hours=1))
        )
    ).task
    assert task.state is TaskState.SCHEDULED
    m = await maintenance()
    await wait_until(lambda: m.passes[SCHEDULER] >= 2)
    assert (await broker.get_task(task.id)).state is TaskState.SCHEDULED
    assert wakes.count("later") == 0

    clock.advance(timedelta(hours=1))
    await wait_until(lambda: wakes.count("later") >= 1)
    assert (await broker.get_task(task.id)).state is TaskState.PENDING


async def test_an_expired_lease_is_reaped_into_retry_and_its_queue_woken(
    broker: Broker,
    clock: FakeClock,
    wakes: WakeLog,
    maintenance: Callable[..., Awaitable[Maintenance]],
) -> None:
    await broker.enqueue(NewTask(queue="work", type="t"))
    (leased,) = await broker.lease("work", 1, timedelta(seconds=30))
    m = await maintenance()
    await wait_until(lambda: m.passes[REAPER] >= 2)
    assert (await broker.get_task(leased.id)).state is TaskState.ACTIVE
    assert wakes.count("work") == 0

    clock.advance(timedelta(seconds=31))

    async def reaped() -> bool:
        return (await broker.get_task(leased.id)).state is TaskState.RETRY

    await wait_until(reaped)
    stored = await broker.get_task(leased.id)
    assert stored.retried == 1
    assert stored.last_error == LEASE_EXPIRED_ERROR
    assert stored.lease_id is None
    await wait_until(lambda: wakes.count("work") >= 1)


async def test_the_tasks_of_a_dead_holder_are_released_and_a_holder_heard_on_nats_is_spared(
    broker: Broker,
    bus: Bus,
    clock: FakeClock,
    wakes: WakeLog,
    maintenance: Callable[..., Awaitable[Maintenance]],
) -> None:
    """An api process that stopped beating both ways loses its tasks (released: due at
    once, no attempt spent); one whose beats in the broker fail but whose NATS beats go
    on keeps them; and a freshly started instance, which cannot know who beats on NATS,
    judges nobody until it has listened for holder_silence."""
    await broker.enqueue_batch([NewTask(queue="held", type="t", max_retry=0) for _ in range(2)])
    await broker.beat_holder("dead~1")
    await broker.beat_holder("cut~1")
    leased = await broker.lease("held", 2, timedelta(seconds=30), holders=["dead~1", "cut~1"])
    dead, cut = sorted(leased, key=lambda t: t.holder or "")[::-1]
    assert (dead.holder, cut.holder) == ("dead~1", "cut~1")
    clock.advance(timedelta(seconds=10))  # both silent in the broker from now on

    async def state(task_id: str) -> TaskState:
        return (await broker.get_task(task_id)).state

    async def released(task_id: str) -> bool:
        return await state(task_id) is TaskState.PENDING

    beating = True

    async def beat_on_nats() -> None:
        while beating:
            await bus.publish(cluster_pb2.HolderBeat(holder="cut~1"))
            await asyncio.sleep(0.05)

    beats = asyncio.create_task(beat_on_nats())
    try:
        silence = 1.0
        m = await maintenance(holder_silence=silence)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await wait_until(lambda: m.passes[REAPER] >= 3)
        if loop.time() - started < silence * 0.8:
            # Still listening: nobody judged yet, though the broker says both are dead.
            assert await state(dead.id) is TaskState.ACTIVE
        await wait_until(lambda: released(dead.id))
        stored = await broker.get_task(dead.id)
        assert (stored.retried, stored.lease_id, stored.available_at) == (0, None, clock.now())
        await wait_until(lambda: wakes.count("held") >= 1)
        passes = m.passes[REAPER]
        await wait_until(lambda: m.passes[REAPER] >= passes + 5)
        assert await state(cut.id) is TaskState.ACTIVE
    finally:
        beating = False
        await beats
    # Silent on NATS too now: released once holder_silence has passed.
    await wait_until(lambda: released(cut.id))


async def test_the_pending_sweep_wakes_the_served_queues_with_due_work_only(
    broker: Broker,
    nc: NatsClient,
    subjects: Subjects,
    wakes: WakeLog,
    maintenance: Callable[..., Awaitable[Maintenance]],
) -> None:
    """Due work in queues some gateway registered on gets woken every pass (the api's
    wakes may have been lost); due work nobody serves is never woken: it can go nowhere,
    and ten thousand such queues must not cost ten thousand wakes a second."""
    # Enqueued without any wake, as if the api's wakes had been lost.
    for queue in ("alpha", "beta", "gamma"):
        await broker.enqueue(NewTask(queue=queue, type="t"))
    m = await maintenance()
    for queue in ("alpha", "beta"):
        await register(nc, subjects, queue)
    await wait_until(lambda: wakes.count("alpha") >= 3 and wakes.count("beta") >= 3)
    assert wakes.count("gamma") == 0
    assert m.demand.queues(asyncio.get_running_loop().time()) == ["alpha", "beta"]

    # A gateway that says goodbye no longer serves its queue.
    await register(nc, subjects, "beta", closing=True)
    await wait_until(lambda: not m.demand.served("beta", asyncio.get_running_loop().time()))
    passes = m.passes[REAPER]
    await wait_until(lambda: m.passes[REAPER] >= passes + 2)
    woken = wakes.count("beta")
    await wait_until(lambda: m.passes[REAPER] >= passes + 5)
    assert wakes.count("beta") == woken
    assert wakes.count("gamma") == 0


async def test_a_registration_stops_counting_after_three_register_ticks(
    broker: Broker,
    make_settings: Callable[..., MaintenanceSettings],
    nc: NatsClient,
    clock: FakeClock,
) -> None:
    m = Maintenance(make_settings(register_tick=2.0), broker, nc, clock)
    assert m.demand.ttl == 6.0
    await broker.enqueue(NewTask(queue="alpha", type="t"))
    serve(m, "alpha")
    assert (await m.reaper_pass()).woken == frozenset({"alpha"})
    now = asyncio.get_running_loop().time()
    m.demand.heard("alpha", "gw-test", closing=False, now=now - 6.0)
    report = await m.reaper_pass()
    assert report.woken == frozenset()
    assert report.served == 0


async def test_the_pending_sweep_asks_about_the_served_queues_a_page_at_a_time(
    broker: Broker,
    clock: FakeClock,
    make_settings: Callable[..., MaintenanceSettings],
    nc: NatsClient,
    wakes: WakeLog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sweep asks the broker about the served queues only: it neither counts due
    tasks nor lists every queue that has some (which would cost as much as there are
    queues holding work that nobody serves)."""
    due = [f"due-{n}" for n in range(5)]
    for queue in due:
        await broker.enqueue_batch([NewTask(queue=queue, type="t") for _ in range(3)])
    unserved = [f"unserved-{n}" for n in range(20)]
    await broker.enqueue_batch([NewTask(queue=queue, type="t") for queue in unserved])
    await broker.enqueue(
        NewTask(queue="expiring", type="t", expires_at=clock.now() + timedelta(seconds=1))
    )
    await broker.enqueue(
        NewTask(queue="scheduled", type="t", process_at=clock.now() + timedelta(hours=1))
    )
    clock.advance(timedelta(seconds=1))

    async def count(queue: str | None = None) -> dict[str, int]:
        raise AssertionError("the reaper counted due tasks")

    async def every_due_queue(*, after: str | None = None, limit: int = 1000) -> list[str]:
        raise AssertionError("the reaper listed every queue with due work")

    asked: list[list[str]] = []
    oldest = broker.oldest_due

    async def oldest_due(queues: list[str]) -> dict[str, datetime]:
        asked.append(list(queues))
        return await oldest(queues)

    monkeypatch.setattr(broker, "pending_count", count)
    monkeypatch.setattr(broker, "due_queues", every_due_queue)
    monkeypatch.setattr(broker, "oldest_due", oldest_due)
    # Two queue names per page: the sweep must page to find all five.
    m = Maintenance(make_settings(sweep_limit=2), broker, nc, clock)
    serve(m, *due, "expiring", "scheduled", "idle")
    report = await m.reaper_pass()
    assert report.failed_steps == ()
    assert report.served == 8
    assert [len(page) for page in asked] == [2, 2, 2, 2]
    assert sorted(q for page in asked for q in page) == sorted(
        [*due, "expiring", "scheduled", "idle"]
    )
    # archive_expired ran first, and the expired task's queue has nothing due anyway.
    assert report.archived == 1
    assert report.woken == frozenset(due)
    await wait_until(lambda: all(wakes.count(queue) == 1 for queue in due))
    assert wakes.count("expiring") == wakes.count("scheduled") == 0
    assert not any(wakes.count(queue) for queue in unserved)


def _gauge(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def test_the_reaper_sets_the_oldest_due_and_depth_gauges_of_the_served_queues(
    broker: Broker,
    clock: FakeClock,
    make_settings: Callable[..., MaintenanceSettings],
    nc: NatsClient,
) -> None:
    """The sweep's probe of each served queue gives its oldest due age (every pass), the
    depth gauges count the served queues by state (every depth_tick); a queue no longer
    served leaves both, and so does everything once the reaper role is lost."""
    oldest = "conveyor_queue_oldest_due_seconds"
    depth = "conveyor_queue_depth"
    await broker.enqueue(NewTask(queue="gauge-due", type="t"))
    clock.advance(timedelta(seconds=5))
    await broker.enqueue(NewTask(queue="gauge-due", type="t"))
    later = clock.now() + timedelta(hours=1)
    await broker.enqueue(NewTask(queue="gauge-later", type="t", process_at=later))
    await broker.enqueue(NewTask(queue="gauge-unserved", type="t"))
    clock.advance(timedelta(seconds=2))
    m = Maintenance(make_settings(depth_tick=3600.0), broker, nc, clock)
    serve(m, "gauge-due", "gauge-later")
    assert (await m.reaper_pass()).failed_steps == ()
    assert _gauge(oldest, queue="gauge-due") == 7.0
    assert _gauge(oldest, queue="gauge-later") == 0.0
    assert _gauge(oldest, queue="gauge-unserved") is None
    assert _gauge(depth, queue="gauge-due", state="pending") == 2
    assert _gauge(depth, queue="gauge-later", state="scheduled") == 1
    assert _gauge(depth, queue="gauge-unserved", state="pending") is None

    # The age grows with time on every pass; the depth waits for its tick.
    await broker.enqueue(NewTask(queue="gauge-due", type="t"))
    clock.advance(timedelta(seconds=3))
    await m.reaper_pass()
    assert _gauge(oldest, queue="gauge-due") == 10.0
    assert _gauge(depth, queue="gauge-due", state="pending") == 2

    # No longer served: the queue's gauges go (the depth ones at the next count).
    m.demand.heard("gauge-later", "gw-test", closing=True, now=asyncio.get_running_loop().time())
    await m.reaper_pass()
    assert _gauge(oldest, queue="gauge-later") is None
    await m.depth_pass(["gauge-due"])
    assert _gauge(depth, queue="gauge-later", state="scheduled") is None
    assert _gauge(depth, queue="gauge-due", state="pending") == 3

    m.drop_queue_gauges()
    assert _gauge(oldest, queue="gauge-due") is None
    assert _gauge(depth, queue="gauge-due", state="pending") is None


async def test_a_stored_invalid_queue_name_does_not_stop_the_sweep(
    broker: Broker,
    clock: FakeClock,
    make_settings: Callable[..., MaintenanceSettings],
    nc: NatsClient,
    wakes: WakeLog,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A name stored before names were matched whole (the protected hook skips the
    # validation that now refuses it), whose task's lease expires: the reaper must not
    # publish a wake for it, and the queues after it must still be woken. A registration
    # under such a name is not taken: the broker could not be asked about it.
    await broker._enqueue_batch([NewTask(queue="0\n", type="t")])
    await broker._lease("0\n", 1, timedelta(seconds=1), ())
    clock.advance(timedelta(seconds=2))
    await broker.enqueue_batch([NewTask(queue=q, type="t") for q in ("1", "2")])
    m = Maintenance(make_settings(sweep_limit=1), broker, nc, clock)
    serve(m, "0\n", "1", "2")
    with caplog.at_level(logging.WARNING):
        report = await m.reaper_pass()
    assert report.failed_steps == ()
    assert report.served == 2
    assert report.reaped == 1
    assert report.woken == frozenset({"0\n", "1", "2"})
    await wait_until(lambda: wakes.count("1") == 1 and wakes.count("2") == 1)
    assert "invalid_queue_name_skipped queue='0\\n'" in caplog.text


async def test_reaper_pass_archives_expired_and_purges_old_rows(
    broker: Broker,
    clock: FakeClock,
    make_settings: Callable[..., MaintenanceSettings],
    nc: NatsClient,
) -> None:
    expiring = (
        await broker.enqueue(
            NewTask(queue="q", type="t", expires_at=clock.now() + timedelta(minutes=1))
        )
    ).task
    done = (await broker.enqueue(NewTask(queue="q", type="t", retention=timedelta(0)))).task
    (leased,) = [t for t in await broker.lease("q", 2, timedelta(seconds=30)) if t.id == done.id]
    await broker.ack(leased.id, leased.lease_id or "")
    clock.advance(timedelta(minutes=2))

    m = Maintenance(make_settings(), broker, nc, clock)
    report = await m.reaper_pass()
    assert report.archived == 1
    assert report.purged == 1
    assert report.failed_steps == ()
    assert (await broker.get_task(expiring.id)).state is TaskState.ARCHIVED
    assert (await broker.queue_stats("q"))[0].count(TaskState.COMPLETED) == 0


async def test_one_leader_per_role_and_a_survivor_takes_over(
    maintenance: Callable[..., Awaitable[Maintenance]],
) -> None:
    first = await maintenance()
    second = await maintenance()
    for role in (SCHEDULER, REAPER):
        await wait_until(lambda role=role: first.leads(role) or second.leads(role))  # type: ignore[misc]
        assert not (first.leads(role) and second.leads(role))
    leader = first if first.leads(REAPER) else second
    follower = second if leader is first else first
    passes = dict(follower.passes)

    await leader.stop()
    await wait_until(lambda: follower.leads(SCHEDULER) and follower.leads(REAPER))
    await wait_until(lambda: follower.passes[REAPER] > passes[REAPER])


async def test_a_failing_pass_is_logged_and_the_next_tick_retries(
    clock: FakeClock,
    nc: NatsClient,
    wakes: WakeLog,
    make_settings: Callable[..., MaintenanceSettings],
    caplog: pytest.LogCaptureFixture,
) -> None:
    class FlakyBroker(MemoryBroker):
        """Fails its first promote, as a database blip would."""

        failures = 1

        async def promote_scheduled(self, limit: int = 1000) -> dict[str, int]:
            if self.failures:
                self.failures -= 1
                raise ConnectionError("database went away")
            return await super().promote_scheduled(limit)

    flaky = FlakyBroker(clock)
    task = (
        await flaky.enqueue(NewTask(queue="blip", type="t", process_at=clock.now() + timedelta(1)))
    ).task
    clock.advance(timedelta(days=2))
    m = Maintenance(make_settings(), flaky, nc, clock)
    try:
        with caplog.at_level(logging.ERROR, logger="conveyor_maintenance"):
            await m.start()
            await wait_until(lambda: wakes.count("blip") >= 1)
        assert flaky.failures == 0
        assert (await flaky.get_task(task.id)).state is TaskState.PENDING
    finally:
        await m.stop()
        await flaky.close()
    assert any("maintenance.pass_failed role=scheduler" in r.getMessage() for r in caplog.records)


async def test_the_storage_role_vacuums_the_task_table_after_a_burst(
    broker: Broker, clock: FakeClock, maintenance: Callable[..., Awaitable[Maintenance]]
) -> None:
    """Postgres gets an ANALYZE and a VACUUM once a burst has gone through; the memory
    broker has nothing to keep up, and its passes say so."""
    m = await maintenance()
    await wait_until(lambda: m.passes[STORAGE] >= 2)
    for _ in range(2):
        await broker.enqueue_batch([NewTask(queue="burst", type="t") for _ in range(1000)])
    while leased := await broker.lease("burst", 100, timedelta(seconds=30)):
        await broker.ack_batch([AckItem(t.id, t.lease_id or "") for t in leased])
    if not isinstance(broker, PostgresBroker):
        passes = m.passes[STORAGE]
        await wait_until(lambda: m.passes[STORAGE] >= passes + 2)
        assert await m.storage_pass() == StorageUpkeep()
        return

    async def vacuumed() -> bool:
        # Upkeep rests a while (on the broker's clock) after each run: an early run on
        # counters published halfway through the burst must not hold the rest up.
        clock.advance(upkeep.MIN_INTERVAL)
        row = await broker._pool.fetchrow(
            "SELECT last_vacuum, last_analyze FROM pg_stat_all_tables "
            "WHERE relid = 'conveyor_tasks'::regclass"
        )
        return row is not None and None not in (row["last_vacuum"], row["last_analyze"])

    await wait_until(vacuumed, within=30)


async def test_storage_upkeep_can_be_turned_off(
    broker: Broker, maintenance: Callable[..., Awaitable[Maintenance]]
) -> None:
    m = await maintenance(storage_upkeep=False)
    await wait_until(lambda: m.passes[REAPER] >= 3)
    assert m.passes[STORAGE] == 0
    assert not m.leads(STORAGE)


async def test_a_promote_hint_runs_the_scheduler_at_once(
    broker: Broker,
    clock: FakeClock,
    nc: NatsClient,
    subjects: Subjects,
    wakes: WakeLog,
    maintenance: Callable[..., Awaitable[Maintenance]],
) -> None:
    """The scheduler's tick is a minute here; the hint (sent by the api when a task it
    stored falls due) makes the leader promote at once."""
    task = (
        await broker.enqueue(
            NewTask(queue="hinted", type="t", process_at=clock.now() + timedelta(seconds=5))
        )
    ).task
    m = await maintenance(promote_tick=60.0)
    await wait_until(lambda: m.passes[SCHEDULER] >= 1)
    passes = m.passes[SCHEDULER]
    clock.advance(timedelta(seconds=5))
    await Bus(nc, subjects, cluster_auth()).publish_promote()
    await wait_until(lambda: wakes.count("hinted") >= 1)
    assert (await broker.get_task(task.id)).state is TaskState.PENDING
    assert m.passes[SCHEDULER] == passes + 1
