"""A queue under a rate limit, through real processes: the scenario that
tests/e2e/test_rate_limits.py checks and ``python -m bench.e2e_bench --rate-limit``
measures.

Two api processes, two dispatchers, one maintenance process and two SDK worker
processes (one on each api) with far more slots than the limit needs; the limit is set
through the admin API, then enough no-op tasks to keep the queue busy for the whole run
are enqueued at once. Optionally the owning dispatcher gets ``kill -9`` once a given
number of tasks are done. What comes out is every task's start (its ``started_at``, set
when the dispatcher leased it), from which the figures follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import asyncpg
from conveyor import AsyncAdminClient, AsyncClient, spec
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.types import TaskState
from conveyor_testkit.polling import wait_until

from tests.e2e.harness import POLL_INTERVAL, Cluster


@dataclass(frozen=True)
class RateRun:
    """The starts of one run under a limit of ``rate`` a second and ``burst``."""

    rate: float
    burst: int
    starts: list[datetime]

    def in_first(self, window: timedelta) -> int:
        """Starts within ``window`` of the first one."""
        first = self.starts[0]
        return sum(1 for at in self.starts if at < first + window)

    def busiest(self, window: timedelta = timedelta(seconds=1)) -> int:
        """The most starts in any ``window`` (sliding, closed on the left)."""
        most, first = 0, 0
        for last, at in enumerate(self.starts):
            while at - self.starts[first] >= window:
                first += 1
            most = max(most, last - first + 1)
        return most

    def most_allowed(self, window: timedelta) -> float:
        """What the bucket may grant in any ``window``: the burst, then the rate."""
        return self.burst + self.rate * window.total_seconds()


async def rate_run(
    cluster: Cluster,
    workdir: Path,
    *,
    queue: str,
    rate: float,
    burst: int,
    tasks: int,
    kill_at: int | None = None,
) -> RateRun:
    """Run ``tasks`` no-op tasks through ``queue`` limited to ``rate`` a second (see the
    module docstring); with ``kill_at``, kill -9 the owning dispatcher once that many
    are done."""
    apis = [await cluster.start_api(), await cluster.start_api()]
    dispatchers = [cluster.start_dispatcher(), cluster.start_dispatcher()]
    cluster.start_maintenance()
    targets = [f"127.0.0.1:{api.port}" for api in apis]
    for n, target in enumerate(targets):
        cluster.start_worker(
            target, queues={queue: 1}, concurrency=64, record=workdir / f"runs{n}.jsonl"
        )
    async with AsyncAdminClient(targets[0]) as admin:
        await admin.set_rate_limit(queue, rate, burst=burst)
    async with AsyncClient(targets[1]) as client:
        for start in range(0, tasks, 500):
            results = await client.enqueue_batch(
                [
                    spec("e2e.noop", {"i": i}, queue=queue)
                    for i in range(start, min(start + 500, tasks))
                ]
            )
            assert all(r.task is not None for r in results), results
    store = await PostgresBroker.connect(cluster.dsn)
    try:

        async def done() -> int:
            (stats,) = await store.queue_stats(queue)
            return stats.count(TaskState.COMPLETED)

        runtime = tasks / rate
        if kill_at is not None:

            async def killing_time() -> bool:
                return await done() >= kill_at

            await wait_until(killing_time, within=runtime + 60, interval=POLL_INTERVAL)
            claim = f"dispatcher.queue_claimed queue={queue} "
            owner = next(p for p in dispatchers if claim in p.log())
            owner.kill9()

        async def all_done() -> bool:
            return await done() >= tasks

        await wait_until(
            all_done, within=runtime + 60, interval=POLL_INTERVAL, message="every task done"
        )
    finally:
        await store.close()
    conn = await asyncpg.connect(cluster.dsn)
    try:
        rows = await conn.fetch(
            "SELECT started_at FROM conveyor_tasks WHERE queue = $1 ORDER BY started_at", queue
        )
    finally:
        await conn.close()
    starts = [row["started_at"] for row in rows]
    assert len(starts) == tasks
    assert None not in starts
    return RateRun(rate=rate, burst=burst, starts=starts)
