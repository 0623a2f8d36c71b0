"""The push path through real processes: api, two dispatchers, maintenance, SDK workers,
a real Postgres and a private nats-server. Every wait is on a condition with a timeout."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import pytest
from conveyor import AsyncClient, spec
from conveyor_broker import TaskState
from conveyor_broker.postgres import PostgresBroker
from conveyor_runtime.embedded_nats import EmbeddedNats
from conveyor_testkit.polling import wait_until

from tests.e2e.conftest import read_record
from tests.e2e.harness import POLL_INTERVAL, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]


async def enqueue_many(
    client: AsyncClient, queue: str, n: int, task_type: str = "e2e.noop"
) -> list[str]:
    """Enqueue n tasks in batches; return their ids."""
    ids: list[str] = []
    for start in range(0, n, 500):
        specs = [spec(task_type, {"i": i}, queue=queue) for i in range(start, min(n, start + 500))]
        for result in await client.enqueue_batch(specs):
            assert result.task is not None, result.error
            ids.append(result.task.id)
    return ids


async def count_state(store: PostgresBroker, state: TaskState) -> int:
    return sum(stats.count(state) for stats in await store.queue_stats())


def starts(record: Path) -> list[list[str]]:
    return [f for f in read_record(record) if f[0] == "start"]


def dones(record: Path) -> list[list[str]]:
    return [f for f in read_record(record) if f[0] == "done"]


async def test_every_task_completes_exactly_once(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    api = await cluster.start_api()
    cluster.start_dispatcher()
    cluster.start_dispatcher()
    cluster.start_maintenance()
    target = f"127.0.0.1:{api.port}"
    record = tmp_path / "record.txt"
    queues = {"alpha": 1, "beta": 1, "gamma": 1}
    cluster.start_worker(target, queues=queues, concurrency=32, record=record)
    cluster.start_worker(target, queues=queues, concurrency=32, record=record)

    async with AsyncClient(target) as client:
        ids: list[str] = []
        for queue in queues:
            ids += await enqueue_many(client, queue, 1000)

    async def all_done() -> bool:
        return await count_state(store, TaskState.COMPLETED) == len(ids)

    await wait_until(
        all_done, within=120, interval=POLL_INTERVAL, message=f"{len(ids)} completed tasks"
    )
    ran = Counter(f[1] for f in starts(record))
    assert set(ran) == set(ids)
    assert max(ran.values()) == 1, "a task ran twice"
    assert len(dones(record)) == len(ids)


async def test_many_queues_with_a_slot_each_never_stall(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    """Twenty queues share a worker's twenty slots: one slot per queue, so every task is
    its own dispatch and every completion its own credit. Not one credit may go missing
    (a queue would sit idle until its gateway re-registers, here once a minute)."""
    cluster.settings_env["CONVEYOR_REGISTER_TICK"] = "60"
    target = await cluster.start_services()
    record = tmp_path / "record.txt"
    queues = {f"many{n}": 1 for n in range(20)}
    cluster.start_worker(target, queues=queues, concurrency=20, record=record)
    async with AsyncClient(target) as client:
        specs = [spec("e2e.noop", {"i": i}, queue=f"many{i % 20}") for i in range(600)]
        results = await client.enqueue_batch(specs)
    assert all(r.task is not None for r in results)

    async def all_done() -> bool:
        return await count_state(store, TaskState.COMPLETED) >= 600

    await wait_until(all_done, within=30, interval=POLL_INTERVAL, message="600 completed tasks")


async def test_killed_worker_task_is_released_and_completes_elsewhere(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    # kill -9 closes the worker's socket: the api sees the stream end and releases at once.
    cluster.settings_env["CONVEYOR_LEASE_TTL"] = "300"
    target = await cluster.start_services()
    record = tmp_path / "record.txt"
    blocked = cluster.start_worker(
        target, queues={"jobs": 1}, concurrency=1, record=record, mode="block"
    )
    async with AsyncClient(target) as client:
        task = await client.enqueue("e2e.noop", {"x": 1}, queue="jobs")
    await wait_until(
        lambda: len(starts(record)) == 1,
        within=30,
        interval=POLL_INTERVAL,
        message="first attempt started",
    )
    blocked.kill9()
    cluster.start_worker(target, queues={"jobs": 1}, concurrency=1, record=record)

    async def completed() -> bool:
        return (await store.get_task(task.id)).state is TaskState.COMPLETED

    await wait_until(
        completed, within=30, interval=POLL_INTERVAL, message="released task completed"
    )
    assert [f[1] for f in starts(record)] == [task.id, task.id]
    assert [f[1] for f in dones(record)] == [task.id]


async def test_hung_worker_task_is_redelivered_after_lease_expiry(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    # SIGSTOP freezes the worker with its socket open: only lease expiry can free the task.
    cluster.settings_env["CONVEYOR_LEASE_TTL"] = "2"
    cluster.settings_env["CONVEYOR_REAP_TICK"] = "0.2"
    target = await cluster.start_services()
    record = tmp_path / "record.txt"
    hung = cluster.start_worker(
        target, queues={"jobs": 1}, concurrency=1, record=record, mode="block"
    )
    async with AsyncClient(target) as client:
        task = await client.enqueue("e2e.noop", {"x": 1}, queue="jobs")
    await wait_until(
        lambda: len(starts(record)) == 1,
        within=30,
        interval=POLL_INTERVAL,
        message="first attempt started",
    )
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        cluster.start_worker(target, queues={"jobs": 1}, concurrency=1, record=record)

        async def completed() -> bool:
            return (await store.get_task(task.id)).state is TaskState.COMPLETED

        await wait_until(
            completed, within=30, interval=POLL_INTERVAL, message="redelivered task completed"
        )
    finally:
        hung.kill9()
    attempts = [f[2] for f in starts(record) if f[1] == task.id]
    assert attempts == ["1", "2"]
    stored = await store.get_task(task.id)
    assert stored.retried == 1
    assert stored.last_error is not None


async def test_graceful_stop_releases_tasks_to_another_worker_at_once(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    # A long lease: only an immediate release (not lease expiry) can finish in time.
    cluster.settings_env["CONVEYOR_LEASE_TTL"] = "300"
    target = await cluster.start_services()
    record = tmp_path / "record.txt"
    stopping = cluster.start_worker(
        target, queues={"jobs": 1}, concurrency=3, record=record, mode="block", grace=0.5
    )
    async with AsyncClient(target) as client:
        ids = [(await client.enqueue("e2e.noop", {"i": i}, queue="jobs")).id for i in range(3)]
    await wait_until(
        lambda: len(starts(record)) == 3,
        within=30,
        interval=POLL_INTERVAL,
        message="three tasks running",
    )
    assert stopping.terminate(timeout=20) == 0

    async def released() -> bool:
        return await count_state(store, TaskState.PENDING) == 3

    # The worker's releases commit as its session ends (the api applies them after the
    # stream closes): within seconds, not at lease expiry five minutes away.
    await wait_until(released, within=5, interval=POLL_INTERVAL, message="three tasks released")
    cluster.start_worker(target, queues={"jobs": 1}, concurrency=3, record=record)

    async def all_done() -> bool:
        return await count_state(store, TaskState.COMPLETED) == 3

    await wait_until(
        all_done, within=20, interval=POLL_INTERVAL, message="released tasks completed elsewhere"
    )
    assert {f[1] for f in dones(record)} == set(ids)


async def test_killed_dispatcher_is_replaced_and_no_task_is_lost(
    cluster: Cluster, store: PostgresBroker, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    import nats

    cluster.settings_env["CONVEYOR_OWNER_TTL"] = "2"
    api = await cluster.start_api()
    first = cluster.start_dispatcher({"CONVEYOR_INSTANCE_ID": "dispatcher-a"})
    second = cluster.start_dispatcher({"CONVEYOR_INSTANCE_ID": "dispatcher-b"})
    cluster.start_maintenance()
    target = f"127.0.0.1:{api.port}"
    record = tmp_path / "record.txt"
    cluster.start_worker(target, queues={"load": 1}, concurrency=8, record=record, mode="work")
    async with AsyncClient(target) as client:
        ids = await enqueue_many(client, "load", 1500)
    await wait_until(
        lambda: len(dones(record)) >= 100,
        within=30,
        interval=POLL_INTERVAL,
        message="draining under way",
    )

    nc = await nats.connect(nats_server.url)
    try:
        kv = await nc.jetstream().key_value("conveyor_owners")
        owner = (await kv.get("load")).value
    finally:
        await nc.close()
    assert owner is not None
    victim = first if owner.decode() == "dispatcher-a" else second
    victim.kill9()

    async def all_done() -> bool:
        return await count_state(store, TaskState.COMPLETED) == len(ids)

    await wait_until(
        all_done, within=90, interval=POLL_INTERVAL, message="every task completed after failover"
    )
    assert {f[1] for f in dones(record)} == set(ids)


async def test_killed_api_workers_reconnect_to_another_api(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    cluster.settings_env["CONVEYOR_LEASE_TTL"] = "3"
    cluster.settings_env["CONVEYOR_REAP_TICK"] = "0.2"
    first = await cluster.start_api()
    second = await cluster.start_api()
    cluster.start_dispatcher()
    cluster.start_maintenance()
    both = f"ipv4:127.0.0.1:{first.port},127.0.0.1:{second.port}"
    record = tmp_path / "record.txt"
    cluster.start_worker(both, queues={"jobs": 1}, concurrency=8, record=record, mode="work")
    cluster.start_worker(both, queues={"jobs": 1}, concurrency=8, record=record, mode="work")
    async with AsyncClient(f"127.0.0.1:{second.port}") as client:
        ids = await enqueue_many(client, "jobs", 1000)
        await wait_until(
            lambda: len(dones(record)) >= 100,
            within=30,
            interval=POLL_INTERVAL,
            message="draining under way",
        )
        first.kill9()
        ids += await enqueue_many(client, "jobs", 200)

    async def all_done() -> bool:
        return await count_state(store, TaskState.COMPLETED) == len(ids)

    await wait_until(
        all_done,
        within=90,
        interval=POLL_INTERVAL,
        message="every task completed after the api died",
    )
    assert {f[1] for f in dones(record)} == set(ids)


async def test_weights_share_work_and_concurrency_is_never_exceeded(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    target = await cluster.start_services()
    record = tmp_path / "record.txt"
    async with AsyncClient(target) as client:
        await enqueue_many(client, "heavy", 600, "e2e.noop")
        await enqueue_many(client, "light", 600, "e2e.noop")
    for _ in range(2):
        cluster.start_worker(
            target, queues={"heavy": 3, "light": 1}, concurrency=4, record=record, mode="work"
        )
    await wait_until(
        lambda: len(dones(record)) >= 400,
        within=60,
        interval=POLL_INTERVAL,
        message="400 completions",
    )

    first = starts(record)[:400]
    by_queue = Counter(f[4] for f in first)
    ratio = by_queue["heavy"] / max(by_queue["light"], 1)
    assert 2.0 <= ratio <= 4.5, by_queue

    # Concurrency: replay each worker's start/done lines; never more than 4 at once.
    events: dict[str, list[tuple[int, int]]] = {}
    for f in read_record(record):
        if f[0] == "start":
            events.setdefault(f[3], []).append((int(f[5]), 1))
        else:
            events.setdefault(f[2], []).append((int(f[4]), -1))
    for pid, items in events.items():
        running = peak = 0
        for _, delta in sorted(items):
            running += delta
            peak = max(peak, running)
        assert peak <= 4, f"worker {pid} ran {peak} tasks at once"
