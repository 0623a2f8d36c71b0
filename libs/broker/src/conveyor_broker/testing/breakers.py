"""Conformance: circuit breakers per task type (their configs, the stored breakers, the
queue-wide probe), lease's type filters, and the breakers of dead holders."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import BreakerConfigNotFound, InvalidTask
from conveyor_broker.ids import new_id
from conveyor_broker.interface import MAX_BREAKER_NAME_LEN, MAX_TYPE_FILTER, Broker
from conveyor_broker.testing.builders import OTHER_QUEUE, QUEUE, TTL, enqueue
from conveyor_broker.types import (
    Breaker,
    BreakerConfig,
    BreakerScope,
    BreakerStatus,
    ConcurrencyLimit,
    HolderReleaseParams,
    Task,
    TaskState,
)

SILENCE = timedelta(seconds=3)
COOLDOWN = timedelta(seconds=10)
LAPSE = timedelta(seconds=5)


def _breaker(clock: FakeClock, **options: Any) -> Breaker:
    """An OPEN breaker of QUEUE (queue-wide unless a gateway is given), opened now."""
    now = clock.now()
    fields: dict[str, Any] = {
        "queue": QUEUE,
        "type": "email.send",
        "status": BreakerStatus.OPEN,
        "opened_at": now,
        "until": now + COOLDOWN,
        "failures": 5,
    }
    fields.update(options)
    return Breaker(**fields)


def _holder(clock: FakeClock, name: str) -> str:
    """A holder name no other test uses (holders outlive a test in some brokers)."""
    return f"{name}-{new_id(clock.now())}"


async def _typed(broker: Broker, clock: FakeClock, types: list[str], **options: Any) -> list[Task]:
    """Enqueue one task per type, each a microsecond after the last (lease order)."""
    tasks = []
    for task_type in types:
        tasks.append(await enqueue(broker, type=task_type, **options))
        clock.advance(timedelta(microseconds=1))
    return tasks


async def _state(broker: Broker, task: Task) -> TaskState:
    return (await broker.get_task(task.id)).state


class BreakerConfigTests:
    """set/list/delete_breaker_config."""

    async def test_configs_set_replace_list_delete(self, broker: Broker) -> None:
        assert await broker.list_breaker_configs() == []
        every = await broker.set_breaker_config(BreakerConfig(QUEUE))
        assert every == BreakerConfig(QUEUE, "*", 5, timedelta(seconds=60), timedelta(seconds=30))
        assert every.scope is BreakerScope.WORKER
        email = await broker.set_breaker_config(
            BreakerConfig(
                QUEUE,
                "email.*",
                failures=3,
                window=timedelta(seconds=10),
                cooldown=timedelta(minutes=2),
                scope=BreakerScope.QUEUE,
            )
        )
        upper = await broker.set_breaker_config(BreakerConfig(QUEUE, "Z*", failures=1))
        other = await broker.set_breaker_config(BreakerConfig(OTHER_QUEUE, "x?"))
        # Code point order: "Z*" before "email.*".
        assert await broker.list_breaker_configs() == [every, upper, email, other]
        assert await broker.list_breaker_configs(QUEUE) == [every, upper, email]
        assert await broker.list_breaker_configs("nothing-here") == []
        replaced = await broker.set_breaker_config(
            BreakerConfig(QUEUE, "email.*", failures=7, scope=BreakerScope.WORKER)
        )
        assert await broker.list_breaker_configs(QUEUE) == [every, upper, replaced]
        await broker.delete_breaker_config(QUEUE)
        with pytest.raises(BreakerConfigNotFound):
            await broker.delete_breaker_config(QUEUE)
        await broker.delete_breaker_config(QUEUE, "email.*")
        await broker.delete_breaker_config(QUEUE, "Z*")
        assert await broker.list_breaker_configs() == [other]

    async def test_an_unknown_config_is_not_found(self, broker: Broker) -> None:
        await broker.set_breaker_config(BreakerConfig(QUEUE, "a*"))
        with pytest.raises(BreakerConfigNotFound) as raised:
            await broker.delete_breaker_config(QUEUE, "b*")
        assert (raised.value.queue, raised.value.pattern) == (QUEUE, "b*")
        with pytest.raises(BreakerConfigNotFound):
            await broker.delete_breaker_config(OTHER_QUEUE, "a*")
        assert len(await broker.list_breaker_configs()) == 1

    async def test_times_are_stored_to_the_millisecond(self, broker: Broker) -> None:
        stored = await broker.set_breaker_config(
            BreakerConfig(
                QUEUE,
                window=timedelta(seconds=1, microseconds=1999),
                cooldown=timedelta(milliseconds=100, microseconds=999),
            )
        )
        assert stored.window == timedelta(seconds=1, milliseconds=1)
        assert stored.cooldown == timedelta(milliseconds=100)
        assert await broker.list_breaker_configs() == [stored]

    @pytest.mark.parametrize(
        "config",
        [
            BreakerConfig("bad queue"),
            BreakerConfig(""),
            BreakerConfig(QUEUE, failures=0),
            BreakerConfig(QUEUE, failures=-1),
            BreakerConfig(QUEUE, failures=10_001),
            BreakerConfig(QUEUE, failures=1.5),  # type: ignore[arg-type]
            BreakerConfig(QUEUE, failures=True),
            BreakerConfig(QUEUE, window=timedelta(milliseconds=999)),
            BreakerConfig(QUEUE, window=timedelta(days=1, seconds=1)),
            BreakerConfig(QUEUE, window=60),  # type: ignore[arg-type]
            BreakerConfig(QUEUE, cooldown=timedelta(milliseconds=99)),
            BreakerConfig(QUEUE, cooldown=timedelta(days=2)),
            BreakerConfig(QUEUE, cooldown=timedelta(0)),
            BreakerConfig(QUEUE, ""),
            BreakerConfig(QUEUE, "x" * 300),
            BreakerConfig(QUEUE, "a\x00"),
            BreakerConfig(QUEUE, "a\n"),
            BreakerConfig(QUEUE, scope="both"),  # type: ignore[arg-type]
        ],
        ids=lambda config: repr(config)[:80],
    )
    async def test_a_bad_config_is_refused_and_the_stored_ones_kept(
        self, broker: Broker, config: BreakerConfig
    ) -> None:
        stored = await broker.set_breaker_config(BreakerConfig(QUEUE, failures=2))
        with pytest.raises(InvalidTask):
            await broker.set_breaker_config(config)
        assert await broker.list_breaker_configs() == [stored]

    async def test_bad_names_are_refused_by_list_and_delete(self, broker: Broker) -> None:
        await broker.set_breaker_config(BreakerConfig(QUEUE))
        with pytest.raises(InvalidTask):
            await broker.list_breaker_configs("bad queue")
        with pytest.raises(InvalidTask):
            await broker.delete_breaker_config("bad queue")
        with pytest.raises(InvalidTask):
            await broker.delete_breaker_config(QUEUE, "")
        assert len(await broker.list_breaker_configs()) == 1


class StoredBreakerTests:
    """put/drop/list_breakers and take_probe."""

    async def test_breakers_put_replace_list_drop(self, broker: Broker, clock: FakeClock) -> None:
        assert await broker.list_breakers() == []
        wide = _breaker(clock)
        mine = _breaker(clock, gateway="gw-2", worker_id="w-2", holder="api-1")
        theirs = _breaker(clock, gateway="gw-1", worker_id="w-1", holder="api-2")
        upper = _breaker(clock, type="Zip", failures=0)
        other = _breaker(clock, queue=OTHER_QUEUE, type="a")
        for breaker in (mine, other, wide, upper, theirs):
            await broker.put_breaker(breaker)
        # By queue, type (code point order: "Zip" first), gateway ("" first).
        assert await broker.list_breakers() == [upper, wide, theirs, mine, other]
        assert await broker.list_breakers(OTHER_QUEUE) == [other]
        assert await broker.list_breakers("nothing-here") == []
        assert wide.scope is BreakerScope.QUEUE
        assert mine.scope is BreakerScope.WORKER
        clock.advance(COOLDOWN)
        half_open = replace(
            mine,
            status=BreakerStatus.HALF_OPEN,
            until=clock.now() + LAPSE,
            failures=6,
            worker_id="w-3",
            holder="",
        )
        await broker.put_breaker(half_open)
        assert await broker.list_breakers(QUEUE) == [upper, wide, theirs, half_open]
        assert await broker.drop_breaker(QUEUE, "email.send", "gw-2") is True
        assert await broker.drop_breaker(QUEUE, "email.send", "gw-2") is False
        assert await broker.drop_breaker(QUEUE, "email.send") is True
        assert await broker.drop_breaker(QUEUE, "email.send") is False
        assert await broker.drop_breaker(QUEUE, "nothing", "gw-1") is False
        assert await broker.list_breakers() == [upper, theirs, other]

    @pytest.mark.parametrize(
        "options",
        [
            {"queue": "bad queue"},
            {"type": ""},
            {"type": "t" * 300},
            {"type": "t\x00"},
            {"status": "open"},
            {"status": None},
            {"opened_at": datetime(2030, 1, 1)},
            {"until": datetime(2030, 1, 1)},
            {"until": None},
            {"failures": -1},
            {"failures": 1.5},
            {"failures": True},
            {"gateway": "g\x00"},
            {"gateway": "g" * (MAX_BREAKER_NAME_LEN + 1)},
            {"gateway": None},
            {"worker_id": "w\n"},
            {"holder": "h\x00"},
            {"holder": "h" * 300},
        ],
        ids=lambda options: repr(options)[:60],
    )
    async def test_a_bad_breaker_is_refused_and_the_stored_ones_kept(
        self, broker: Broker, clock: FakeClock, options: dict[str, Any]
    ) -> None:
        stored = _breaker(clock, gateway="gw")
        await broker.put_breaker(stored)
        with pytest.raises(InvalidTask):
            await broker.put_breaker(_breaker(clock, **{"gateway": "gw", **options}))
        assert await broker.list_breakers() == [stored]

    async def test_bad_names_are_refused_by_drop_list_and_take_probe(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.put_breaker(_breaker(clock))
        with pytest.raises(InvalidTask):
            await broker.drop_breaker("bad queue", "t")
        with pytest.raises(InvalidTask):
            await broker.drop_breaker(QUEUE, "")
        with pytest.raises(InvalidTask):
            await broker.drop_breaker(QUEUE, "t", "g\x00")
        with pytest.raises(InvalidTask):
            await broker.list_breakers("bad queue")
        clock.advance(COOLDOWN)
        with pytest.raises(InvalidTask):
            await broker.take_probe("bad queue", "email.send", clock.now() + LAPSE)
        with pytest.raises(InvalidTask):
            await broker.take_probe(QUEUE, "", clock.now() + LAPSE)
        with pytest.raises(InvalidTask):
            await broker.take_probe(QUEUE, "email.send", datetime(2031, 1, 1))
        assert [b.status for b in await broker.list_breakers()] == [BreakerStatus.OPEN]

    async def test_take_probe_takes_a_due_probe_once(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        opened = _breaker(clock)
        await broker.put_breaker(opened)
        # Too early: nothing changes.
        clock.advance(COOLDOWN - timedelta(milliseconds=1))
        assert await broker.take_probe(QUEUE, "email.send", clock.now() + LAPSE) is False
        assert await broker.list_breakers() == [opened]
        # Due (at its until exactly): taken once.
        clock.advance(timedelta(milliseconds=1))
        until = clock.now() + LAPSE
        assert await broker.take_probe(QUEUE, "email.send", until) is True
        probing = replace(opened, status=BreakerStatus.HALF_OPEN, until=until)
        assert await broker.list_breakers() == [probing]
        assert await broker.take_probe(QUEUE, "email.send", clock.now() + LAPSE) is False
        assert await broker.list_breakers() == [probing]
        # The probe's chance lapsed: another may go.
        clock.advance(LAPSE)
        again = clock.now() + LAPSE
        assert await broker.take_probe(QUEUE, "email.send", again) is True
        assert await broker.list_breakers() == [replace(probing, until=again)]

    async def test_take_probe_needs_a_stored_queue_wide_breaker(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        assert await broker.take_probe(QUEUE, "email.send", clock.now() + LAPSE) is False
        own = _breaker(clock, gateway="gw", holder="api-1")
        other_type = _breaker(clock, type="other")
        await broker.put_breaker(own)
        await broker.put_breaker(_breaker(clock, queue=OTHER_QUEUE))
        await broker.put_breaker(other_type)
        assert await broker.drop_breaker(OTHER_QUEUE, "email.send")
        clock.advance(COOLDOWN)
        # A gateway's own breaker is its gateway's: it has no probe to take here.
        assert await broker.take_probe(QUEUE, "email.send", clock.now() + LAPSE) is False
        assert await broker.take_probe(OTHER_QUEUE, "email.send", clock.now() + LAPSE) is False
        assert await broker.list_breakers() == [own, other_type]

    async def test_of_concurrent_probe_takers_exactly_one_wins(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.put_breaker(_breaker(clock))
        clock.advance(COOLDOWN)
        until = clock.now() + LAPSE
        taken = await asyncio.gather(
            *(broker.take_probe(QUEUE, "email.send", until) for _ in range(8))
        )
        assert sorted(taken) == [False] * 7 + [True]
        [breaker] = await broker.list_breakers()
        assert (breaker.status, breaker.until) == (BreakerStatus.HALF_OPEN, until)


class LeaseFilterTests:
    """lease(exclude_types=..., only_types=...)."""

    async def test_exclude_types_leaves_those_types_waiting(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        a, b, c, b2 = await _typed(broker, clock, ["a", "b", "c", "b"])
        leased = await broker.lease(QUEUE, 10, TTL, exclude_types=["b"])
        assert [t.id for t in leased] == [a.id, c.id]
        assert [await _state(broker, t) for t in (b, b2)] == [TaskState.PENDING] * 2
        assert [t.id for t in await broker.lease(QUEUE, 10, TTL)] == [b.id, b2.id]

    async def test_only_types_leases_only_those_types(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        a, b, c, d = await _typed(broker, clock, ["a", "b", "c", "d"])
        leased = await broker.lease(QUEUE, 10, TTL, only_types={"b", "d", "missing"})
        assert [t.id for t in leased] == [b.id, d.id]
        assert await broker.lease(QUEUE, 10, TTL, only_types=[]) == []
        assert [t.id for t in await broker.lease(QUEUE, 1, TTL, only_types=("c", "a"))] == [a.id]
        assert [await _state(broker, t) for t in (a, b, c, d)] == [
            TaskState.ACTIVE,
            TaskState.ACTIVE,
            TaskState.PENDING,
            TaskState.ACTIVE,
        ]

    async def test_both_filters_apply_together(self, broker: Broker, clock: FakeClock) -> None:
        a, _b, _c = await _typed(broker, clock, ["a", "b", "c"])
        leased = await broker.lease(QUEUE, 10, TTL, exclude_types=["b"], only_types=["a", "b"])
        assert [t.id for t in leased] == [a.id]
        assert await broker.lease(QUEUE, 10, TTL, exclude_types=["b"], only_types=["b"]) == []

    async def test_filters_keep_the_limit_and_the_holders(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await _typed(broker, clock, ["a"] * 5)
        await _typed(broker, clock, ["b"] * 2)
        leased = await broker.lease(QUEUE, 3, TTL, holders=["h1", "h2"], exclude_types=["b"])
        assert [t.type for t in leased] == ["a"] * 3
        assert sorted(t.holder or "" for t in leased) == ["", "h1", "h2"]
        leased = await broker.lease(QUEUE, 3, TTL, only_types=["b"])
        assert [t.type for t in leased] == ["b"] * 2

    async def test_filters_on_a_queue_with_concurrency_limits(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 1))
        a1, a2 = await _typed(broker, clock, ["a", "a"], concurrency_key="k")
        b1, b2 = await _typed(broker, clock, ["b", "b"], concurrency_key="k2")
        # Filtered-out tasks are neither leased nor parked.
        leased = await broker.lease(QUEUE, 10, TTL, exclude_types=["a"])
        assert [t.id for t in leased] == [b1.id]
        assert [await _state(broker, t) for t in (a1, a2, b2)] == [
            TaskState.PENDING,
            TaskState.PENDING,
            TaskState.HELD,
        ]
        # The limit still holds under a filter: one "a" of key k runs, the other waits.
        leased = await broker.lease(QUEUE, 10, TTL, only_types=["a"])
        assert [t.id for t in leased] == [a1.id]
        assert await _state(broker, a2) == TaskState.HELD
        assert await broker.lease(QUEUE, 10, TTL, only_types=["a", "b"]) == []
        # A task of a key with room again comes back under a filter too.
        running = await broker.get_task(a1.id)
        assert running.lease_id is not None
        await broker.ack(running.id, running.lease_id)
        assert await broker.lease(QUEUE, 10, TTL, only_types=["b"]) == []
        assert [t.id for t in await broker.lease(QUEUE, 10, TTL, exclude_types=["b"])] == [a2.id]

    async def test_a_filter_on_a_limited_queue_still_counts_every_active_task(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_concurrency_limit(ConcurrencyLimit(QUEUE, 2))
        await _typed(broker, clock, ["a", "b", "a", "b", "a"], concurrency_key="k")
        first = await broker.lease(QUEUE, 10, TTL, only_types=["b"])
        assert [t.type for t in first] == ["b", "b"]
        # Key k is full (two "b"s run): no "a" goes, whatever the filter lets through.
        assert await broker.lease(QUEUE, 10, TTL, exclude_types=["b"]) == []
        stats = (await broker.queue_stats(QUEUE))[0]
        assert stats.count(TaskState.ACTIVE) == 2

    @pytest.mark.parametrize(
        "filters",
        [
            {"exclude_types": "abc"},
            {"only_types": "abc"},
            {"exclude_types": [""]},
            {"exclude_types": ["a\x00"]},
            {"only_types": ["t" * 300]},
            {"only_types": [1]},
            {"exclude_types": [f"t{n}" for n in range(MAX_TYPE_FILTER + 1)]},
            {"only_types": [f"t{n}" for n in range(MAX_TYPE_FILTER + 1)]},
        ],
        ids=lambda filters: repr(filters)[:40],
    )
    async def test_bad_filters_are_refused(
        self, broker: Broker, clock: FakeClock, filters: dict[str, Any]
    ) -> None:
        [task] = await _typed(broker, clock, ["a"])
        with pytest.raises(InvalidTask):
            await broker.lease(QUEUE, 10, TTL, **filters)
        assert await _state(broker, task) == TaskState.PENDING

    async def test_a_full_filter_is_accepted(self, broker: Broker, clock: FakeClock) -> None:
        [task] = await _typed(broker, clock, ["a"])
        many = [f"t{n}" for n in range(MAX_TYPE_FILTER)]
        assert await broker.lease(QUEUE, 10, TTL, exclude_types=many, only_types=many) == []
        [leased] = await broker.lease(QUEUE, 10, TTL, exclude_types=many)
        assert leased.id == task.id


class DeadHolderBreakerTests:
    """release_dead_holders drops the breakers of dead holders."""

    async def test_a_dead_holders_breakers_are_dropped(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        dead = _holder(clock, "api-dead")
        idle = _holder(clock, "api-idle")
        alive = _holder(clock, "api-alive")
        for holder in (dead, idle, alive):
            await broker.beat_holder(holder)
        await enqueue(broker)
        [task] = await broker.lease(QUEUE, 1, TTL, holders=[dead])
        wide = _breaker(clock)
        of_dead = [
            _breaker(clock, gateway="gw-1", holder=dead),
            _breaker(clock, gateway="gw-2", holder=dead, type="other"),
            _breaker(clock, queue=OTHER_QUEUE, gateway="gw-1", holder=dead),
        ]
        of_idle = _breaker(clock, gateway="gw-3", holder=idle)
        of_alive = _breaker(clock, gateway="gw-4", holder=alive)
        unheld = _breaker(clock, gateway="gw-5")
        for breaker in [wide, *of_dead, of_idle, of_alive, unheld]:
            await broker.put_breaker(breaker)
        clock.advance(SILENCE)
        await broker.beat_holder(alive)
        # Nobody is dead yet: nothing goes.
        released = await broker.release_dead_holders(
            HolderReleaseParams(silence=SILENCE + timedelta(seconds=1))
        )
        assert released == []
        assert len(await broker.list_breakers()) == 7
        # The dead one (holding a task) and the idle one (holding none) are dead now;
        # the alive one beat, and one named alive is not dead either.
        released = await broker.release_dead_holders(
            HolderReleaseParams(silence=SILENCE, alive=frozenset({idle}))
        )
        assert [r.task_id for r in released] == [task.id]
        assert await broker.list_breakers() == [wide, of_idle, of_alive, unheld]
        released = await broker.release_dead_holders(HolderReleaseParams(silence=SILENCE, limit=1))
        assert released == []
        assert await broker.list_breakers() == [wide, of_alive, unheld]


class BreakerTests(
    BreakerConfigTests, StoredBreakerTests, LeaseFilterTests, DeadHolderBreakerTests
):
    """Everything above: what circuit breakers need of a broker."""
