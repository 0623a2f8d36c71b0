"""A rate limit through real processes: an api, two dispatchers, maintenance, two SDK
worker processes with far more slots than the limit needs, a private nats-server and a
throwaway Postgres. Over a minute at 50 a second, the starts keep to the limit within 2%,
and no one-second window holds more than rate + burst; killing the owning dispatcher
after that minute (kill -9) hands the queue over without a fresh burst either. Every wait is on a
condition with a timeout."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
from conveyor import AsyncAdminClient, AsyncClient, spec
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.types import TaskState
from conveyor_testkit.polling import wait_until

from tests.e2e.harness import POLL_INTERVAL, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats, pytest.mark.slow]

QUEUE = "rated"
RATE = 50
BURST = 5
WINDOW = timedelta(seconds=60)
#: Enough to keep the queue busy past the window and the kill (70 s at the limit).
TASKS = 3500
#: The owning dispatcher is killed once this many are done (past the window).
KILL_AT = 3100


def busiest_second(starts: list[datetime]) -> int:
    """The most starts in any one-second window (sliding, closed on the left)."""
    most, first = 0, 0
    for last, at in enumerate(starts):
        while at - starts[first] >= timedelta(seconds=1):
            first += 1
        most = max(most, last - first + 1)
    return most


async def test_a_rate_limit_holds_for_a_minute_across_a_dispatcher_kill(
    cluster: Cluster, store: PostgresBroker, migrated_dsn: str, tmp_path: Path
) -> None:
    api = await cluster.start_api()
    target = f"127.0.0.1:{api.port}"
    dispatchers = [cluster.start_dispatcher(), cluster.start_dispatcher()]
    cluster.start_maintenance()
    for n in range(2):
        cluster.start_worker(
            target, queues={QUEUE: 1}, concurrency=64, record=tmp_path / f"runs{n}.jsonl"
        )
    async with AsyncAdminClient(target) as admin:
        limit = await admin.set_rate_limit(QUEUE, RATE, burst=BURST)
        assert (limit.per_second, limit.burst) == (RATE, BURST)
    async with AsyncClient(target) as client:
        for start in range(0, TASKS, 500):
            results = await client.enqueue_batch(
                [
                    spec("e2e.noop", {"i": i}, queue=QUEUE)
                    for i in range(start, min(start + 500, TASKS))
                ]
            )
            assert all(r.task is not None for r in results)

    async def done() -> int:
        (stats,) = await store.queue_stats(QUEUE)
        return stats.count(TaskState.COMPLETED)

    async def past_the_window() -> bool:
        return await done() >= KILL_AT

    await wait_until(past_the_window, within=120, interval=POLL_INTERVAL, message="a minute")
    # kill -9 whichever dispatcher owns the queue: the other takes it over and spends
    # the same bucket.
    owner = next(p for p in dispatchers if "dispatcher.queue_claimed queue=rated" in p.log())
    owner.kill9()

    async def all_done() -> bool:
        return await done() >= TASKS

    await wait_until(all_done, within=150, interval=POLL_INTERVAL, message="every task done")
    conn = await asyncpg.connect(migrated_dsn)
    try:
        rows = await conn.fetch(
            "SELECT started_at FROM conveyor_tasks WHERE queue = $1 ORDER BY started_at", QUEUE
        )
    finally:
        await conn.close()
    starts = [row["started_at"] for row in rows]
    assert len(starts) == TASKS
    assert None not in starts
    first = starts[0]
    in_window = sum(1 for at in starts if at < first + WINDOW)
    expected = RATE * WINDOW.total_seconds()
    print(
        f"rate limit {RATE}/s burst {BURST}: {in_window} starts in the first "
        f"{WINDOW.total_seconds():g} s ({in_window / expected - 1:+.2%}), busiest second "
        f"{busiest_second(starts)}"
    )
    assert abs(in_window - expected) <= 0.02 * expected
    assert busiest_second(starts) <= RATE + BURST
