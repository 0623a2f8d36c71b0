"""Cron schedules: slots in time zones across DST changes, leap days, schedules that never
fire, @every, six fields, and what the scheduler does with due and missed slots."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from conveyor_broker.cron import (
    CronSchedule,
    plan_fire,
    slot_task,
    slot_task_id,
    slot_text,
)
from conveyor_broker.errors import InvalidTask
from conveyor_broker.ids import is_ulid
from conveyor_broker.types import CronMisfire, NewTask


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, micro: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, micro, tzinfo=UTC)


def slots(schedule: CronSchedule, after: datetime, count: int) -> list[datetime]:
    found: list[datetime] = []
    for _ in range(count):
        nxt = schedule.next_after(after)
        assert nxt is not None
        found.append(nxt)
        after = nxt
    return found


# ------------------------------------------------------------------- DST: New York
# 2030-03-10 02:00 EST -> 03:00 EDT (07:00Z); 2030-11-03 02:00 EDT -> 01:00 EST (06:00Z).


def test_new_york_spring_forward_fires_a_skipped_slot_once_at_the_end_of_the_gap() -> None:
    daily = CronSchedule.parse("30 2 * * *", "America/New_York")
    assert slots(daily, utc(2030, 3, 8, 12), 3) == [
        utc(2030, 3, 9, 7, 30),  # 02:30 EST
        utc(2030, 3, 10, 7, 0),  # 02:30 does not exist: 03:00 EDT, the end of the gap
        utc(2030, 3, 11, 6, 30),  # 02:30 EDT
    ]


def test_new_york_spring_forward_slots_in_the_gap_fire_together_once() -> None:
    half_hourly = CronSchedule.parse("*/30 * * * *", "America/New_York")
    assert slots(half_hourly, utc(2030, 3, 10, 6, 0), 3) == [
        utc(2030, 3, 10, 6, 30),  # 01:30 EST
        utc(2030, 3, 10, 7, 0),  # 02:00 and 02:30 do not exist; 03:00 EDT: once
        utc(2030, 3, 10, 7, 30),  # 03:30 EDT
    ]


def test_new_york_fall_back_fires_a_repeated_slot_once_at_its_first_occurrence() -> None:
    daily = CronSchedule.parse("30 1 * * *", "America/New_York")
    assert slots(daily, utc(2030, 11, 2, 12), 2) == [
        utc(2030, 11, 3, 5, 30),  # 01:30 EDT; not again at 01:30 EST (06:30Z)
        utc(2030, 11, 4, 6, 30),  # 01:30 EST
    ]
    half_hourly = CronSchedule.parse("*/30 * * * *", "America/New_York")
    assert slots(half_hourly, utc(2030, 11, 3, 4, 45), 3) == [
        utc(2030, 11, 3, 5, 0),  # 01:00 EDT
        utc(2030, 11, 3, 5, 30),  # 01:30 EDT
        utc(2030, 11, 3, 7, 0),  # 02:00 EST: 01:00 and 01:30 EST are repeats
    ]


def test_during_the_repeated_hour_the_next_slot_is_after_it() -> None:
    every_second = CronSchedule.parse("* * * * * *", "America/New_York")
    # 01:10 EST, the second 01:10 of the night: every 01:xx:xx already fired.
    assert every_second.next_after(utc(2030, 11, 3, 6, 10)) == utc(2030, 11, 3, 7, 0)


# --------------------------------------------------------------------- DST: Berlin
# 2030-03-31 02:00 CET -> 03:00 CEST (01:00Z); 2030-10-27 03:00 CEST -> 02:00 CET (01:00Z).


def test_berlin_spring_forward_and_fall_back() -> None:
    daily = CronSchedule.parse("30 2 * * *", "Europe/Berlin")
    assert slots(daily, utc(2030, 3, 29, 12), 3) == [
        utc(2030, 3, 30, 1, 30),  # 02:30 CET
        utc(2030, 3, 31, 1, 0),  # no 02:30: 03:00 CEST
        utc(2030, 4, 1, 0, 30),  # 02:30 CEST
    ]
    assert slots(daily, utc(2030, 10, 26, 12), 2) == [
        utc(2030, 10, 27, 0, 30),  # 02:30 CEST, the first of two
        utc(2030, 10, 28, 1, 30),  # 02:30 CET
    ]


def test_an_hourly_schedule_keeps_local_hours_across_dst() -> None:
    hourly = CronSchedule.parse("0 * * * *", "Europe/Berlin")
    # Spring: 01:00 CET, then 03:00 CEST, one real hour later (02:00 does not exist).
    assert slots(hourly, utc(2030, 3, 30, 23, 30), 3) == [
        utc(2030, 3, 31, 0, 0),
        utc(2030, 3, 31, 1, 0),
        utc(2030, 3, 31, 2, 0),
    ]


def test_utc_and_fixed_zones_have_no_dst() -> None:
    daily = CronSchedule.parse("30 2 * * *", "UTC")
    assert slots(daily, utc(2030, 3, 30), 2) == [utc(2030, 3, 30, 2, 30), utc(2030, 3, 31, 2, 30)]


# --------------------------------------------------------------- calendar edges


def test_leap_days() -> None:
    leap = CronSchedule.parse("0 12 29 2 *", "Europe/Paris")
    assert slots(leap, utc(2030, 1, 1), 3) == [
        utc(2032, 2, 29, 11),
        utc(2036, 2, 29, 11),
        utc(2040, 2, 29, 11),
    ]
    # The last day of February, leap or not.
    last = CronSchedule.parse("0 0 L 2 *")
    assert slots(last, utc(2031, 1, 1), 2) == [utc(2031, 2, 28), utc(2032, 2, 29)]


@pytest.mark.parametrize("schedule", ["0 0 31 2 *", "0 0 30 2 *", "0 0 31 4,6,9,11 *"])
def test_a_schedule_that_never_fires_has_no_next_slot(schedule: str) -> None:
    assert CronSchedule.parse(schedule).next_after(utc(2030, 1, 1)) is None


def test_six_fields_start_with_seconds() -> None:
    schedule = CronSchedule.parse("*/20 30 * * * *")
    assert slots(schedule, utc(2030, 1, 1), 4) == [
        utc(2030, 1, 1, 0, 30, 0),
        utc(2030, 1, 1, 0, 30, 20),
        utc(2030, 1, 1, 0, 30, 40),
        utc(2030, 1, 1, 1, 30, 0),
    ]


def test_every_is_aligned_to_the_epoch_whatever_the_start() -> None:
    every = CronSchedule.parse("@every 7s", "Asia/Tokyo")
    first = every.next_after(utc(2030, 1, 1, 0, 0, 0))
    assert first is not None
    assert int(first.timestamp()) % 7 == 0
    assert timedelta(0) < first - utc(2030, 1, 1) <= timedelta(seconds=7)
    # Another start in the same interval finds the same slot.
    assert every.next_after(first - timedelta(seconds=3, microseconds=5)) == first
    assert every.next_after(first) == first + timedelta(seconds=7)
    assert CronSchedule.parse("@every 1d").next_after(utc(2030, 1, 1, 5)) == utc(2030, 1, 2)


def test_slots_are_strictly_after_and_at_or_after() -> None:
    hourly = CronSchedule.parse("@hourly")
    assert hourly.next_after(utc(2030, 1, 1, 1)) == utc(2030, 1, 1, 2)
    assert hourly.next_after(utc(2030, 1, 1, 0, 59, 59, 999999)) == utc(2030, 1, 1, 1)
    assert hourly.at_or_after(utc(2030, 1, 1, 1)) == utc(2030, 1, 1, 1)
    with pytest.raises(ValueError, match="aware"):
        hourly.next_after(datetime(2030, 1, 1))


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ("0 0 * *", "4 fields"),
        ("@fortnightly", "unknown cron alias"),
        ("H * * * *", "hashed or random"),
        ("@every 2x", "@every takes a duration"),
        ("@every 0s", "1s to"),
        ("99 * * * *", "invalid cron schedule"),
    ],
)
def test_bad_schedules_say_what_is_wrong(schedule: str, message: str) -> None:
    with pytest.raises(InvalidTask, match=message):
        CronSchedule.parse(schedule)


def test_unknown_time_zone() -> None:
    with pytest.raises(InvalidTask, match="unknown time zone"):
        CronSchedule.parse("@daily", "Europe/Atlantis")


# ------------------------------------------------------------------- slot tasks


def test_slot_task_ids_are_ulids_stamped_with_the_slot_and_differ_by_entry() -> None:
    slot = utc(2030, 5, 6, 7, 8, 9)
    task_id = slot_task_id("nightly", slot)
    assert is_ulid(task_id)
    assert task_id == slot_task_id("nightly", slot)
    assert task_id != slot_task_id("weekly", slot)
    assert task_id != slot_task_id("nightly", slot + timedelta(seconds=1))
    # The first ten characters are the slot's milliseconds since the epoch.
    assert task_id[:10] == slot_task_id("other", slot)[:10]
    assert slot_text(slot) == "2030-05-06T07:08:09Z"
    made = slot_task("nightly", NewTask("q", "t", headers={"a": "b"}), slot)
    assert made.id == task_id
    assert made.unique_key == "cron:nightly:2030-05-06T07:08:09Z"


# ------------------------------------------------------------- due and missed slots

GRACE = timedelta(seconds=60)


def test_a_slot_on_time_fires_and_moves_to_the_next() -> None:
    every_minute = CronSchedule.parse("* * * * *")
    due = plan_fire(
        every_minute, utc(2030, 1, 1, 0, 1), utc(2030, 1, 1, 0, 1, 45), CronMisfire.SKIP, GRACE
    )
    assert (due.slot, due.next_run_at, due.missed) == (
        utc(2030, 1, 1, 0, 1),
        utc(2030, 1, 1, 0, 2),
        False,
    )


def test_missed_slots_run_once_for_the_first() -> None:
    hourly = CronSchedule.parse("@hourly")
    # Down from 00:30 to 05:20: the slots of 01:00 to 05:00 were missed.
    due = plan_fire(hourly, utc(2030, 1, 1, 1), utc(2030, 1, 1, 5, 20), CronMisfire.RUN_ONCE, GRACE)
    assert (due.slot, due.next_run_at, due.missed) == (
        utc(2030, 1, 1, 1),
        utc(2030, 1, 1, 6),
        True,
    )


def test_missed_slots_are_skipped() -> None:
    hourly = CronSchedule.parse("@hourly")
    due = plan_fire(hourly, utc(2030, 1, 1, 1), utc(2030, 1, 1, 5, 20), CronMisfire.SKIP, GRACE)
    assert (due.slot, due.next_run_at, due.missed) == (None, utc(2030, 1, 1, 6), True)


def test_after_missed_slots_the_ones_within_grace_still_fire() -> None:
    every_ten_seconds = CronSchedule.parse("*/10 * * * * *")
    now = utc(2030, 1, 1, 0, 10, 5)
    due = plan_fire(every_ten_seconds, utc(2030, 1, 1), now, CronMisfire.SKIP, GRACE)
    # Slots from 00:09:10 on are at most a minute old: they come next, one by one.
    assert due.next_run_at == utc(2030, 1, 1, 0, 9, 10)
    assert due.slot is None
