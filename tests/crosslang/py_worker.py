"""The checklist's behaviours (checklist.json) as a Python-SDK worker process.

    python tests/crosslang/py_worker.py TARGET QUEUE

SIGTERM stops it gracefully (exit 0).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from conveyor import RetryAfter, SkipRetry, TaskContext, Worker


def named_error(name: str, message: str) -> Exception:
    """An exception whose class is named ``name`` (reported as "Name: message")."""
    cls: type[Exception] = type(name, (Exception,), {})
    return cls(message)


def build(target: str, queue: str) -> Worker:
    worker = Worker(
        target, queues={queue: 1}, concurrency=8, grace_period=5.0, worker_id="crosslang-py"
    )

    @worker.task("xl.echo")
    async def echo(payload: Any, ctx: TaskContext) -> Any:
        return payload

    @worker.task("xl.context")
    async def context(payload: Any, ctx: TaskContext) -> dict[str, Any]:
        return {
            "type": ctx.type,
            "attempt": ctx.attempt,
            "max_retry": ctx.max_retry,
            "headers": dict(ctx.headers),
        }

    @worker.task("xl.none")
    async def none(payload: Any, ctx: TaskContext) -> None:
        return None

    @worker.task("xl.flaky")
    async def flaky(payload: dict[str, Any], ctx: TaskContext) -> dict[str, int]:
        if ctx.attempt <= payload["fail_times"]:
            raise named_error(payload["error"], f"attempt {ctx.attempt} failed")
        return {"attempt": ctx.attempt}

    @worker.task("xl.fail")
    async def fail(payload: dict[str, Any], ctx: TaskContext) -> None:
        raise named_error(payload["error"], payload["message"])

    @worker.task("xl.skip")
    async def skip(payload: dict[str, Any], ctx: TaskContext) -> None:
        raise SkipRetry(payload["reason"])

    @worker.task("xl.retry_after")
    async def retry_after(payload: dict[str, Any], ctx: TaskContext) -> dict[str, int]:
        if ctx.attempt == 1:
            raise RetryAfter(payload["delay_ms"] / 1000, payload["message"])
        return {"attempt": ctx.attempt}

    @worker.task("xl.progress")
    async def progress(payload: dict[str, Any], ctx: TaskContext) -> str:
        for step in payload["steps"]:
            await ctx.progress(step)
        return "done"

    @worker.task("xl.slow")
    async def slow(payload: dict[str, Any], ctx: TaskContext) -> str:
        await asyncio.sleep(payload["ms"] / 1000)  # cancelled by the SDK on timeout/cancel
        return "slept"

    return worker


if __name__ == "__main__":
    build(sys.argv[1], sys.argv[2]).run_forever()
