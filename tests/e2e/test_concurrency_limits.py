"""Concurrency limits per key through real processes: two api processes, two
dispatchers, a maintenance process and two SDK workers with more slots than the limits
allow. Every handler run is recorded with its start and end on the machine's monotonic
clock, so the test can tell how many tasks of a key ran at any instant, cluster-wide.

Checked: no instant has more runs of a key than its limit, across a kill -9 of the
owning dispatcher and of a worker holding a task (its run ends at the kill; its slot frees
when its lease does); and a hot key with a long queue behind a limit of 1 does not hold
up the other keys, whose tasks all finish while the hot key's are still waiting."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import pytest
from conveyor import AsyncAdminClient, AsyncClient, spec
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.types import TaskState
from conveyor_testkit.polling import wait_until

from tests.e2e.harness import POLL_INTERVAL, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats, pytest.mark.slow]

QUEUE = "keyed"
HOT = "hot-customer"
HOT_TASKS = 300
COLD_KEYS = 20
COLD_PER_KEY = 20
PER_KEY = 2


def most_at_once(
    records: list[Path], keys: dict[str, str], ended_at: dict[int, int]
) -> dict[str, int]:
    """The most runs of each key at any instant. A run ends at its ``done`` line or, for
    a worker killed while running it (pid in ``ended_at``), at the kill."""
    runs: dict[str, list[tuple[int, int]]] = defaultdict(list)
    open_runs: dict[tuple[str, str], tuple[int, int]] = {}
    for path in records:
        for line in path.read_text().splitlines():
            parts = line.split()
            if parts[0] == "start":
                task_id, pid, at = parts[1], int(parts[3]), int(parts[-1])
                open_runs[(task_id, str(pid))] = (pid, at)
            elif parts[0] == "done":
                task_id, at = parts[1], int(parts[-1])
                _, began = open_runs.pop((task_id, parts[2]))
                runs[keys[task_id]].append((began, at))
    for (task_id, _), (pid, began) in open_runs.items():
        assert pid in ended_at, f"{task_id} never finished on live worker {pid}"
        runs[keys[task_id]].append((began, ended_at[pid]))
    most: dict[str, int] = {}
    for key, spans in runs.items():
        # Ends sort before starts at the same instant: a slot freed, then taken.
        edges = sorted([(b, 1) for b, _ in spans] + [(e, -1) for _, e in spans])
        level = peak = 0
        for _, step in edges:
            level += step
            peak = max(peak, level)
        most[key] = peak
    return most


async def test_no_key_runs_beyond_its_limit_and_a_hot_key_blocks_no_other(
    cluster: Cluster, tmp_path: Path
) -> None:
    apis = [await cluster.start_api(), await cluster.start_api()]
    dispatchers = [cluster.start_dispatcher(), cluster.start_dispatcher()]
    cluster.start_maintenance()
    targets = [f"127.0.0.1:{api.port}" for api in apis]
    records = [tmp_path / f"runs{n}.jsonl" for n in range(2)]
    workers = [
        cluster.start_worker(target, queues={QUEUE: 1}, concurrency=16, record=record, mode="work")
        for target, record in zip(targets, records, strict=True)
    ]
    async with AsyncAdminClient(targets[0]) as admin:
        await admin.set_concurrency_limit(QUEUE, PER_KEY)
        await admin.set_concurrency_limit(QUEUE, 1, pattern="hot-*")
    keys: dict[str, str] = {}
    async with AsyncClient(targets[1]) as client:
        # The hot key's whole backlog first: in lease order it is in front of every other.
        hot = await client.enqueue_batch(
            [spec("e2e.noop", {"i": i}, queue=QUEUE, concurrency_key=HOT) for i in range(HOT_TASKS)]
        )
        cold = await client.enqueue_batch(
            [
                spec("e2e.noop", {"k": k, "i": i}, queue=QUEUE, concurrency_key=f"c-{k}")
                for k in range(COLD_KEYS)
                for i in range(COLD_PER_KEY)
            ]
        )
    for result in [*hot, *cold]:
        assert result.task is not None, result
        key = result.task.options.concurrency_key
        assert key is not None, result
        keys[result.task.id] = key
    hot_ids = [r.task.id for r in hot if r.task is not None]
    cold_ids = [r.task.id for r in cold if r.task is not None]

    store = await PostgresBroker.connect(cluster.dsn)
    ended_at: dict[int, int] = {}
    try:

        async def finished(ids: list[str]) -> int:
            tasks = await store.get_tasks(ids)
            return sum(1 for t in tasks if t.state is TaskState.COMPLETED)

        async def cold_done() -> bool:
            return await finished(cold_ids) == len(cold_ids)

        await wait_until(cold_done, within=60, interval=POLL_INTERVAL, message="cold keys done")
        hot_finished = await finished(hot_ids)
        # No head-of-line blocking: the other keys finished while the hot one still
        # had most of its backlog waiting (it runs one at a time).
        assert hot_finished < HOT_TASKS // 2, hot_finished
        held = (await store.queue_stats(QUEUE))[0].count(TaskState.HELD)
        assert held > 0

        # The owning dispatcher dies, then a worker holding the hot key's one task.
        claim = f"dispatcher.queue_claimed queue={QUEUE} "
        owner = next(p for p in dispatchers if claim in p.log())
        owner.kill9()

        async def hot_running_on_worker() -> int | None:
            for line in reversed(records[0].read_text().splitlines()):
                parts = line.split()
                if parts[0] == "done" and keys.get(parts[1]) == HOT:
                    return None  # the last hot run here ended: wait for the next
                if parts[0] == "start" and keys.get(parts[1]) == HOT:
                    return int(parts[3])
            return None

        async def holding() -> bool:
            return await hot_running_on_worker() is not None

        await wait_until(holding, within=60, interval=0.005, message="a hot run on worker 0")
        running_pid = await hot_running_on_worker()
        workers[0].kill9()
        # Its runs end now at the latest (the record's pid is the worker's own).
        ended_at[running_pid or 0] = time.monotonic_ns()

        async def all_done() -> bool:
            return await finished(hot_ids + cold_ids) == len(keys)

        await wait_until(all_done, within=120, interval=POLL_INTERVAL, message="every task done")
    finally:
        await store.close()
    most = most_at_once(records, keys, ended_at)
    print(f"most runs at once: hot {most[HOT]}, cold {max(v for k, v in most.items() if k != HOT)}")
    assert most[HOT] == 1
    for k in range(COLD_KEYS):
        assert most[f"c-{k}"] <= PER_KEY, (k, most[f"c-{k}"])
    # The limit is a cap, not a crawl: the cold keys did run side by side.
    assert max(most[f"c-{k}"] for k in range(COLD_KEYS)) == PER_KEY
