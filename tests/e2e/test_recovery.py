"""Recovery (issue 11): how long work stands still after the queue's owner dies, and how
soon the tasks a dead api held run again, through real processes.

The figures are asserted loosely (the machine is shared; ``python -m bench.e2e_bench
--recovery`` reports them precisely) and printed. Before: the owner's death stalled its
queue 5-7 s (until its ownership key expired), and a dead api's tasks came back when
their leases expired (30 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conveyor_broker import TaskState
from conveyor_broker.postgres import PostgresBroker

from tests.e2e.harness import Cluster
from tests.e2e.recovery import api_release, owner_stall

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]


@pytest.mark.parametrize("how", ["kill", "term"])
async def test_the_queue_stalls_briefly_when_its_owner_stops(
    how: str, cluster: Cluster, tmp_path: Path
) -> None:
    stall = await owner_stall(cluster, tmp_path / "record.txt", how=how)
    print(
        f"\nowner {how}: longest gap between task starts {stall.longest_gap:.2f} s, "
        f"first start after the stop {stall.first_start_after:.2f} s ({stall.tasks} tasks)"
    )
    # Target 2 s (measured: about 1.2 s after kill -9; a graceful stop hands over at once).
    assert stall.longest_gap < 3.5
    if how == "term":
        assert stall.longest_gap < 2.0


async def test_the_tasks_of_a_dead_api_run_again_within_seconds(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    released = await api_release(cluster, tmp_path / "record.txt")
    print(
        f"\napi kill -9: its {released.tasks} tasks started on the other api's worker "
        f"{released.first:.2f}-{released.last:.2f} s after the kill"
    )
    # Target 5 s (holder_silence 3 s + a reaper tick); the lease TTL is 30 s.
    assert released.last < 8.0
    # Released, not failed: no attempt was spent on the api's death.
    page = await store.list_tasks()
    held = [t for t in page.tasks if t.queue == "held"]
    assert len(held) == released.tasks
    assert all(t.state is TaskState.ACTIVE and t.retried == 0 for t in held)
