"""Quickstart worker: runs `email.send` and `report.build` tasks.

    uv run python examples/worker.py      # against `conveyor dev` on 127.0.0.1:50051

Set CONVEYOR_TARGET to point it elsewhere. Stop it with Ctrl-C: running tasks finish
(or are handed back) before it exits.
"""

from __future__ import annotations

import os
import time
from typing import Any

from conveyor import SkipRetry, TaskContext, Worker

worker = Worker(
    os.environ.get("CONVEYOR_TARGET", "127.0.0.1:50051"),
    queues={"emails": 3, "reports": 1},  # emails get three times the slots of reports
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


if __name__ == "__main__":
    worker.run_forever()
