"""Aggregation groups end to end, through real processes: members enqueued with a
``group`` are delivered as whole batches that respect their group's config, each member
exactly once; a batch whose worker is killed -9 comes back whole; the sweeper's leader
killed -9 leaves another maintenance process firing the due groups."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
from conveyor import AsyncAdminClient, AsyncClient, spec
from conveyor_broker import TaskListParams, TaskState
from conveyor_broker.postgres import PostgresBroker
from conveyor_testkit.polling import wait_until

from tests.e2e.conftest import read_record
from tests.e2e.harness import POLL_INTERVAL, Cluster, Proc

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

BATCH = "e2e.batch"
GROUPS_ELECTED = "maintenance.leader_elected role=groups"


def batches(record: Path) -> list[tuple[str, list[str], str]]:
    """The batches the workers started: (group, member ids, pid)."""
    return [
        (fields[1], fields[2].split(","), fields[3])
        for fields in read_record(record)
        if fields[0] == "batch"
    ]


async def completed(store: PostgresBroker, queue: str, n: int) -> bool:
    page = await store.list_tasks(
        TaskListParams(queue=queue, state=TaskState.COMPLETED, limit=1000)
    )
    seen = len(page.tasks)
    cursor = page.next_cursor
    while cursor and seen < n:
        page = await store.list_tasks(
            TaskListParams(queue=queue, state=TaskState.COMPLETED, limit=1000, cursor=cursor)
        )
        seen += len(page.tasks)
        cursor = page.next_cursor
    return seen >= n


async def _leader(maintenance: list[Proc]) -> Proc:
    leaders: list[Proc] = []

    def elected() -> bool:
        leaders[:] = [p for p in maintenance if p.alive() and GROUPS_ELECTED in p.log()]
        return len(leaders) == 1

    await wait_until(elected, within=60, interval=POLL_INTERVAL, message="a groups leader")
    return leaders[0]


@pytest.mark.timeout(300)
async def test_ten_thousand_members_arrive_in_batches_that_respect_the_config(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    queue = "groups-e2e"
    cluster.settings_env.update({"CONVEYOR_GROUP_TICK": "0.2"})
    api = await cluster.start_api()
    cluster.start_dispatcher()
    cluster.start_maintenance()
    target = f"127.0.0.1:{api.port}"
    record = tmp_path / "record.txt"
    async with AsyncAdminClient(target) as admin:
        # Size fires: 100 members per group, at most 30 per delivery; the delay makes the
        # rest (the last 10 of each group) go once the enqueue is over.
        await admin.set_group_config(
            queue, max_size=30, max_delay=timedelta(seconds=2), grace_period=timedelta(seconds=1)
        )
    groups = [f"g{n:03d}" for n in range(100)]
    ids: set[str] = set()
    async with AsyncClient(target) as client:
        for _ in range(10):
            items = [spec(BATCH, {"n": i}, queue=queue, group=groups[i % 100]) for i in range(1000)]
            for result in await client.enqueue_batch(items):
                assert result.task is not None, result.error
                ids.add(result.task.id)
    assert len(ids) == 10_000
    cluster.start_worker(target, queues={queue: 1}, concurrency=8, record=record)
    cluster.start_worker(target, queues={queue: 1}, concurrency=8, record=record)

    await wait_until(
        lambda: completed(store, queue, 10_000),
        within=180,
        interval=POLL_INTERVAL,
        message="every member completed",
    )
    seen = batches(record)
    delivered = Counter(member for _, members, _ in seen for member in members)
    assert set(delivered) == set(ids)
    assert set(delivered.values()) == {1}, "a member was delivered twice"
    assert all(1 <= len(members) <= 30 for _, members, _ in seen)
    by_group = Counter(group for group, _, _ in seen)
    assert set(by_group) == set(groups)
    # 100 members each, 30 at most per batch: at least 4 batches a group.
    assert min(by_group.values()) >= 4
    for group, members, _ in seen:
        for member in members:
            task = await store.get_task(member)
            assert task.group == group


@pytest.mark.timeout(180)
async def test_a_batch_whose_worker_is_killed_comes_back_whole(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    queue = "groups-kill"
    cluster.settings_env.update({"CONVEYOR_GROUP_TICK": "0.2"})
    api = await cluster.start_api()
    cluster.start_dispatcher()
    cluster.start_maintenance()
    target = f"127.0.0.1:{api.port}"
    held_record, record = tmp_path / "held.txt", tmp_path / "record.txt"
    async with AsyncAdminClient(target) as admin:
        await admin.set_group_config(queue, max_size=5, max_delay=timedelta(hours=1))
    holder = cluster.start_worker(
        target, queues={queue: 1}, concurrency=2, record=held_record, mode="block"
    )
    async with AsyncClient(target) as client:
        ids = [
            (await client.enqueue(BATCH, {"n": n}, queue=queue, group="kill")).id for n in range(5)
        ]
    await wait_until(
        lambda: len(batches(held_record)) == 1,
        within=60,
        interval=POLL_INTERVAL,
        message="the blocking worker holds the batch",
    )
    [(group, members, _)] = batches(held_record)
    assert (group, sorted(members)) == ("kill", sorted(ids))
    holder.kill9()
    cluster.start_worker(target, queues={queue: 1}, concurrency=2, record=record)
    await wait_until(
        lambda: completed(store, queue, 5),
        within=90,
        interval=POLL_INTERVAL,
        message="the batch completed on the other worker",
    )
    [(group, members, _)] = batches(record)
    assert (group, sorted(members)) == ("kill", sorted(ids)), "not redelivered whole"
    for task_id in ids:
        task = await store.get_task(task_id)
        assert task.state is TaskState.COMPLETED
        assert task.retried == 0  # given back by the dead session, not failed


@pytest.mark.timeout(180)
async def test_another_maintenance_fires_due_groups_when_the_sweeper_leader_is_killed(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    queue = "groups-leader"
    cluster.settings_env.update({"CONVEYOR_GROUP_TICK": "0.2", "CONVEYOR_LEADER_TTL": "2"})
    api = await cluster.start_api()
    cluster.start_dispatcher()
    maintenance = [
        cluster.start_maintenance({"CONVEYOR_INSTANCE_ID": "maint-a"}),
        cluster.start_maintenance({"CONVEYOR_INSTANCE_ID": "maint-b"}),
    ]
    target = f"127.0.0.1:{api.port}"
    record = tmp_path / "record.txt"
    async with AsyncAdminClient(target) as admin:
        await admin.set_group_config(queue, max_size=3, max_delay=timedelta(hours=1))
    cluster.start_worker(target, queues={queue: 1}, concurrency=4, record=record)
    leader = await _leader(maintenance)
    async with AsyncClient(target) as client:
        first = [
            (await client.enqueue(BATCH, {"n": n}, queue=queue, group="before")).id
            for n in range(3)
        ]
        await wait_until(
            lambda: completed(store, queue, 3),
            within=60,
            interval=POLL_INTERVAL,
            message="the first group fired under the first leader",
        )
        leader.kill9()
        later = [
            (await client.enqueue(BATCH, {"n": n}, queue=queue, group="after")).id for n in range(3)
        ]
        await wait_until(
            lambda: completed(store, queue, 6),
            within=90,
            interval=POLL_INTERVAL,
            message="the second group fired under the new leader",
        )
    [survivor] = [p for p in maintenance if p is not leader]
    assert GROUPS_ELECTED in survivor.log()
    delivered = {group: sorted(members) for group, members, _ in batches(record)}
    assert delivered == {"before": sorted(first), "after": sorted(later)}
