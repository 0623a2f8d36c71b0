"""Recovery after a crash, measured through real processes (the end-to-end tests assert
the figures loosely; ``python -m bench.e2e_bench --recovery`` reports them precisely).

- :func:`owner_stall`: a steady stream of tasks, two dispatchers; the one that owns the
  queue is killed (``kill -9``, or SIGTERM for a graceful stop). The figure is the longest
  gap between two task starts: how long the queue stood still while the other dispatcher
  took it over.
- :func:`api_release`: two api processes with a worker each; the tasks the first one's
  worker runs are held by that api. It is killed (``kill -9``). The figure is the time
  from the kill until the other api's worker has started every one of those tasks: how
  long the reaper took to find the api dead and release them.

Both read the workers' record (tests/e2e/worker_app.py): each start line carries the
worker's pid and CLOCK_MONOTONIC, the clock this process reads too.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

from conveyor import AsyncClient
from conveyor_testkit.polling import wait_until

from tests.e2e.conftest import read_record
from tests.e2e.harness import POLL_INTERVAL, Cluster, Proc

#: What the measured processes log at: the scenarios wait on some of their info lines.
INFO = {"CONVEYOR_LOG_LEVEL": "info"}


def starts(record: Path, *, pid: int | None = None) -> dict[str, int]:
    """Task id -> CLOCK_MONOTONIC ns of its first start (by worker ``pid``, if given)."""
    first: dict[str, int] = {}
    for fields in read_record(record):
        if fields[0] == "start" and (pid is None or int(fields[3]) == pid):
            first.setdefault(fields[1], int(fields[5]))
    return first


@dataclass(frozen=True)
class OwnerStall:
    """What :func:`owner_stall` measured."""

    #: "kill" (kill -9) or "term" (SIGTERM: a graceful stop).
    how: str
    #: Seconds: the longest gap between two consecutive task starts around the stop.
    longest_gap: float
    #: Seconds from the stop to the first start of a task enqueued after it.
    first_start_after: float
    #: Tasks enqueued (every one started).
    tasks: int


async def owner_stall(
    cluster: Cluster,
    record: Path,
    *,
    how: str = "kill",
    queue: str = "steady",
    rate: float = 50.0,
    before: float = 2.0,
    after: float = 4.0,
) -> OwnerStall:
    """Two dispatchers, a worker, and a task every ``1 / rate`` seconds for ``before``
    seconds, then the owning dispatcher is stopped (``how``), and tasks go on for
    ``after`` seconds; returns once every task has started."""
    assert how in ("kill", "term")
    api = await cluster.start_api(env=INFO)
    target = f"127.0.0.1:{api.port}"
    cluster.start_maintenance(env=INFO)
    owner = cluster.start_dispatcher(env=INFO)
    worker = cluster.start_worker(target, queues={queue: 1}, concurrency=8, record=record)
    async with AsyncClient(target) as client:
        first = await client.enqueue("e2e.noop", {}, queue=queue)
        await wait_until(
            lambda: first.id in starts(record, pid=worker.pid),
            within=60,
            interval=POLL_INTERVAL,
            message="the first task",
        )
        assert f"dispatcher.queue_claimed queue={queue}" in owner.log()
        other = cluster.start_dispatcher(env=INFO)
        await wait_until(
            lambda: "dispatcher.peer_seen" in other.log() and "dispatcher.peer_seen" in owner.log(),
            within=60,
            interval=POLL_INTERVAL,
            message="the dispatchers hearing each other",
        )
        ids: list[str] = []
        loop = asyncio.get_running_loop()
        began = loop.time()
        stopped_ns = 0
        stopping: asyncio.Future[None] | None = None
        #: The first task enqueued after the stop.
        first_after = 0
        while loop.time() - began < before + after:
            if stopping is None and loop.time() - began >= before:
                stopped_ns = time.monotonic_ns()
                first_after = len(ids)
                # In a thread: the stream of tasks goes on while the process stops (a
                # graceful stop, and then the interpreter's exit, take a while).
                stopping = asyncio.ensure_future(asyncio.to_thread(_stop, owner, how))
            ids.append((await client.enqueue("e2e.noop", {"n": len(ids)}, queue=queue)).id)
            await asyncio.sleep(1 / rate)  # the stream's pace, not a wait for a condition
        assert stopping is not None
        await stopping
    await wait_until(
        lambda: set(ids) <= set(starts(record)),
        within=60,
        interval=POLL_INTERVAL,
        message="every task started",
    )
    assert f"dispatcher.queue_claimed queue={queue}" in other.log()
    started = starts(record)
    times = sorted(started[i] for i in ids)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    first_start = min(started[i] for i in ids[first_after:])
    return OwnerStall(
        how=how,
        longest_gap=max(gaps) / 1e9,
        first_start_after=(first_start - stopped_ns) / 1e9,
        tasks=len(ids),
    )


def _stop(proc: Proc, how: str) -> None:
    if how == "kill":
        proc.kill9()
    else:
        proc.terminate(30.0)


@dataclass(frozen=True)
class ApiRelease:
    """What :func:`api_release` measured."""

    #: Seconds from the kill until the other api's worker started the first of the dead
    #: api's tasks, and all of them.
    first: float
    last: float
    #: Tasks the dead api held.
    tasks: int


async def api_release(
    cluster: Cluster, record: Path, *, queue: str = "held", tasks: int = 4
) -> ApiRelease:
    """Two api processes, one dispatcher, maintenance; a worker on the first api runs
    ``tasks`` tasks that never finish, a worker on the second waits with free slots; the
    first api is killed (``kill -9``). Returns once the second worker runs them all."""
    doomed = await cluster.start_api(env=INFO)
    survivor = await cluster.start_api(env=INFO)
    cluster.start_dispatcher(env=INFO)
    cluster.start_maintenance(env=INFO)
    stranded = cluster.start_worker(
        f"127.0.0.1:{doomed.port}",
        queues={queue: 1},
        concurrency=tasks,
        record=record,
        mode="block",
    )
    async with AsyncClient(f"127.0.0.1:{survivor.port}") as client:
        ids = [(await client.enqueue("e2e.noop", {"n": n}, queue=queue)).id for n in range(tasks)]
    await wait_until(
        lambda: set(ids) <= set(starts(record, pid=stranded.pid)),
        within=60,
        interval=POLL_INTERVAL,
        message="the first worker running every task",
    )
    rescuer = cluster.start_worker(
        f"127.0.0.1:{survivor.port}",
        queues={queue: 1},
        concurrency=tasks,
        record=record,
        mode="block",
    )
    await wait_until(
        lambda: "gateway.started" in survivor.log(),
        within=60,
        interval=POLL_INTERVAL,
        message="the second worker's session",
    )
    killed_ns = time.monotonic_ns()
    doomed.kill9()
    await wait_until(
        lambda: set(ids) <= set(starts(record, pid=rescuer.pid)),
        within=60,
        interval=POLL_INTERVAL,
        message="the second worker running the dead api's tasks",
    )
    picked = starts(record, pid=rescuer.pid)
    times = sorted(picked[i] for i in ids)
    return ApiRelease(
        first=(times[0] - killed_ns) / 1e9, last=(times[-1] - killed_ns) / 1e9, tasks=tasks
    )
