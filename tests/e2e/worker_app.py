"""An SDK worker process for end-to-end tests.

Each run of a handler appends ``start <task id> <attempt> <pid> <ns>`` and, when it
finishes, ``done <task id> <pid> <ns>`` to the record file (one write per line, so lines
from several processes never interleave).

Modes (for the types ``e2e.noop`` and ``e2e.echo``): ``noop`` returns at once; ``work``
holds the slot for a short simulated workload; ``block`` never finishes on its own (until
cancelled: for kill and shutdown tests).

Lifecycle types, whatever the mode, each driven by its payload (a JSON object):

- ``e2e.fail``: raises ``RuntimeError(payload["error"])`` on the first ``payload["fails"]``
  attempts (every attempt without it), then returns ``{"attempt": n}``;
- ``e2e.skip``: raises ``SkipRetry(payload["error"])``;
- ``e2e.flaky``: raises ``RuntimeError`` while the file ``payload["flag"]`` exists, else
  returns (a handler that fails until it is fixed: for circuit breakers);
- ``e2e.retry_after``: raises ``RetryAfter(payload["delay"])`` on the first
  ``payload["fails"]`` attempts, then returns;
- ``e2e.result``: returns ``payload["result"]``, or ``"x" * payload["size"]``;
- ``e2e.progress``: reports ``{"step": 1}`` as progress, then runs until cancelled;
- ``e2e.sleep``: an async handler that sleeps ``payload["seconds"]``;
- ``e2e.sync_poll``: a sync handler that polls ``ctx.cancelled`` for up to
  ``payload["seconds"]`` and stops as soon as it is set;
- ``e2e.sync_ignore``: a sync handler that ignores ``ctx.cancelled`` and sleeps
  ``payload["seconds"]`` (the slow, uncooperative handler).

Aggregation-group batches of the type ``e2e.batch`` (a batch handler): records
``batch <group> <member ids, comma-separated> <pid>`` when it starts, then, in mode
``block``, waits until cancelled, else every member succeeds (``batchdone <group> <pid>``).

Beyond ``start``/``done``, a handler that is cancelled records ``cancelled <task id> <pid>
<reason>`` (spaces in the reason become ``_``), and a sync handler that returns records
``finished <task id> <pid> <cancelled flag>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from conveyor import BatchContext, RetryAfter, SkipRetry, TaskContext, Worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--queue", action="append", default=[], help="name=weight")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--record", required=True)
    parser.add_argument("--mode", choices=["noop", "work", "block"], default="noop")
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--tls-ca", default=None, help="CA bundle that verifies the api")
    parser.add_argument("--tls-cert", default=None, help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", default=None, help="key of --tls-cert")
    args = parser.parse_args()

    queues = {q.split("=")[0]: int(q.split("=")[1]) for q in args.queue} or {"default": 1}
    fd = os.open(args.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    def record(line: str) -> None:
        os.write(fd, f"{line} {time.monotonic_ns()}\n".encode())

    worker = Worker(
        target=args.target,
        # From the environment, as an operator would pass it: not in the process list.
        token=os.environ.get("CONVEYOR_TOKEN") or None,
        queues=queues,
        concurrency=args.concurrency,
        grace_period=args.grace,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )

    async def handle(payload: Any, ctx: TaskContext) -> Any:
        record(f"start {ctx.task_id} {ctx.attempt} {pid} {ctx.queue}")
        if args.mode == "work":
            await asyncio.sleep(0.02)  # the simulated workload itself
        elif args.mode == "block":
            await asyncio.Event().wait()
        record(f"done {ctx.task_id} {pid} {ctx.queue}")
        return payload

    for task_type in ("e2e.noop", "e2e.echo"):
        worker.task(task_type)(handle)

    @worker.batch_task("e2e.batch")
    async def batch(payloads: list[Any], ctx: BatchContext) -> None:
        record(f"batch {ctx.group} {','.join(t.task_id for t in ctx.tasks)} {pid}")
        if args.mode == "block":
            await asyncio.Event().wait()
        record(f"batchdone {ctx.group} {pid}")

    register_lifecycle_handlers(worker, record, pid)
    worker.run_forever()


def register_lifecycle_handlers(worker: Worker, record: Callable[[str], None], pid: int) -> None:
    """The payload-driven ``e2e.*`` handlers of the lifecycle tests (see the docstring)."""

    def cancelled(ctx: TaskContext) -> None:
        reason = (ctx.cancel_reason or "cancelled").replace(" ", "_")
        record(f"cancelled {ctx.task_id} {pid} {reason}")

    def failing_attempt(payload: dict[str, Any], ctx: TaskContext) -> bool:
        record(f"start {ctx.task_id} {ctx.attempt} {pid} {ctx.queue}")
        fails: int = payload.get("fails", ctx.attempt)
        return ctx.attempt <= fails

    @worker.task("e2e.fail")
    async def fail(payload: dict[str, Any], ctx: TaskContext) -> Any:
        if failing_attempt(payload, ctx):
            raise RuntimeError(payload.get("error", "boom"))
        record(f"done {ctx.task_id} {pid} {ctx.queue}")
        return {"attempt": ctx.attempt}

    @worker.task("e2e.flaky")
    def flaky(payload: dict[str, Any], ctx: TaskContext) -> None:  # sync: it reads a file
        record(f"start {ctx.task_id} {ctx.attempt} {pid} {ctx.queue}")
        if os.path.exists(payload["flag"]):
            raise RuntimeError("the flaky handler is broken")
        record(f"done {ctx.task_id} {pid} {ctx.queue}")

    @worker.task("e2e.skip")
    async def skip(payload: dict[str, Any], ctx: TaskContext) -> None:
        record(f"start {ctx.task_id} {ctx.attempt} {pid} {ctx.queue}")
        raise SkipRetry(payload.get("error", "no point in retrying"))

    @worker.task("e2e.retry_after")
    async def retry_after(payload: dict[str, Any], ctx: TaskContext) -> Any:
        if failing_attempt(payload, ctx):
            raise RetryAfter(payload["delay"], "come back later")
        record(f"done {ctx.task_id} {pid} {ctx.queue}")
        return {"attempt": ctx.attempt}

    @worker.task("e2e.result")
    async def result(payload: dict[str, Any], ctx: TaskContext) -> Any:
        record(f"start {ctx.task_id} {ctx.attempt} {pid} {ctx.queue}")
        return "x" * payload["size"] if "size" in payload else payload.get("result")

    @worker.task("e2e.progress")
    async def progress(payload: dict[str, Any], ctx: TaskContext) -> None:
        record(f"start {ctx.task_id} {ctx.attempt} {pid} {ctx.queue}")
        await ctx.progress({"step": 1})
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled(ctx)
            raise

    @worker.task("e2e.sleep")
    async def sleep(payload: dict[str, Any], ctx: TaskContext) -> None:
        record(f"start {ctx.task_id} {ctx.attempt} {pid} {ctx.queue}")
        try:
            await asyncio.sleep(payload["seconds"])  # the handler's "work"
        except asyncio.CancelledError:
            cancelled(ctx)
            raise
        record(f"done {ctx.task_id} {pid} {ctx.queue}")

    @worker.task("e2e.sync_poll")
    def sync_poll(payload: dict[str, Any], ctx: TaskContext) -> None:
        record(f"start {ctx.task_id} {ctx.attempt} {pid} {ctx.queue}")
        if ctx.wait_cancelled(payload["seconds"]):
            cancelled(ctx)
            return
        record(f"done {ctx.task_id} {pid} {ctx.queue}")

    @worker.task("e2e.sync_ignore")
    def sync_ignore(payload: dict[str, Any], ctx: TaskContext) -> None:
        record(f"start {ctx.task_id} {ctx.attempt} {pid} {ctx.queue}")
        time.sleep(payload["seconds"])  # deliberately deaf to ctx.cancelled
        record(f"finished {ctx.task_id} {pid} {ctx.cancelled}")


if __name__ == "__main__":
    main()
