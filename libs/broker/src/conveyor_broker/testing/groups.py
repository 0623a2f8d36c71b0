"""Conformance: aggregation groups (configs, stats, due groups, LeaseGroup)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import GroupConfigNotFound, InvalidTask, LeaseLost
from conveyor_broker.interface import Broker
from conveyor_broker.testing.builders import TTL, enqueue
from conveyor_broker.types import (
    DEFAULT_GROUP_GRACE_PERIOD,
    DEFAULT_GROUP_MAX_DELAY,
    DEFAULT_GROUP_MAX_SIZE,
    GroupConfig,
    GroupTrigger,
    LeaseReapParams,
    TaskEvent,
    TaskState,
)

QUEUE = "batches"
TICK = timedelta(microseconds=1)


async def join(broker: Broker, group: str, queue: str = QUEUE, **options: object) -> str:
    """Enqueue one member of ``group``; its id."""
    return (await enqueue(broker, queue, group=group, **options)).id


class GroupTests:
    """set/delete/list_group_configs, group_stats, due_groups and lease_group."""

    async def test_group_configs_set_replace_list_delete(self, broker: Broker) -> None:
        assert await broker.list_group_configs() == []
        base = await broker.set_group_config(GroupConfig(QUEUE))
        assert base == GroupConfig(
            QUEUE, "*", DEFAULT_GROUP_MAX_SIZE, DEFAULT_GROUP_MAX_DELAY, DEFAULT_GROUP_GRACE_PERIOD
        )
        tenant = GroupConfig(
            QUEUE, "tenant-*", 10, timedelta(seconds=3, microseconds=7), timedelta(seconds=1)
        )
        assert await broker.set_group_config(tenant) == tenant
        other = await broker.set_group_config(GroupConfig("other", "x?", 5))
        assert await broker.list_group_configs() == [base, tenant, other]
        assert await broker.list_group_configs(QUEUE) == [base, tenant]
        replaced = await broker.set_group_config(GroupConfig(QUEUE, "tenant-*", 20))
        assert await broker.list_group_configs(QUEUE) == [base, replaced]
        await broker.delete_group_config(QUEUE, "tenant-*")
        assert await broker.list_group_configs(QUEUE) == [base]
        with pytest.raises(GroupConfigNotFound):
            await broker.delete_group_config(QUEUE, "tenant-*")
        await broker.delete_group_config(QUEUE)
        assert await broker.list_group_configs() == [other]

    @pytest.mark.parametrize(
        "config",
        [
            GroupConfig("bad queue"),
            GroupConfig(QUEUE, ""),
            GroupConfig(QUEUE, "a\nb"),
            GroupConfig(QUEUE, max_size=0),
            GroupConfig(QUEUE, max_size=1001),
            GroupConfig(QUEUE, max_delay=timedelta(0)),
            GroupConfig(QUEUE, grace_period=timedelta(seconds=-1)),
            GroupConfig(QUEUE, max_delay=timedelta(days=1, microseconds=1)),
        ],
        ids=["queue", "empty-pattern", "control", "size-0", "size-big", "delay-0", "grace", "long"],
    )
    async def test_bad_group_configs_are_refused(self, broker: Broker, config: GroupConfig) -> None:
        with pytest.raises(InvalidTask):
            await broker.set_group_config(config)
        assert await broker.list_group_configs() == []

    async def test_group_stats(self, broker: Broker, clock: FakeClock) -> None:
        first = clock.now()
        await join(broker, "b")
        clock.advance(timedelta(seconds=1))
        await join(broker, "a")
        last = clock.advance(timedelta(seconds=2, microseconds=5))
        await join(broker, "b")
        await join(broker, "a", queue="other")
        await enqueue(broker, QUEUE)  # no group
        stats = await broker.group_stats()
        assert [(s.queue, s.group, s.size) for s in stats] == [
            (QUEUE, "a", 1),
            (QUEUE, "b", 2),
            ("other", "a", 1),
        ]
        assert (stats[1].oldest_at, stats[1].newest_at) == (first, last)
        assert [s.group for s in await broker.group_stats(QUEUE, limit=1)] == ["a"]
        assert [s.queue for s in await broker.group_stats("other")] == ["other"]

    async def test_a_group_is_due_at_its_size(self, broker: Broker) -> None:
        await broker.set_group_config(GroupConfig(QUEUE, max_size=3))
        for _ in range(2):
            await join(broker, "g")
        assert await broker.due_groups() == []
        await join(broker, "g")
        [due] = await broker.due_groups()
        assert (due.queue, due.group, due.size, due.trigger, due.max_size) == (
            QUEUE,
            "g",
            3,
            GroupTrigger.SIZE,
            3,
        )

    async def test_a_group_is_due_exactly_at_its_max_delay(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        delay = timedelta(seconds=10)
        await broker.set_group_config(
            GroupConfig(QUEUE, max_delay=delay, grace_period=timedelta(hours=1))
        )
        start = clock.now()
        await join(broker, "g")
        for _ in range(4):  # members keep coming: the grace period never lapses
            clock.advance(timedelta(seconds=2))
            await join(broker, "g")
        clock.set(start + delay - TICK)
        assert await broker.due_groups() == []
        clock.set(start + delay)
        [due] = await broker.due_groups()
        assert due.trigger is GroupTrigger.MAX_DELAY
        assert due.size == 5

    async def test_a_group_is_due_exactly_at_its_grace_period(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        grace = timedelta(seconds=3)
        await broker.set_group_config(
            GroupConfig(QUEUE, max_delay=timedelta(hours=1), grace_period=grace)
        )
        await join(broker, "g")
        last = clock.advance(timedelta(seconds=2))
        await join(broker, "g")
        clock.set(last + grace - TICK)
        assert await broker.due_groups() == []
        clock.set(last + grace)
        [due] = await broker.due_groups()
        assert due.trigger is GroupTrigger.GRACE_PERIOD

    async def test_defaults_apply_without_a_config(self, broker: Broker, clock: FakeClock) -> None:
        start = clock.now()
        await join(broker, "g")
        clock.set(start + DEFAULT_GROUP_GRACE_PERIOD - TICK)
        assert await broker.due_groups() == []
        clock.set(start + DEFAULT_GROUP_GRACE_PERIOD)
        [due] = await broker.due_groups()
        assert (due.trigger, due.max_size) == (GroupTrigger.GRACE_PERIOD, DEFAULT_GROUP_MAX_SIZE)

    async def test_the_longest_matching_pattern_applies(self, broker: Broker) -> None:
        await broker.set_group_config(GroupConfig(QUEUE, "*", max_size=2))
        await broker.set_group_config(GroupConfig(QUEUE, "tenant-*", max_size=3))
        await broker.set_group_config(GroupConfig(QUEUE, "tenant-?", max_size=4))
        await broker.set_group_config(GroupConfig(QUEUE, "100%_", max_size=1))
        await broker.set_group_config(GroupConfig("other", "*", max_size=1))
        for group in ("plain", "tenant-42", "tenant-7", "100%_", "100ab"):
            for _ in range(2):
                await join(broker, group)
        due = {d.group: d.max_size for d in await broker.due_groups()}
        # plain: "*" (2, due); tenant-42: "tenant-*" (3); tenant-7: "tenant-?" (4); the
        # literal "100%_" matches itself only; "100ab" takes "*".
        assert due == {"plain": 2, "100%_": 1, "100ab": 2}

    async def test_due_groups_oldest_first_and_limited(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_group_config(GroupConfig(QUEUE, max_size=1))
        await broker.set_group_config(GroupConfig("other", max_size=1))
        for group in ("late", "early"):
            await join(broker, group, queue="other" if group == "early" else QUEUE)
            clock.advance(timedelta(seconds=1))
        await join(broker, "later")
        assert [d.group for d in await broker.due_groups()] == ["late", "early", "later"]
        assert [d.group for d in await broker.due_groups(limit=2)] == ["late", "early"]
        with pytest.raises(InvalidTask):
            await broker.due_groups(limit=0)

    async def test_lease_group_leases_members_as_one_delivery(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        events: list[TaskEvent] = []
        ids = []
        for _ in range(3):
            ids.append(await join(broker, "g"))
            clock.advance(timedelta(milliseconds=1))
        other_group = await join(broker, "h")
        other_queue = await join(broker, "g", queue="other")
        broker.set_event_sink(events.append)
        now = clock.advance(timedelta(seconds=1))
        leased = await broker.lease_group(QUEUE, "g", 2, TTL, holder="api-1")
        assert [t.id for t in leased] == ids[:2]
        assert {t.holder for t in leased} == {"api-1"}
        assert {t.lease_id for t in leased} == {leased[0].lease_id}
        assert leased[0].lease_id is not None
        for task in leased:
            assert task.state is TaskState.ACTIVE
            assert task.lease_expires_at == now + TTL
            assert task.started_at == now
            assert await broker.get_task(task.id) == task
        assert [(e.task_id, e.previous_state, e.state) for e in events] == [
            (i, TaskState.AGGREGATING, TaskState.ACTIVE) for i in ids[:2]
        ]
        rest = await broker.lease_group(QUEUE, "g", 10, TTL)
        assert [t.id for t in rest] == ids[2:]
        assert rest[0].lease_id != leased[0].lease_id
        assert await broker.lease_group(QUEUE, "g", 10, TTL) == []
        for untouched in (other_group, other_queue):
            assert (await broker.get_task(untouched)).state is TaskState.AGGREGATING
        # Outcomes are per member, under the shared lease.
        lease_id = leased[0].lease_id
        await broker.ack(ids[0], lease_id)
        await broker.fail(ids[1], lease_id, "boom", timedelta(0))
        with pytest.raises(LeaseLost):
            await broker.ack(ids[2], lease_id)
        # The failed member waits in its group again.
        assert [(s.group, s.size) for s in await broker.group_stats(QUEUE)] == [("g", 1), ("h", 1)]

    async def test_a_failed_member_waits_out_its_retry_in_its_group(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_group_config(GroupConfig(QUEUE, max_size=1))  # due at once
        ids = [await join(broker, "g") for _ in range(2)]
        leased = await broker.lease_group(QUEUE, "g", 2, TTL)
        lease_id = leased[0].lease_id
        assert lease_id is not None
        failed = await broker.fail(ids[0], lease_id, "boom", timedelta(seconds=10))
        assert failed.state is TaskState.AGGREGATING
        assert (failed.retried, failed.last_error, failed.lease_id) == (1, "boom", None)
        assert failed.available_at == clock.now() + timedelta(seconds=10)
        released = await broker.release(ids[1], lease_id)
        assert released.state is TaskState.AGGREGATING
        assert released.retried == 0
        # Never leased on its own, and its group holds it back until its retry is due.
        assert await broker.lease(QUEUE, 10, TTL) == []
        assert [(s.group, s.size) for s in await broker.group_stats(QUEUE)] == [("g", 2)]
        (due,) = await broker.due_groups()
        assert due.size == 1  # only the released member is due yet
        assert due.trigger is GroupTrigger.SIZE
        clock.advance(timedelta(seconds=10) - TICK)
        assert [t.id for t in await broker.lease_group(QUEUE, "g", 2, TTL)] == [ids[1]]
        assert await broker.due_groups() == []
        clock.advance(TICK)
        (due,) = await broker.due_groups()
        assert (due.group, due.size) == ("g", 1)
        again = await broker.lease_group(QUEUE, "g", 2, TTL)
        assert [(t.id, t.state, t.retried) for t in again] == [(ids[0], TaskState.ACTIVE, 1)]

    async def test_a_reaped_member_goes_back_to_its_group_or_is_archived(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        kept = await join(broker, "g", max_retry=1)
        last = await join(broker, "g", max_retry=0)
        await broker.lease_group(QUEUE, "g", 2, TTL)
        clock.advance(TTL)
        reaped = await broker.reap_expired_leases(LeaseReapParams(retry_delay=timedelta(seconds=5)))
        assert {(r.task_id, r.state) for r in reaped} == {
            (kept, TaskState.AGGREGATING),
            (last, TaskState.ARCHIVED),
        }
        back = await broker.get_task(kept)
        assert (back.state, back.retried) == (TaskState.AGGREGATING, 1)
        assert back.available_at == clock.now() + timedelta(seconds=5)
        assert (await broker.get_task(last)).state is TaskState.ARCHIVED
        assert await broker.lease(QUEUE, 10, TTL) == []
        clock.advance(timedelta(seconds=5))
        assert [t.id for t in await broker.lease_group(QUEUE, "g", 2, TTL)] == [kept]

    async def test_lease_group_skips_expired_members(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        expiring = await join(broker, "g", expires_at=clock.now() + timedelta(seconds=1))
        kept = await join(broker, "g")
        clock.advance(timedelta(seconds=1))
        assert [t.id for t in await broker.lease_group(QUEUE, "g", 10, TTL)] == [kept]
        assert (await broker.get_task(expiring)).state is TaskState.AGGREGATING

    async def test_lease_group_checks_its_input(self, broker: Broker) -> None:
        for args in (("bad queue", "g", 1, TTL), (QUEUE, "", 1, TTL), (QUEUE, "g", 0, TTL)):
            with pytest.raises(InvalidTask):
                await broker.lease_group(*args)
        with pytest.raises(InvalidTask):
            await broker.lease_group(QUEUE, "g", 1, timedelta(0))
