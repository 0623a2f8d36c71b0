"""Credit{n} through real processes: an api, two dispatchers, a private nats-server and
a throwaway Postgres; an SDK worker in this process asks for more slots at run time and
gets that many more tasks at once. Every wait is on a condition with a timeout."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conveyor import AsyncClient, TaskContext, Worker, spec
from conveyor_testkit.polling import wait_until

from tests.e2e.harness import POLL_INTERVAL, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]


async def test_a_worker_that_adds_slots_runs_that_many_more_at_once(cluster: Cluster) -> None:
    api = await cluster.start_api()
    first = cluster.start_dispatcher()
    cluster.start_dispatcher()
    target = f"127.0.0.1:{api.port}"
    worker = Worker(target, queues={"credit": 1}, concurrency=1, grace_period=0)
    gate = asyncio.Event()
    running: set[str] = set()
    peak = 0

    @worker.task("e2e.gated")
    async def gated(payload: Any, ctx: TaskContext) -> None:
        nonlocal peak
        running.add(ctx.task_id)
        peak = max(peak, len(running))
        try:
            await gate.wait()
        finally:
            running.discard(ctx.task_id)

    run = asyncio.ensure_future(worker.run())
    try:
        await wait_until(
            lambda: worker.session_id is not None, within=30, message="a worker session"
        )
        worker.add_slots("credit", 2)
        async with AsyncClient(target) as client:
            for result in await client.enqueue_batch(
                [spec("e2e.gated", {"i": i}, queue="credit") for i in range(6)]
            ):
                assert result.task is not None, result.error
        await wait_until(
            lambda: len(running) == 3, within=60, interval=POLL_INTERVAL, message="3 at once"
        )
        assert peak == 3
        # kill -9 a dispatcher (the owner, or not): the slots hold with whichever owns
        # the queue next, and the next three run at once, never more.
        started = set(running)
        first.kill9()
        gate.set()
        gate = asyncio.Event()
        await wait_until(
            lambda: len(running) == 3 and not running & started,
            within=60,
            interval=POLL_INTERVAL,
            message="the next 3 at once",
        )
        assert peak == 3
    finally:
        gate.set()
        worker.stop(force=True)
        await asyncio.wait_for(run, 30)
