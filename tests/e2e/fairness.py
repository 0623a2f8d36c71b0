"""Fair slots through real processes: the scenario that tests/e2e/test_fair_slots.py
checks and ``python -m bench.e2e_bench --fair-slots`` measures.

One api, one dispatcher, one maintenance process and one SDK worker with far fewer slots
than queues (2 slots over 10 queues, say, of different weights). Every queue gets more
no-op tasks than its share of the run needs, all enqueued before the worker starts, so
every queue is busy throughout; then the worker drains them. What comes out is how many
of the first ``count`` completions each queue had, against its share by weight.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import asyncpg
from conveyor import AsyncClient, spec
from conveyor_testkit.polling import wait_until

from tests.e2e.harness import POLL_INTERVAL, Cluster

_FIRST = """
SELECT queue, count(*) AS n FROM (
    SELECT queue FROM conveyor_tasks WHERE state = 'completed' AND queue = ANY($1::text[])
    ORDER BY completed_at, id LIMIT $2
) AS first GROUP BY queue
"""
_DONE = "SELECT count(*) FROM conveyor_tasks WHERE state = 'completed' AND queue = ANY($1::text[])"


@dataclass(frozen=True)
class FairRun:
    """Completions per queue among the first ``count``, and the queues' ``weights``."""

    weights: Mapping[str, int]
    count: int
    done: Mapping[str, int]
    seconds: float

    def ratio(self, queue: str) -> float:
        """``queue``'s share of the completions over its share of the weight (1.0: fair)."""
        share = self.done.get(queue, 0) / self.count
        return share / (self.weights[queue] / sum(self.weights.values()))

    def worst(self) -> float:
        """The largest relative deviation of any queue from its fair share (0.1: 10%)."""
        return max(abs(self.ratio(queue) - 1) for queue in self.weights)


async def fair_run(
    cluster: Cluster,
    *,
    weights: Mapping[str, int],
    concurrency: int,
    count: int,
    prefix: str = "fair",
) -> FairRun:
    """Drain ``weights``' queues (named ``prefix``-name) through one worker of
    ``concurrency`` slots until ``count`` tasks are done (see the module docstring)."""
    api = await cluster.start_api()
    cluster.start_dispatcher()
    cluster.start_maintenance()
    target = f"127.0.0.1:{api.port}"
    named = {f"{prefix}-{queue}": weight for queue, weight in weights.items()}
    total = sum(named.values())
    async with AsyncClient(target) as client:
        for queue, weight in named.items():
            # Half as many again as the queue's fair share of the run, and some more.
            tasks = int(count * weight / total * 1.5) + 100
            for start in range(0, tasks, 1000):
                batch = [
                    spec("e2e.noop", {}, queue=queue)
                    for _ in range(start, min(start + 1000, tasks))
                ]
                results = await client.enqueue_batch(batch)
                assert all(r.task is not None for r in results), results
    conn = await asyncpg.connect(cluster.dsn)
    try:
        began = time.monotonic()
        cluster.start_worker(
            target,
            queues=named,
            concurrency=concurrency,
            record=cluster.workdir / "fair-runs",
        )
        queues = list(named)

        async def enough() -> bool:
            return int(await conn.fetchval(_DONE, queues)) >= count

        await wait_until(
            enough, within=count / 20 + 60, interval=POLL_INTERVAL, message="tasks done"
        )
        seconds = time.monotonic() - began
        rows = await conn.fetch(_FIRST, queues, count)
    finally:
        await conn.close()
    done = {row["queue"].removeprefix(f"{prefix}-"): int(row["n"]) for row in rows}
    return FairRun(weights=dict(weights), count=count, done=done, seconds=seconds)
