"""Cron schedules: parsing, the next slot after an instant, and a slot's task.

A schedule is one of:

- a five-field cron expression (minute hour day-of-month month day-of-week, as croniter
  reads it: ranges, steps, lists, month and day names, ``L``, ``#``);
- six fields, the first being seconds (``*/5 * * * * *``: every five seconds);
- an alias: ``@yearly`` (``@annually``), ``@monthly``, ``@weekly``, ``@daily``
  (``@midnight``), ``@hourly``;
- ``@every <duration>``: a fixed interval (``90s``, ``5m``, ``1h30m``, ``1d``; at least one
  second), its slots the multiples of the interval since the Unix epoch (so every
  scheduler agrees on them, whenever the entry was stored; the time zone plays no part).

Cron expressions are read in the entry's IANA time zone, on its wall clock. Daylight
saving time is handled so that every wall-clock slot fires once:

- a slot whose local time does not exist (the clock jumps from 02:00 to 03:00, and the
  slot is 02:30) fires once, at the first valid instant after the gap (03:00 local); when
  several slots fall into the gap, or the instant after it is a slot of its own, they fire
  once together;
- a slot whose local time happens twice (the clock goes back from 02:00 to 01:00, and the
  slot is 01:30) fires once, at the first occurrence.

A slot is an instant (an aware UTC datetime at a whole second). The task a slot creates
(:func:`slot_task`) has an id derived from the entry name and the slot (a ULID whose time
part is the slot), and the unique key ``cron:<name>:<slot>``: creating a slot's task twice
finds the first one, so a slot never runs twice even if two schedulers fire it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, CroniterError, croniter

from conveyor_broker.errors import InvalidTask
from conveyor_broker.ids import new_id
from conveyor_broker.types import CronMisfire, NewTask

#: Header naming the cron entry on the tasks it creates.
CRON_HEADER = "conveyor-cron"
#: Header holding the slot (RFC 3339, UTC) on the tasks an entry creates; "manual" on a
#: task made by a trigger-now.
CRON_SLOT_HEADER = "conveyor-cron-slot"
#: Headers the server sets on a cron entry's tasks: a template may not set them.
RESERVED_HEADERS = frozenset({CRON_HEADER, CRON_SLOT_HEADER})
MAX_SCHEDULE_LEN = 256
MAX_TIMEZONE_LEN = 64
DEFAULT_TIMEZONE = "UTC"

_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_EVERY_RE = re.compile(r"@every\s+(\S+)")
_DURATION_RE = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
#: Field tokens croniter reads as random (R) or hashed (H): not repeatable, so refused.
_RANDOM_TOKEN_RE = re.compile(r"(?:^|[,/\-(])[HhRr](?:$|[,/\-()])")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SECOND = timedelta(seconds=1)
#: The longest @every interval (a year is plenty for "every").
MAX_INTERVAL = timedelta(days=366)
#: Most candidate wall-clock times looked at for one next slot: a repeated hour of a
#: per-second schedule is 3,600; a schedule that fires at all always finds one sooner.
_MAX_STEPS = 20_000


class CronSchedule:
    """A parsed schedule in a time zone. Build it with :meth:`parse`."""

    def __init__(
        self,
        schedule: str,
        zone: ZoneInfo,
        expression: str | None,
        seconds_field: bool,
        interval: timedelta | None,
    ) -> None:
        self.schedule = schedule
        self.zone = zone
        self._expression = expression
        self._seconds_field = seconds_field
        self._interval = interval

    @classmethod
    def parse(cls, schedule: str, timezone: str = DEFAULT_TIMEZONE) -> CronSchedule:
        """The schedule ``schedule`` in ``timezone`` (an IANA name); InvalidTask when
        either is not one this module reads (see the module docstring)."""
        zone = parse_timezone(timezone)
        if not isinstance(schedule, str) or not schedule.strip():
            raise InvalidTask("a cron schedule may not be empty")
        if len(schedule) > MAX_SCHEDULE_LEN:
            raise InvalidTask(f"a cron schedule is at most {MAX_SCHEDULE_LEN} characters")
        text = " ".join(schedule.split())
        if text.startswith("@every"):
            return cls(text, zone, None, False, _parse_interval(text))
        expression = _ALIASES.get(text.lower(), text)
        if expression.startswith("@"):
            raise InvalidTask(
                f"unknown cron alias {text!r}: use @yearly, @annually, @monthly, @weekly, "
                "@daily, @midnight, @hourly or @every <duration>"
            )
        fields = expression.split(" ")
        if len(fields) not in (5, 6):
            raise InvalidTask(
                f"cron schedule {text!r} has {len(fields)} fields: use five (minute hour "
                "day-of-month month day-of-week), six (seconds first), an alias or "
                "@every <duration>"
            )
        if any(_RANDOM_TOKEN_RE.search(field) for field in fields):
            raise InvalidTask(
                f"cron schedule {text!r} uses H or R (hashed or random): not supported"
            )
        seconds_field = len(fields) == 6
        try:
            croniter(expression, datetime(2000, 1, 1), second_at_beginning=seconds_field)
        except (CroniterError, ValueError, KeyError, IndexError) as exc:
            raise InvalidTask(f"invalid cron schedule {text!r}: {exc}") from None
        return cls(text, zone, expression, seconds_field, None)

    def next_after(self, after: datetime) -> datetime | None:
        """The first slot strictly after ``after`` (aware), as an aware UTC datetime;
        None when the schedule never fires again (``0 0 31 2 *``)."""
        if after.tzinfo is None:
            raise ValueError("next_after needs an aware datetime")
        if self._interval is not None:
            step = self._interval
            return _EPOCH + ((after - _EPOCH) // step + 1) * step
        assert self._expression is not None
        wall = after.astimezone(self.zone).replace(tzinfo=None, fold=0)
        try:
            walls = croniter(
                self._expression, wall, ret_type=datetime, second_at_beginning=self._seconds_field
            )
            for _ in range(_MAX_STEPS):
                candidate: datetime = walls.get_next(datetime)
                instant = _resolve(candidate, self.zone)
                if instant > after:
                    return instant
        except CroniterBadDateError:
            return None
        return None  # pragma: no cover - a schedule that fires finds a slot far sooner

    def at_or_after(self, when: datetime) -> datetime | None:
        """The first slot at ``when`` or later."""
        return self.next_after(when - timedelta(microseconds=1))


def parse_timezone(name: str) -> ZoneInfo:
    """The IANA time zone ``name`` ("" is UTC); InvalidTask for an unknown one."""
    if not isinstance(name, str):
        raise InvalidTask("a time zone is a string")
    if not name:
        name = DEFAULT_TIMEZONE
    if len(name) > MAX_TIMEZONE_LEN or not re.fullmatch(
        r"[A-Za-z0-9_+\-]+(/[A-Za-z0-9_+\-]+)*", name
    ):
        raise InvalidTask(f"unknown time zone {name!r}: use an IANA name like Europe/Paris")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise InvalidTask(
            f"unknown time zone {name!r}: use an IANA name like Europe/Paris"
        ) from None


def _parse_interval(text: str) -> timedelta:
    match = _EVERY_RE.fullmatch(text)
    duration = _DURATION_RE.fullmatch(match[1]) if match else None
    if duration is None or not any(duration.groups()):
        raise InvalidTask(
            f"invalid schedule {text!r}: @every takes a duration like 30s, 5m, 1h30m or 1d"
        )
    days, hours, minutes, seconds = (int(part or 0) for part in duration.groups())
    try:
        interval = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    except OverflowError:
        interval = MAX_INTERVAL + _SECOND
    if not _SECOND <= interval <= MAX_INTERVAL:
        raise InvalidTask(f"an @every interval is 1s to {MAX_INTERVAL.days}d, got {match[1]}")  # type: ignore[index]
    return interval


def _resolve(wall: datetime, zone: ZoneInfo) -> datetime:
    """The instant (UTC) a naive wall-clock time in ``zone`` stands for: its first
    occurrence when it happens twice; the end of the gap when it does not exist."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    if first.astimezone(zone).replace(tzinfo=None) == wall:
        return first
    # In a gap: fold=0 reads the wall time with the offset before the jump (an instant
    # after it), fold=1 with the offset after (an instant before it). The jump is between
    # them, at a whole second: the first instant whose wall time is past ``wall``.
    other = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    low, high = min(first, other), max(first, other)
    while high - low > _SECOND:
        middle = low + ((high - low) // 2 // _SECOND) * _SECOND
        if middle.astimezone(zone).replace(tzinfo=None) >= wall:
            high = middle
        else:
            low = middle
    return high


# --------------------------------------------------------------------- slot tasks


def slot_text(slot: datetime) -> str:
    """The slot as the tasks carry it: RFC 3339 in UTC, whole seconds (``...Z``)."""
    return slot.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def slot_task_id(name: str, slot: datetime) -> str:
    """The id of the task entry ``name`` creates for ``slot``: a ULID whose time part is
    the slot and whose 80 other bits come from a hash of the name and the slot."""
    millis = (slot - _EPOCH) // timedelta(milliseconds=1)
    digest = hashlib.sha256(f"{name}\x00{slot_text(slot)}".encode()).digest()
    value = (millis << 80) | int.from_bytes(digest[:10], "big")
    alphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    return "".join(alphabet[(value >> shift) & 31] for shift in range(125, -5, -5))


def slot_unique_key(name: str, slot: datetime) -> str:
    """The unique key of the task entry ``name`` creates for ``slot``."""
    return f"cron:{name}:{slot_text(slot)}"


def slot_task(name: str, template: NewTask, slot: datetime) -> NewTask:
    """The task entry ``name`` (whose task template is ``template``) creates for
    ``slot``."""
    return replace(
        template,
        id=slot_task_id(name, slot),
        unique_key=slot_unique_key(name, slot),
        headers={**template.headers, CRON_HEADER: name, CRON_SLOT_HEADER: slot_text(slot)},
    )


def triggered_task(name: str, template: NewTask, now: datetime) -> NewTask:
    """The task a trigger-now of entry ``name`` creates: a fresh id, no unique key."""
    return replace(
        template,
        id=new_id(now),
        headers={**template.headers, CRON_HEADER: name, CRON_SLOT_HEADER: "manual"},
    )


@dataclass(frozen=True, slots=True)
class DueSlots:
    """What the scheduler does with an entry whose next run has come: fire ``slot``
    (None: create no task), and store ``next_run_at`` as the next run."""

    slot: datetime | None
    next_run_at: datetime | None
    missed: bool


def plan_fire(
    schedule: CronSchedule,
    next_run_at: datetime,
    now: datetime,
    misfire: CronMisfire,
    grace: timedelta,
) -> DueSlots:
    """What to do with an entry whose ``next_run_at`` is at or before ``now``.

    On time (at most ``grace`` late): fire that slot and move to the one after it (a
    scheduler that is a few slots behind fires each of them, one call at a time). Missed
    (later than ``grace``): per ``misfire``, one task for the first missed slot or none,
    and move on to the first slot no more than ``grace`` old.
    """
    if now - next_run_at <= grace:
        return DueSlots(next_run_at, schedule.next_after(next_run_at), missed=False)
    resume = schedule.at_or_after(now - grace)
    slot = next_run_at if misfire is CronMisfire.RUN_ONCE else None
    return DueSlots(slot, resume, missed=True)
