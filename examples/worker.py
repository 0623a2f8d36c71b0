"""Quickstart worker: runs `email.send` and `report.build` tasks, and `digest.send` batches.

    uv run python examples/worker.py      # against `conveyor dev` on 127.0.0.1:50051

Set CONVEYOR_TARGET to point it elsewhere. Stop it with Ctrl-C: running tasks finish
(or are handed back) before it exits.
"""

from __future__ import annotations

import os
import time
from typing import Any

from conveyor import BatchContext, SkipRetry, TaskContext, Worker

worker = Worker(
    os.environ.get("CONVEYOR_TARGET", "127.0.0.1:50051"),
    # emails get three times the slots of reports; digests come as whole groups
    queues={"emails": 3, "reports": 1, "digests": 1},
    concurrency=8,
)


@worker.task("email.send")
async def send_email(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """An async handler: its return value is stored as the task's result."""
    if "@" not in payload.get("to", ""):
        raise SkipRetry(f"not an address: {payload.get('to')!r}")  # archived, never retried
    await ctx.progress({"step": "sending"})
    print(f"[attempt {ctx.attempt}] email to {payload['to']}: {payload['subject']}", flush=True)
    return {"delivered_to": payload["to"]}


@worker.task("report.build")
def build_report(payload: dict[str, Any], ctx: TaskContext) -> str:
    """A sync handler runs in a thread; it checks ctx.cancelled to stop early."""
    for _ in range(payload.get("pages", 1)):
        if ctx.cancelled:
            raise RuntimeError("cancelled")
        time.sleep(0.01)  # stands in for real work
    print(f"report {payload['name']} built", flush=True)
    return f"{payload['name']}.pdf"


@worker.batch_task("digest.send")
async def send_digest(payloads: list[dict[str, Any]], batch: BatchContext) -> None:
    """A batch handler: one call for a whole aggregation group (examples/groups.py);
    returning None completes every member."""
    events = ", ".join(p["event"] for p in payloads)
    print(f"digest for {batch.group}: {len(batch)} events ({events})", flush=True)


if __name__ == "__main__":
    worker.run_forever()
