"""Cron end to end: two maintenance processes, the scheduler leader killed -9 across slot
boundaries, and every slot of a per-second entry fires exactly once (one task per slot,
no gap, no repeat, each run once by a real worker)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conveyor import AsyncAdminClient, spec
from conveyor_broker import TaskListParams, TaskState
from conveyor_broker.postgres import PostgresBroker
from conveyor_testkit.polling import wait_until

from tests.e2e.conftest import read_record
from tests.e2e.harness import POLL_INTERVAL, Cluster, Proc

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

QUEUE = "cron-e2e"
SCHEDULER_ELECTED = "maintenance.leader_elected role=scheduler"


def _slot(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


async def _scheduler_leader(maintenance: list[Proc]) -> Proc:
    """The maintenance process that is (or last became) the scheduler leader."""
    leaders: list[Proc] = []

    def elected() -> bool:
        leaders[:] = [p for p in maintenance if p.alive() and SCHEDULER_ELECTED in p.log()]
        return len(leaders) == 1

    await wait_until(elected, within=60, interval=POLL_INTERVAL, message="a scheduler leader")
    return leaders[0]


@pytest.mark.timeout(300)
async def test_every_slot_fires_once_when_the_scheduler_leader_is_killed(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    cluster.settings_env.update(
        {
            "CONVEYOR_LEADER_TTL": "2",
            "CONVEYOR_PROMOTE_TICK": "0.2",
            # Slots the survivor comes to late still fire as usual (it takes over within
            # a few seconds; this leaves room for a loaded machine).
            "CONVEYOR_CRON_MISFIRE_GRACE": "120",
        }
    )
    api = await cluster.start_api()
    cluster.start_dispatcher()
    maintenance = [
        cluster.start_maintenance({"CONVEYOR_INSTANCE_ID": "maint-a"}),
        cluster.start_maintenance({"CONVEYOR_INSTANCE_ID": "maint-b"}),
    ]
    target = f"127.0.0.1:{api.port}"
    record = tmp_path / "record.txt"
    cluster.start_worker(target, queues={QUEUE: 1}, concurrency=8, record=record)
    leader = await _scheduler_leader(maintenance)
    [survivor] = [p for p in maintenance if p is not leader]

    async with AsyncAdminClient(target) as admin:
        created = await admin.upsert_cron_entry(
            "every-second", "* * * * * *", spec("e2e.noop", {"cron": True}, queue=QUEUE)
        )
        assert created.next_run_at is not None
        first = created.next_run_at

        async def fired_up_to(slot: datetime) -> bool:
            last = (await store.get_cron_entry("every-second")).last_run_at
            return last is not None and last >= slot

        # A few slots under the first leader.
        await wait_until(
            lambda: fired_up_to(first + timedelta(seconds=3)),
            within=60,
            interval=POLL_INTERVAL,
            message="three slots fired by the first leader",
        )
        # Kill it right after a slot fired: the next boundaries pass with no leader
        # (its key lives on for up to CONVEYOR_LEADER_TTL).
        fired_before = (await store.get_cron_entry("every-second")).last_run_at
        assert fired_before is not None
        leader.kill9()
        killed_at = datetime.now(UTC)

        await wait_until(
            lambda: SCHEDULER_ELECTED in survivor.log(),
            within=60,
            interval=POLL_INTERVAL,
            message="the survivor elected scheduler",
        )
        # The survivor fires the slots missed meanwhile, then goes on.
        await wait_until(
            lambda: fired_up_to(killed_at + timedelta(seconds=4)),
            within=90,
            interval=POLL_INTERVAL,
            message="slots after the kill fired by the survivor",
        )
        paused = await admin.pause_cron_entry("every-second")
        assert paused.next_run_at is None

    entry = await store.get_cron_entry("every-second")
    assert entry.last_run_at is not None
    last = entry.last_run_at
    tasks = (await store.list_tasks(TaskListParams(queue=QUEUE, limit=1000))).tasks
    slots = sorted(_slot(t.headers["conveyor-cron-slot"]) for t in tasks)
    expected = [
        first + timedelta(seconds=n) for n in range(int((last - first).total_seconds()) + 1)
    ]
    # One task per slot, from the first to the last fired: none missed, none twice.
    assert slots == expected, f"fired {len(slots)} slots, expected {len(expected)}"
    assert any(slot > fired_before + timedelta(seconds=1) for slot in slots)

    # A real worker ran each exactly once.
    ids = {t.id for t in tasks}

    states: dict[str, TaskState] = {}

    async def all_done() -> bool:
        states.update({i: (await store.get_task(i)).state for i in ids})
        return all(state is TaskState.COMPLETED for state in states.values())

    try:
        await wait_until(all_done, within=90, interval=POLL_INTERVAL, message="tasks done")
    except TimeoutError:
        pytest.fail(f"not every slot's task completed: {sorted(states.items())}")
    starts = [fields[1] for fields in read_record(record) if fields[0] == "start"]
    assert sorted(starts) == sorted(ids)
