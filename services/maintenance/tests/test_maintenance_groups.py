"""The group sweeper (Maintenance.group_pass, the ``groups`` role) against a real
nats-server and a real broker on a FakeClock: the aggregation groups past their config's
size, max delay or grace period go to their queues' dispatchers as one ``GroupsDue`` per
queue, read here through a Bus subscription as a dispatcher would.

The passes are run by hand on a Maintenance that is not started (no role loop publishes
behind the test's back), but for the role's own test.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest
from conveyor_broker.clock import FakeClock
from conveyor_broker.interface import Broker
from conveyor_broker.types import DEFAULT_GROUP_MAX_SIZE, GroupConfig, NewTask
from conveyor_maintenance import Maintenance
from conveyor_maintenance.maintenance import GROUPS
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.nats_connect import NatsClient
from conveyor_runtime.settings import MaintenanceSettings
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.polling import wait_until

TICK = timedelta(microseconds=1)
HOUR = timedelta(hours=1)
DELAY = timedelta(seconds=10)


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
            "group_tick": 0.05,
            "leader_ttl": 1.0,
        }
        fields.update(overrides)
        return MaintenanceSettings(**fields)

    return make


@pytest.fixture
def sweeper(
    broker: Broker,
    nc: NatsClient,
    clock: FakeClock,
    make_settings: Callable[..., MaintenanceSettings],
) -> Maintenance:
    """A Maintenance whose passes the test runs itself."""
    return Maintenance(make_settings(), broker, nc, clock)


@pytest.fixture
async def heard(bus: Bus) -> AsyncIterator[list[cluster_pb2.GroupsDue]]:
    """Every GroupsDue published under the test's prefix, in order (every queue's)."""
    messages: list[cluster_pb2.GroupsDue] = []
    sub = await bus.subscribe(cluster_pb2.GroupsDue, messages.append)
    await bus.nc.flush()
    yield messages
    await sub.unsubscribe()


async def join(broker: Broker, clock: FakeClock, queue: str, group: str, n: int = 1) -> None:
    """``n`` members of ``group``, each a millisecond after the last."""
    for _ in range(n):
        await broker.enqueue(NewTask(queue=queue, type="t", group=group))
        clock.advance(timedelta(milliseconds=1))


def hints(message: cluster_pb2.GroupsDue) -> list[tuple[str, int, int]]:
    return [(h.group, h.size, h.max_size) for h in message.groups]


async def test_each_queue_gets_one_groups_due_with_its_due_groups(
    broker: Broker,
    clock: FakeClock,
    bus: Bus,
    sweeper: Maintenance,
    heard: list[cluster_pb2.GroupsDue],
) -> None:
    # "sized": due at 2 members; "delayed": due 10 s after its first member joined.
    await broker.set_group_config(
        GroupConfig("sized", max_size=2, max_delay=HOUR, grace_period=HOUR)
    )
    await broker.set_group_config(GroupConfig("delayed", max_delay=DELAY, grace_period=HOUR))
    start = clock.now()
    await join(broker, clock, "delayed", "h")
    await join(broker, clock, "sized", "a", 2)
    await join(broker, clock, "sized", "b", 3)  # past its size: due too, all 3 members
    await join(broker, clock, "sized", "c")  # not yet
    clock.set(start + DELAY - TICK)

    assert await sweeper.group_pass() == {"sized": 2}

    await wait_until(lambda: len(heard) == 1)
    (sized,) = heard
    assert sized.queue == "sized"
    assert hints(sized) == [("a", 2, 2), ("b", 3, 2)]

    # The delayed group is due at exactly its max delay; the sized ones are hinted again
    # (still due: nobody leased them).
    clock.set(start + DELAY)
    assert await sweeper.group_pass() == {"sized": 2, "delayed": 1}

    await wait_until(lambda: len(heard) == 3)
    by_queue = {message.queue: hints(message) for message in heard[1:]}
    assert by_queue == {
        "sized": [("a", 2, 2), ("b", 3, 2)],
        "delayed": [("h", 1, DEFAULT_GROUP_MAX_SIZE)],
    }
    assert sweeper.passes[GROUPS] == 0  # passes run by hand are not the role's


async def test_nothing_is_published_while_no_group_is_due(
    broker: Broker,
    clock: FakeClock,
    bus: Bus,
    sweeper: Maintenance,
    heard: list[cluster_pb2.GroupsDue],
) -> None:
    assert await sweeper.group_pass() == {}  # no group at all
    await broker.set_group_config(GroupConfig("q", max_size=5, max_delay=DELAY, grace_period=HOUR))
    start = clock.now()
    await join(broker, clock, "q", "g", 4)
    await broker.enqueue(NewTask(queue="q", type="t"))  # no group: never hinted
    clock.set(start + DELAY - TICK)
    assert await sweeper.group_pass() == {}

    clock.set(start + DELAY)
    assert await sweeper.group_pass() == {"q": 1}

    # Published in order on one connection: the first message heard is the last pass's.
    await wait_until(lambda: len(heard) >= 1)
    await bus.nc.flush()
    assert [(m.queue, hints(m)) for m in heard] == [("q", [("g", 4, 5)])]


async def test_members_leased_away_are_no_longer_hinted(
    broker: Broker,
    clock: FakeClock,
    bus: Bus,
    sweeper: Maintenance,
    heard: list[cluster_pb2.GroupsDue],
) -> None:
    await broker.set_group_config(GroupConfig("q", max_size=2, max_delay=HOUR, grace_period=HOUR))
    await join(broker, clock, "q", "g", 2)
    await join(broker, clock, "q", "h", 2)
    await broker.lease_group("q", "g", 2, timedelta(seconds=30))

    assert await sweeper.group_pass() == {"q": 1}

    await wait_until(lambda: len(heard) == 1)
    assert hints(heard[0]) == [("h", 2, 2)]


async def test_the_groups_role_hints_due_groups_every_tick(
    broker: Broker,
    clock: FakeClock,
    nc: NatsClient,
    make_settings: Callable[..., MaintenanceSettings],
    heard: list[cluster_pb2.GroupsDue],
) -> None:
    await broker.set_group_config(GroupConfig("q", max_size=1))
    m = Maintenance(make_settings(), broker, nc, clock)
    await m.start()
    try:
        await wait_until(lambda: m.leads(GROUPS))
        await wait_until(lambda: m.passes[GROUPS] >= 2)
        assert heard == []
        await join(broker, clock, "q", "g")
        # A hint, not a hand-over: the group is hinted on every pass while it is due.
        await wait_until(lambda: len(heard) >= 2)
        assert {(message.queue, tuple(hints(message))) for message in heard} == {
            ("q", (("g", 1, 1),))
        }
    finally:
        await m.stop()
