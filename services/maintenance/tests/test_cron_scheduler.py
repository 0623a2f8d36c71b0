"""The scheduler's cron pass against a real broker (memory and Postgres) on a FakeClock:
each slot fires once, across DST changes and leap days, missed slots per the misfire
policy, racing schedulers never double-fire, and the leader's loop fires on its own."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from conveyor_broker.clock import FakeClock
from conveyor_broker.cron import CRON_SLOT_HEADER, slot_task_id
from conveyor_broker.interface import Broker
from conveyor_broker.types import CronEntrySpec, CronMisfire, NewTask, TaskListParams
from conveyor_maintenance import SCHEDULER, Maintenance
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.nats_connect import NatsClient
from conveyor_runtime.settings import MaintenanceSettings
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.polling import wait_until
from nats.aio.msg import Msg

QUEUE = "cron-q"


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
def scheduler(
    broker: Broker,
    nc: NatsClient,
    clock: FakeClock,
    make_settings: Callable[..., MaintenanceSettings],
) -> Callable[..., Maintenance]:
    """A Maintenance whose passes the test calls itself (not started)."""

    def make(**overrides: Any) -> Maintenance:
        return Maintenance(make_settings(**overrides), broker, nc, clock)

    return make


@pytest.fixture
async def started(
    broker: Broker,
    nc: NatsClient,
    clock: FakeClock,
    make_settings: Callable[..., MaintenanceSettings],
) -> AsyncIterator[Callable[..., Awaitable[Maintenance]]]:
    running: list[Maintenance] = []

    async def start(**overrides: Any) -> Maintenance:
        m = Maintenance(make_settings(**overrides), broker, nc, clock)
        await m.start()
        running.append(m)
        return m

    try:
        yield start
    finally:
        for m in running:
            await m.stop()


def entry(schedule: str, name: str = "job", **options: Any) -> CronEntrySpec:
    return CronEntrySpec(name=name, schedule=schedule, task=NewTask(QUEUE, "tick"), **options)


async def fired_slots(broker: Broker, name: str = "job") -> list[str]:
    """The slot header of every task entry ``name`` created, in id (so slot) order."""
    tasks = (await broker.list_tasks(TaskListParams(limit=1000))).tasks
    return [t.headers[CRON_SLOT_HEADER] for t in tasks if t.headers.get("conveyor-cron") == name]


async def step_through(m: Maintenance, clock: FakeClock, until: datetime, step: timedelta) -> None:
    """Move the clock to ``until`` in ``step``s, running a cron pass after each."""
    while clock.now() < until:
        clock.advance(min(step, until - clock.now()))
        await m.cron_pass()


async def test_each_slot_fires_once_and_its_queue_is_woken(
    broker: Broker,
    clock: FakeClock,
    nc: NatsClient,
    subjects: Subjects,
    scheduler: Callable[..., Maintenance],
) -> None:
    woken: list[str] = []

    async def on_wake(msg: Msg) -> None:
        woken.append(cluster_pb2.Wake.FromString(msg.data).queue)

    await nc.subscribe(subjects.queue_wildcard("wake"), cb=on_wake)
    m = scheduler()
    await broker.upsert_cron_entry(entry("*/10 * * * *"))
    assert (await m.cron_pass()).fired == 0
    await step_through(m, clock, clock.now() + timedelta(minutes=35), timedelta(seconds=20))
    assert await fired_slots(broker) == [
        "2030-01-01T00:10:00Z",
        "2030-01-01T00:20:00Z",
        "2030-01-01T00:30:00Z",
    ]
    stored = await broker.get_cron_entry("job")
    assert stored.last_run_at == datetime(2030, 1, 1, 0, 30, tzinfo=UTC)
    assert stored.next_run_at == datetime(2030, 1, 1, 0, 40, tzinfo=UTC)
    await wait_until(lambda: woken.count(QUEUE) == 3)


async def test_a_scheduler_behind_catches_up_slot_by_slot(
    broker: Broker, clock: FakeClock, scheduler: Callable[..., Maintenance]
) -> None:
    await broker.upsert_cron_entry(entry("*/5 * * * * *"))
    clock.advance(timedelta(seconds=32))  # six slots due, all within the grace
    report = await scheduler().cron_pass()
    assert report.fired == 6
    assert report.misfired == 0
    assert await fired_slots(broker) == [f"2030-01-01T00:00:{s:02d}Z" for s in range(5, 31, 5)]


async def test_racing_schedulers_fire_every_slot_exactly_once(
    broker: Broker, clock: FakeClock, scheduler: Callable[..., Maintenance]
) -> None:
    await broker.upsert_cron_entry(entry("* * * * * *", name="a"))
    await broker.upsert_cron_entry(entry("*/2 * * * * *", name="b"))
    clock.advance(timedelta(seconds=20))
    reports = await asyncio.gather(*(scheduler().cron_pass() for _ in range(3)))
    assert sum(r.fired for r in reports) == 20 + 10
    assert await fired_slots(broker, "a") == [f"2030-01-01T00:00:{s:02d}Z" for s in range(1, 21)]
    assert await fired_slots(broker, "b") == [f"2030-01-01T00:00:{s:02d}Z" for s in range(2, 21, 2)]


async def test_missed_slots_run_once(
    broker: Broker, clock: FakeClock, scheduler: Callable[..., Maintenance]
) -> None:
    await broker.upsert_cron_entry(entry("@hourly"))
    clock.advance(timedelta(hours=5, minutes=20))  # the cluster was down
    report = await scheduler(cron_misfire_grace=60).cron_pass()
    assert (report.fired, report.misfired) == (1, 1)
    assert await fired_slots(broker) == ["2030-01-01T01:00:00Z"]
    assert (await broker.get_cron_entry("job")).next_run_at == datetime(2030, 1, 1, 6, tzinfo=UTC)


async def test_missed_slots_are_skipped(
    broker: Broker, clock: FakeClock, scheduler: Callable[..., Maintenance]
) -> None:
    await broker.upsert_cron_entry(entry("@hourly", misfire=CronMisfire.SKIP))
    clock.advance(timedelta(hours=5, minutes=20))
    m = scheduler(cron_misfire_grace=60)
    report = await m.cron_pass()
    assert (report.fired, report.misfired) == (0, 1)
    assert await fired_slots(broker) == []
    clock.advance(timedelta(minutes=40))
    assert (await m.cron_pass()).fired == 1
    assert await fired_slots(broker) == ["2030-01-01T06:00:00Z"]


async def test_a_late_slot_within_the_grace_fires_as_usual(
    broker: Broker, clock: FakeClock, scheduler: Callable[..., Maintenance]
) -> None:
    await broker.upsert_cron_entry(entry("@hourly", misfire=CronMisfire.SKIP))
    clock.advance(timedelta(hours=1, seconds=50))
    assert (await scheduler(cron_misfire_grace=60).cron_pass()).fired == 1


async def test_a_paused_entry_does_not_fire(
    broker: Broker, clock: FakeClock, scheduler: Callable[..., Maintenance]
) -> None:
    await broker.upsert_cron_entry(entry("* * * * *", paused=True))
    clock.advance(timedelta(minutes=5))
    assert (await scheduler().cron_pass()).fired == 0
    assert await fired_slots(broker) == []


@pytest.mark.parametrize(
    ("zone", "schedule", "start", "end", "slots"),
    [
        # New York springs forward on 2030-03-10 (02:00 -> 03:00): 02:30 fires at 03:00.
        (
            "America/New_York",
            "30 2 * * *",
            datetime(2030, 3, 8, 12, tzinfo=UTC),
            datetime(2030, 3, 11, 12, tzinfo=UTC),
            ["2030-03-09T07:30:00Z", "2030-03-10T07:00:00Z", "2030-03-11T06:30:00Z"],
        ),
        # ... and falls back on 2030-11-03 (02:00 -> 01:00): 01:30 fires once.
        (
            "America/New_York",
            "30 1 * * *",
            datetime(2030, 11, 2, 12, tzinfo=UTC),
            datetime(2030, 11, 4, 12, tzinfo=UTC),
            ["2030-11-03T05:30:00Z", "2030-11-04T06:30:00Z"],
        ),
        # Berlin springs forward on 2030-03-31 and falls back on 2030-10-27.
        (
            "Europe/Berlin",
            "30 2 * * *",
            datetime(2030, 3, 30, 12, tzinfo=UTC),
            datetime(2030, 4, 1, 12, tzinfo=UTC),
            ["2030-03-31T01:00:00Z", "2030-04-01T00:30:00Z"],
        ),
        (
            "Europe/Berlin",
            "30 2 * * *",
            datetime(2030, 10, 26, 12, tzinfo=UTC),
            datetime(2030, 10, 28, 12, tzinfo=UTC),
            ["2030-10-27T00:30:00Z", "2030-10-28T01:30:00Z"],
        ),
        # Leap days only.
        (
            "UTC",
            "0 0 29 2 *",
            datetime(2032, 2, 27, 12, tzinfo=UTC),
            datetime(2032, 3, 2, tzinfo=UTC),
            ["2032-02-29T00:00:00Z"],
        ),
    ],
    ids=["new-york-spring", "new-york-fall", "berlin-spring", "berlin-fall", "leap-day"],
)
async def test_each_local_slot_fires_once_across_dst_and_leap_days(
    broker: Broker,
    clock: FakeClock,
    scheduler: Callable[..., Maintenance],
    zone: str,
    schedule: str,
    start: datetime,
    end: datetime,
    slots: list[str],
) -> None:
    clock.set(start)
    await broker.upsert_cron_entry(entry(schedule, timezone=zone))
    await step_through(scheduler(), clock, end, timedelta(minutes=15))
    assert await fired_slots(broker) == slots


async def test_the_scheduler_leader_fires_on_its_own_ticks(
    broker: Broker,
    clock: FakeClock,
    started: Callable[..., Awaitable[Maintenance]],
) -> None:
    m = await started()
    await wait_until(lambda: m.leads(SCHEDULER))
    stored = await broker.upsert_cron_entry(entry("@every 30s"))
    assert stored.next_run_at is not None
    clock.set(stored.next_run_at)

    async def fired() -> bool:
        return await fired_slots(broker) != []

    await wait_until(fired, within=10.0)
    task = await broker.get_task(slot_task_id("job", stored.next_run_at))
    assert task.queue == QUEUE
