"""A pgqueuer worker process for the side-by-side benchmark (bench/versus.py).

    python bench/pgqueuer_worker.py --dsn DSN --record FILE [--batch-size 100]

Runs pgqueuer's QueueManager on uvloop (LISTEN/NOTIFY, ``batch_size`` jobs per dequeue)
with one entrypoint, ``noop``, whose handler records ``start <job id> <pid> <ns>`` to
``FILE`` (CLOCK_MONOTONIC nanoseconds, one write per line, as tests/e2e/worker_app.py
does for Conveyor's workers) and returns. Stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time

import asyncpg
import uvloop
from pgqueuer import Job, Queries, QueueManager


async def serve(dsn: str, record: str, batch_size: int) -> None:
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()
    conn = await asyncpg.connect(dsn)
    manager = QueueManager(Queries.from_asyncpg_connection(conn))

    @manager.entrypoint("noop")
    async def noop(job: Job) -> None:
        os.write(fd, f"start {job.id} {pid} {time.monotonic_ns()}\n".encode())

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, manager.shutdown.set)
    try:
        await manager.run(batch_size=batch_size)
    finally:
        await conn.close()
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--batch-size", type=int, default=100)
    args = parser.parse_args()
    uvloop.run(serve(args.dsn, args.record, args.batch_size))


if __name__ == "__main__":
    main()
