"""A pipeline of dependent tasks: fetch two sources, merge them, publish a report.

    uv run python examples/pipeline.py      # against `conveyor dev` on 127.0.0.1:50051

The whole pipeline is enqueued at once, in one transaction (``enqueue_tx``): each task
names the ones it waits for by an id made beforehand (``new_task_id``). A task runs once
its dependencies have completed, and reads what they returned with
``ctx.dependency_results()``. What happens when a dependency fails for good is each
task's own ``on_failure``:

- ``merge`` runs anyway (``continue``), with whatever sources did arrive;
- ``publish`` is canceled with it (``cascade_cancel``): no report from no data;
- ``audit`` (the default, ``block``) waits for an operator, who can see why with
  ``conveyor task deps ID`` and run it anyway with ``conveyor task run-now ID``.

Run it as it is and every step completes; with ``--break`` the second source fails for
good, ``merge`` still runs with one source, and the rest completes too (merge itself
did not fail). The worker runs in this process, beside the producer; set
CONVEYOR_TARGET to point it elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from conveyor import (
    AsyncClient,
    OnFailure,
    SkipRetry,
    TaskContext,
    TaskState,
    Worker,
    new_task_id,
    spec,
)

TARGET = os.environ.get("CONVEYOR_TARGET", "127.0.0.1:50051")
QUEUE = "pipeline"
ENDED = {TaskState.COMPLETED, TaskState.ARCHIVED, TaskState.CANCELED}

worker = Worker(TARGET, queues={QUEUE: 1}, concurrency=4)


@worker.task("source.fetch")
async def fetch(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """A source: fails for good when told to (SkipRetry: archived, never retried)."""
    if payload.get("broken"):
        raise SkipRetry(f"source {payload['name']} is down")
    return {"name": payload["name"], "rows": payload["rows"]}


@worker.task("sources.merge")
async def merge(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Runs once both fetches ended (on_failure=continue): only completed ones have a
    result; ``ctx.dependencies()`` also tells which failed, and why."""
    results = await ctx.dependency_results()  # {task id: what it returned}
    missing = [d.error for d in await ctx.dependencies() if not d.completed]
    rows = sorted(row for source in results.values() for row in source["rows"])
    return {"rows": rows, "sources": len(results), "missing": missing}


@worker.task("report.publish")
def publish(payload: dict[str, Any], ctx: TaskContext) -> str:
    """A plain def handler (it runs in a thread) reads the same with the blocking form."""
    [merged] = ctx.dependency_results_blocking(timeout=30).values()
    return f"{payload['title']}: {len(merged['rows'])} rows from {merged['sources']} sources"


@worker.task("report.audit")
async def audit(payload: dict[str, Any], ctx: TaskContext) -> int:
    [merged] = (await ctx.dependency_results()).values()
    return len(merged["missing"])


async def run_pipeline(client: AsyncClient, *, broken: bool) -> int:
    a, b, merged, published, audited = (new_task_id() for _ in range(5))
    await client.enqueue_tx(
        [
            spec("source.fetch", {"name": "a", "rows": [3, 1]}, queue=QUEUE, id=a),
            spec("source.fetch", {"name": "b", "rows": [2], "broken": broken}, queue=QUEUE, id=b),
            spec(
                "sources.merge",
                queue=QUEUE,
                id=merged,
                depends_on=[a, b],
                on_failure=OnFailure.CONTINUE,
            ),
            spec(
                "report.publish",
                {"title": "daily"},
                queue=QUEUE,
                id=published,
                depends_on=[merged],
                on_failure=OnFailure.CASCADE_CANCEL,
            ),
            spec("report.audit", queue=QUEUE, id=audited, depends_on=[merged]),
        ]
    )
    names = {a: "fetch a", b: "fetch b", merged: "merge", published: "publish", audited: "audit"}
    for _ in range(600):
        tasks = [await client.get_task(task_id) for task_id in names]
        if all(t.state in ENDED for t in tasks):
            break
        await asyncio.sleep(0.1)  # poll the states once in a while
    else:
        print("timed out: is the server running?")
        return 1
    for task in tasks:
        outcome = task.result if task.state is TaskState.COMPLETED else task.last_error
        print(f"{names[task.id]:<8} {task.state.value:<10} {outcome}")
    return 0 if tasks[-2].state is TaskState.COMPLETED else 1


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--break", dest="broken", action="store_true", help="source b fails")
    args = parser.parse_args()
    running = asyncio.create_task(worker.run())
    try:
        async with AsyncClient(TARGET) as client:
            return await run_pipeline(client, broken=args.broken)
    finally:
        worker.stop()
        await running


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
