"""Conformance: cron entries (upsert, get, list, due, pause, delete, fire, trigger)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.cron import CRON_HEADER, CRON_SLOT_HEADER, slot_task_id, slot_unique_key
from conveyor_broker.errors import CronEntryNotFound, InvalidTask
from conveyor_broker.interface import Broker
from conveyor_broker.types import (
    CronEntrySpec,
    CronMisfire,
    NewTask,
    TaskEvent,
    TaskState,
)

NAME = "nightly"
#: The fake clock starts at 2030-01-01T00:00:00Z.
START = datetime(2030, 1, 1, tzinfo=UTC)


def template(**options: object) -> NewTask:
    """A valid task template with ``options``."""
    options.setdefault("queue", "reports")
    options.setdefault("type", "report.build")
    return NewTask(**options)  # type: ignore[arg-type]


def cron_spec(name: str = NAME, schedule: str = "0 3 * * *", **options: object) -> CronEntrySpec:
    """A valid entry named ``name`` on ``schedule`` with ``options``."""
    options.setdefault("task", template())
    return CronEntrySpec(name=name, schedule=schedule, **options)  # type: ignore[arg-type]


_Bad = Callable[[CronEntrySpec], CronEntrySpec]

#: One spec edit per validation rule; each turns a valid spec into one InvalidTask rejects.
BAD_SPECS: dict[str, _Bad] = {
    "empty-name": lambda s: replace(s, name=""),
    "name-with-dot": lambda s: replace(s, name="a.b"),
    "name-too-long": lambda s: replace(s, name="n" * 129),
    "empty-schedule": lambda s: replace(s, schedule=" "),
    "four-fields": lambda s: replace(s, schedule="0 3 * *"),
    "seven-fields": lambda s: replace(s, schedule="0 0 3 * * * 2030"),
    "minute-61": lambda s: replace(s, schedule="61 3 * * *"),
    "words": lambda s: replace(s, schedule="every day at noon"),
    "unknown-alias": lambda s: replace(s, schedule="@fortnightly"),
    "hashed": lambda s: replace(s, schedule="H 3 * * *"),
    "random": lambda s: replace(s, schedule="R 3 * * *"),
    "every-zero": lambda s: replace(s, schedule="@every 0s"),
    "every-no-unit": lambda s: replace(s, schedule="@every 10"),
    "every-too-long": lambda s: replace(s, schedule="@every 400d"),
    "unknown-zone": lambda s: replace(s, timezone="Mars/Olympus_Mons"),
    "zone-path": lambda s: replace(s, timezone="../../etc/passwd"),
    "misfire": lambda s: replace(s, misfire="sometimes"),  # type: ignore[arg-type]
    "bad-queue": lambda s: replace(s, task=template(queue="a.b")),
    "empty-type": lambda s: replace(s, task=template(type="")),
    "template-id": lambda s: replace(s, task=template(id="01J0000000000000000000TASK")),
    "template-unique-key": lambda s: replace(s, task=template(unique_key="k")),
    "template-process-at": lambda s: replace(s, task=template(process_at=START)),
    "template-deadline": lambda s: replace(s, task=template(deadline=START)),
    "template-expires-at": lambda s: replace(s, task=template(expires_at=START)),
    "template-depends-on": lambda s: replace(
        s, task=template(depends_on=("01J0000000000000000000TASK",))
    ),
    "reserved-header": lambda s: replace(s, task=template(headers={CRON_HEADER: "x"})),
    "too-many-headers": lambda s: replace(
        s, task=template(headers={f"h{i}": "v" for i in range(63)})
    ),
    "negative-timeout": lambda s: replace(s, task=template(timeout=timedelta(seconds=-1))),
    "max-retry": lambda s: replace(s, task=template(max_retry=-1)),
}


class CronTests:
    """The cron entry methods of the Broker."""

    async def test_cron_create_then_get(self, broker: Broker, clock: FakeClock) -> None:
        now = clock.advance(timedelta(minutes=5))
        task = template(
            payload=b"\x00\x01payload",
            headers={"tenant": "acme"},
            max_retry=3,
            timeout=timedelta(seconds=90, microseconds=5),
            retention=timedelta(hours=1),
            group="g",
        )
        created = await broker.upsert_cron_entry(
            cron_spec(timezone="Europe/Paris", task=task, misfire=CronMisfire.SKIP)
        )
        assert created.name == NAME
        assert created.schedule == "0 3 * * *"
        assert created.timezone == "Europe/Paris"
        assert created.task == task
        assert created.misfire is CronMisfire.SKIP
        assert created.paused is False
        # 03:00 in Paris (UTC+1 in January) is 02:00 UTC.
        assert created.next_run_at == START.replace(hour=2)
        assert created.last_run_at is None
        assert created.created_at == created.updated_at == now
        assert await broker.get_cron_entry(NAME) == created
        assert await broker.list_cron_entries() == [created]

    async def test_cron_defaults_and_normal_form(self, broker: Broker) -> None:
        created = await broker.upsert_cron_entry(
            cron_spec(schedule="  */15   *  * * * ", timezone="")
        )
        assert created.schedule == "*/15 * * * *"
        assert created.timezone == "UTC"
        assert created.misfire is CronMisfire.RUN_ONCE
        assert created.next_run_at == START + timedelta(minutes=15)

    @pytest.mark.parametrize(
        ("schedule", "first"),
        [
            ("@hourly", START + timedelta(hours=1)),
            ("@daily", START + timedelta(days=1)),
            ("@midnight", START + timedelta(days=1)),
            # 2030-01-01 is a Tuesday: the next Sunday is the 6th.
            ("@weekly", datetime(2030, 1, 6, tzinfo=UTC)),
            ("@monthly", datetime(2030, 2, 1, tzinfo=UTC)),
            ("@yearly", datetime(2031, 1, 1, tzinfo=UTC)),
            ("@annually", datetime(2031, 1, 1, tzinfo=UTC)),
            ("*/20 * * * * *", START + timedelta(seconds=20)),
            ("@every 90s", START + timedelta(seconds=90)),
            ("@every 1h30m", START + timedelta(hours=1, minutes=30)),
            ("0 0 29 2 *", datetime(2032, 2, 29, tzinfo=UTC)),
            ("0 9 * * MON-FRI", START + timedelta(hours=9)),
        ],
    )
    async def test_cron_first_run_of_each_kind_of_schedule(
        self, broker: Broker, schedule: str, first: datetime
    ) -> None:
        created = await broker.upsert_cron_entry(cron_spec(schedule=schedule))
        assert created.next_run_at == first

    @pytest.mark.parametrize("bad", sorted(BAD_SPECS))
    async def test_cron_bad_input_is_refused_and_nothing_changes(
        self, broker: Broker, bad: str
    ) -> None:
        stored = await broker.upsert_cron_entry(cron_spec())
        spec = BAD_SPECS[bad](cron_spec(schedule="*/5 * * * *"))
        with pytest.raises(InvalidTask):
            await broker.upsert_cron_entry(spec)
        assert await broker.list_cron_entries() == [stored]

    async def test_cron_a_schedule_that_never_fires_is_refused(self, broker: Broker) -> None:
        with pytest.raises(InvalidTask, match="never fires"):
            await broker.upsert_cron_entry(cron_spec(schedule="0 0 31 2 *"))
        assert await broker.list_cron_entries() == []

    async def test_cron_replace_keeps_the_next_run_when_the_schedule_is_the_same(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        created = await broker.upsert_cron_entry(cron_spec(schedule="*/10 * * * *"))
        assert created.next_run_at == START + timedelta(minutes=10)
        # Past the next run, before it fired: applying the same entry again (an
        # application restarting) must not skip the slot.
        now = clock.advance(timedelta(minutes=25))
        again = await broker.upsert_cron_entry(
            cron_spec(schedule="*/10  * * * *", task=template(payload=b"v2"))
        )
        assert again.next_run_at == created.next_run_at
        assert again.task.payload == b"v2"
        assert again.created_at == created.created_at
        assert again.updated_at == now
        assert [e.name for e in await broker.list_due_cron_entries()] == [NAME]

    async def test_cron_replace_with_another_schedule_or_zone_starts_from_now(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.upsert_cron_entry(cron_spec(schedule="*/10 * * * *"))
        clock.advance(timedelta(minutes=25))
        changed = await broker.upsert_cron_entry(cron_spec(schedule="*/7 * * * *"))
        assert changed.next_run_at == START + timedelta(minutes=28)
        moved = await broker.upsert_cron_entry(
            cron_spec(schedule="*/7 * * * *", timezone="Asia/Kolkata")
        )
        # Local time is 05:55 (UTC+5:30): the next */7 minute is 05:56.
        assert moved.next_run_at == datetime(2030, 1, 1, 0, 26, tzinfo=UTC)
        assert moved.timezone == "Asia/Kolkata"

    async def test_cron_replace_keeps_last_run(self, broker: Broker, clock: FakeClock) -> None:
        entry = await broker.upsert_cron_entry(cron_spec(schedule="@hourly"))
        assert entry.next_run_at is not None
        clock.advance(timedelta(hours=1))
        fired = await broker.fire_cron_entry(
            NAME, entry.next_run_at, entry.next_run_at + timedelta(hours=1), entry.next_run_at
        )
        assert fired.applied
        replaced = await broker.upsert_cron_entry(cron_spec(schedule="@daily"))
        assert replaced.last_run_at == entry.next_run_at

    async def test_cron_list_is_sorted_by_name(self, broker: Broker) -> None:
        names = ["beta", "Zeta", "alpha", "a_1", "a-1", "A9"]
        for name in names:
            await broker.upsert_cron_entry(cron_spec(name))
        assert [e.name for e in await broker.list_cron_entries()] == sorted(names)

    async def test_cron_unknown_names(self, broker: Broker) -> None:
        with pytest.raises(CronEntryNotFound):
            await broker.get_cron_entry("missing")
        with pytest.raises(CronEntryNotFound):
            await broker.set_cron_paused("missing", True)
        with pytest.raises(CronEntryNotFound):
            await broker.delete_cron_entry("missing")
        with pytest.raises(CronEntryNotFound):
            await broker.trigger_cron_entry("missing")
        with pytest.raises(InvalidTask):
            await broker.get_cron_entry("bad name")
        fired = await broker.fire_cron_entry("missing", START, START + timedelta(hours=1), START)
        assert not fired.applied

    async def test_cron_delete(self, broker: Broker) -> None:
        await broker.upsert_cron_entry(cron_spec())
        kept = await broker.upsert_cron_entry(cron_spec("kept"))
        await broker.delete_cron_entry(NAME)
        assert await broker.list_cron_entries() == [kept]
        with pytest.raises(CronEntryNotFound):
            await broker.get_cron_entry(NAME)

    async def test_cron_due_entries_earliest_first(self, broker: Broker, clock: FakeClock) -> None:
        await broker.upsert_cron_entry(cron_spec("hourly", "0 * * * *"))
        await broker.upsert_cron_entry(cron_spec("quarter", "*/15 * * * *"))
        await broker.upsert_cron_entry(cron_spec("also-quarter", "15 * * * *"))
        await broker.upsert_cron_entry(cron_spec("paused", "* * * * *", paused=True))
        assert await broker.list_due_cron_entries() == []
        clock.advance(timedelta(minutes=15))
        due = await broker.list_due_cron_entries()
        assert [e.name for e in due] == ["also-quarter", "quarter"]
        assert [e.name for e in await broker.list_due_cron_entries(limit=1)] == ["also-quarter"]
        clock.advance(timedelta(hours=1))
        due = await broker.list_due_cron_entries()
        assert [e.name for e in due] == ["also-quarter", "quarter", "hourly"]
        with pytest.raises(InvalidTask):
            await broker.list_due_cron_entries(limit=0)

    async def test_cron_pause_and_resume(self, broker: Broker, clock: FakeClock) -> None:
        await broker.upsert_cron_entry(cron_spec(schedule="*/10 * * * *"))
        paused_at = clock.advance(timedelta(minutes=3))
        paused = await broker.set_cron_paused(NAME, True)
        assert paused.paused
        assert paused.next_run_at is None
        assert paused.updated_at == paused_at
        clock.advance(timedelta(minutes=30))
        assert await broker.list_due_cron_entries() == []
        # Pausing again changes nothing.
        assert await broker.set_cron_paused(NAME, True) == paused
        resumed_at = clock.advance(timedelta(minutes=1))
        resumed = await broker.set_cron_paused(NAME, False)
        # The slots that passed while paused are skipped.
        assert resumed.next_run_at == START + timedelta(minutes=40)
        assert resumed.updated_at == resumed_at
        assert await broker.get_cron_entry(NAME) == resumed
        # Resuming an entry that runs keeps its next run (a due slot stays due).
        clock.advance(timedelta(minutes=10))
        assert await broker.set_cron_paused(NAME, False) == resumed

    async def test_cron_created_paused_and_upsert_resumes(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        created = await broker.upsert_cron_entry(cron_spec(schedule="@hourly", paused=True))
        assert created.paused
        assert created.next_run_at is None
        clock.advance(timedelta(minutes=90))
        resumed = await broker.upsert_cron_entry(cron_spec(schedule="@hourly"))
        assert resumed.next_run_at == START + timedelta(hours=2)

    async def test_cron_fire_creates_the_slot_task_and_moves_on(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = template(payload=b"p", headers={"tenant": "acme"}, max_retry=2)
        entry = await broker.upsert_cron_entry(cron_spec(schedule="@hourly", task=task))
        slot = entry.next_run_at
        assert slot is not None
        now = clock.advance(timedelta(hours=1, seconds=2))
        fired = await broker.fire_cron_entry(NAME, slot, slot + timedelta(hours=1), slot)
        assert fired.applied
        assert fired.entry is not None
        assert fired.entry.next_run_at == slot + timedelta(hours=1)
        assert fired.entry.last_run_at == slot
        assert fired.entry.updated_at == entry.updated_at
        assert await broker.get_cron_entry(NAME) == fired.entry
        assert fired.task is not None
        assert fired.task.created
        made = fired.task.task
        assert made.id == slot_task_id(NAME, slot)
        assert made.unique_key == slot_unique_key(NAME, slot) == f"cron:{NAME}:2030-01-01T01:00:00Z"
        assert dict(made.headers) == {
            "tenant": "acme",
            CRON_HEADER: NAME,
            CRON_SLOT_HEADER: "2030-01-01T01:00:00Z",
        }
        assert (made.queue, made.type, made.payload, made.max_retry) == (
            "reports",
            "report.build",
            b"p",
            2,
        )
        assert made.state == TaskState.PENDING
        assert made.created_at == now
        assert await broker.get_task(made.id) == made
        assert await broker.list_due_cron_entries() == []

    async def test_cron_fire_is_a_compare_and_set(self, broker: Broker, clock: FakeClock) -> None:
        entry = await broker.upsert_cron_entry(cron_spec(schedule="@hourly"))
        slot = entry.next_run_at
        assert slot is not None
        clock.advance(timedelta(hours=1))
        first = await broker.fire_cron_entry(NAME, slot, slot + timedelta(hours=1), slot)
        # A second scheduler that read the same next run: nothing happens.
        second = await broker.fire_cron_entry(NAME, slot, slot + timedelta(hours=1), slot)
        assert first.applied
        assert not second.applied
        assert second.entry is None
        assert second.task is None
        assert await broker.get_cron_entry(NAME) == first.entry
        tasks = (await broker.list_tasks()).tasks
        assert [t.id for t in tasks] == [slot_task_id(NAME, slot)]

    async def test_cron_fire_of_a_paused_entry_does_nothing(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        entry = await broker.upsert_cron_entry(cron_spec(schedule="@hourly"))
        assert entry.next_run_at is not None
        clock.advance(timedelta(hours=1))
        await broker.set_cron_paused(NAME, True)
        fired = await broker.fire_cron_entry(
            NAME, entry.next_run_at, entry.next_run_at + timedelta(hours=1), entry.next_run_at
        )
        assert not fired.applied
        assert (await broker.list_tasks()).tasks == []

    async def test_cron_fire_without_a_slot_skips(self, broker: Broker, clock: FakeClock) -> None:
        entry = await broker.upsert_cron_entry(cron_spec(schedule="@hourly"))
        assert entry.next_run_at is not None
        clock.advance(timedelta(hours=5))
        later = entry.next_run_at + timedelta(hours=5)
        fired = await broker.fire_cron_entry(NAME, entry.next_run_at, later, None)
        assert fired.applied
        assert fired.task is None
        assert fired.entry is not None
        assert fired.entry.next_run_at == later
        assert fired.entry.last_run_at is None
        assert (await broker.list_tasks()).tasks == []

    async def test_cron_fire_to_no_next_run(self, broker: Broker, clock: FakeClock) -> None:
        entry = await broker.upsert_cron_entry(cron_spec(schedule="@hourly"))
        assert entry.next_run_at is not None
        clock.advance(timedelta(hours=1))
        fired = await broker.fire_cron_entry(NAME, entry.next_run_at, None, entry.next_run_at)
        assert fired.applied
        assert fired.entry is not None
        assert fired.entry.next_run_at is None
        clock.advance(timedelta(days=3))
        assert await broker.list_due_cron_entries() == []

    async def test_cron_a_slot_task_already_stored_is_not_created_again(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        # The entry is deleted and made again: firing the same slot finds its task.
        entry = await broker.upsert_cron_entry(cron_spec(schedule="@hourly"))
        slot = entry.next_run_at
        assert slot is not None
        clock.advance(timedelta(hours=1))
        first = await broker.fire_cron_entry(NAME, slot, slot + timedelta(hours=1), slot)
        assert first.task is not None
        await broker.delete_cron_entry(NAME)
        again = await broker.upsert_cron_entry(cron_spec(schedule="@hourly"))
        assert again.next_run_at is not None
        second = await broker.fire_cron_entry(NAME, again.next_run_at, None, slot)
        assert second.applied
        assert second.task is not None
        assert not second.task.created
        assert second.task.task == await broker.get_task(first.task.task.id)
        assert len((await broker.list_tasks()).tasks) == 1

    async def test_cron_a_slot_key_held_by_another_task_creates_none(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        entry = await broker.upsert_cron_entry(cron_spec(schedule="@hourly"))
        slot = entry.next_run_at
        assert slot is not None
        holder = await broker.enqueue(
            template(unique_key=slot_unique_key(NAME, slot), type="other")
        )
        clock.advance(timedelta(hours=1))
        fired = await broker.fire_cron_entry(NAME, slot, slot + timedelta(hours=1), slot)
        assert fired.applied
        assert fired.task is None
        assert fired.entry is not None
        assert fired.entry.next_run_at == slot + timedelta(hours=1)
        assert [t.id for t in (await broker.list_tasks()).tasks] == [holder.task.id]

    async def test_cron_fire_reports_the_new_task(self, broker: Broker, clock: FakeClock) -> None:
        events: list[TaskEvent] = []
        broker.set_event_sink(events.append)
        entry = await broker.upsert_cron_entry(cron_spec(schedule="@hourly"))
        assert entry.next_run_at is not None
        now = clock.advance(timedelta(hours=1))
        fired = await broker.fire_cron_entry(
            NAME, entry.next_run_at, entry.next_run_at + timedelta(hours=1), entry.next_run_at
        )
        assert fired.task is not None
        assert events == [
            TaskEvent(fired.task.task.id, "reports", "report.build", TaskState.PENDING, None, now)
        ]

    async def test_cron_fire_refuses_bad_times(self, broker: Broker) -> None:
        entry = await broker.upsert_cron_entry(cron_spec(schedule="@hourly"))
        at = entry.next_run_at
        assert at is not None
        with pytest.raises(InvalidTask):
            await broker.fire_cron_entry(NAME, at, at, at)
        with pytest.raises(InvalidTask):
            await broker.fire_cron_entry(NAME, at, at - timedelta(hours=1), at)
        with pytest.raises(InvalidTask):
            await broker.fire_cron_entry(NAME, at.replace(tzinfo=None), None, None)
        with pytest.raises(InvalidTask):
            await broker.fire_cron_entry(NAME, at, None, at.replace(tzinfo=None))
        assert await broker.get_cron_entry(NAME) == entry

    async def test_cron_trigger_enqueues_now_and_leaves_the_schedule(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        entry = await broker.upsert_cron_entry(
            cron_spec(schedule="@daily", task=template(headers={"a": "b"}), paused=True)
        )
        now = clock.advance(timedelta(minutes=1))
        first = await broker.trigger_cron_entry(NAME)
        second = await broker.trigger_cron_entry(NAME)
        assert first.created
        assert second.created
        assert first.task.id != second.task.id
        assert first.task.state == TaskState.PENDING
        assert first.task.unique_key is None
        assert first.task.created_at == now
        assert dict(first.task.headers) == {
            "a": "b",
            CRON_HEADER: NAME,
            CRON_SLOT_HEADER: "manual",
        }
        assert await broker.get_cron_entry(NAME) == entry

    async def test_cron_entries_and_tasks_are_independent(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        entry = await broker.upsert_cron_entry(cron_spec(schedule="@hourly"))
        assert entry.next_run_at is not None
        clock.advance(timedelta(hours=1))
        fired = await broker.fire_cron_entry(
            NAME, entry.next_run_at, entry.next_run_at + timedelta(hours=1), entry.next_run_at
        )
        assert fired.task is not None
        await broker.delete_cron_entry(NAME)
        assert (await broker.get_task(fired.task.task.id)).state == TaskState.PENDING
