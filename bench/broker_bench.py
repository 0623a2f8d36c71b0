"""Broker benchmark: the Postgres broker's batch hot path against the local PostgreSQL.

    uv run python -m bench.broker_bench [--dsn DSN] [--tasks 20000]

Creates a throwaway database on the server named by ``--dsn`` (dropped afterwards),
migrates it, then times three phases on one broker (one caller at a time, so the figures
are per-stream round-trip throughput, not server saturation):

1. EnqueueBatch: ``--tasks`` tasks in batches of ``--enqueue-batch`` (1000);
2. Lease: drain the queue with lease(``--lease-batch``) (100);
3. AckBatch: ack every leased task in batches of ``--ack-batch`` (100).

Prints rows/s and per-call latency percentiles per phase, and writes
bench/results/broker.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
from conveyor_broker import AckItem, NewTask, SystemClock, Task
from conveyor_broker.postgres import PostgresBroker, migrate

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_DSN = os.environ.get(
    "CONVEYOR_BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)
QUEUE = "bench"
LEASE_TTL = timedelta(minutes=5)


@dataclass(frozen=True, slots=True)
class PhaseResult:
    """One timed phase: how many rows in how many calls, and how fast."""

    name: str
    batch: int
    rows: int
    calls: int
    seconds: float
    rows_per_s: float
    call_p50_ms: float
    call_p99_ms: float


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values`` by nearest rank."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))
    return ordered[index]


async def timed_phase(
    name: str, batch: int, calls: Sequence[Callable[[], Awaitable[int]]]
) -> PhaseResult:
    """Run ``calls`` one after another; each returns how many rows it handled."""
    durations: list[float] = []
    rows = 0
    start = time.perf_counter()
    for call in calls:
        began = time.perf_counter()
        rows += await call()
        durations.append(time.perf_counter() - began)
    seconds = time.perf_counter() - start
    return PhaseResult(
        name=name,
        batch=batch,
        rows=rows,
        calls=len(durations),
        seconds=round(seconds, 4),
        rows_per_s=round(rows / seconds, 1),
        call_p50_ms=round(percentile(durations, 50) * 1000, 3),
        call_p99_ms=round(percentile(durations, 99) * 1000, 3),
    )


async def bench(dsn: str, args: argparse.Namespace) -> list[PhaseResult]:
    """Run the three phases against a migrated database at ``dsn``."""
    await migrate(dsn)
    broker = await PostgresBroker.connect(dsn, SystemClock(), min_size=1, max_size=2)
    try:
        payload = os.urandom(args.payload)
        batches = [
            [NewTask(QUEUE, "bench.noop", payload) for _ in range(size)]
            for size in _sizes(args.tasks, args.enqueue_batch)
        ]

        def enqueue_call(batch: list[NewTask]) -> Callable[[], Awaitable[int]]:
            async def call() -> int:
                return len(await broker.enqueue_batch(batch))

            return call

        enqueued = await timed_phase(
            "enqueue_batch", args.enqueue_batch, [enqueue_call(b) for b in batches]
        )

        leased: list[Task] = []

        async def lease_call() -> int:
            got = await broker.lease(QUEUE, args.lease_batch, LEASE_TTL)
            leased.extend(got)
            return len(got)

        lease_calls = -(-args.tasks // args.lease_batch)
        leasing = await timed_phase("lease", args.lease_batch, [lease_call] * lease_calls)
        if len(leased) != args.tasks:
            raise RuntimeError(f"leased {len(leased)} of {args.tasks} tasks")

        def ack_call(chunk: list[Task]) -> Callable[[], Awaitable[int]]:
            items = [AckItem(task.id, task.lease_id or "") for task in chunk]

            async def call() -> int:
                done = await broker.ack_batch(items)
                if not all(done):
                    raise RuntimeError("an ack lost its lease")
                return len(done)

            return call

        chunks = [leased[i : i + args.ack_batch] for i in range(0, len(leased), args.ack_batch)]
        acking = await timed_phase("ack_batch", args.ack_batch, [ack_call(c) for c in chunks])
        return [enqueued, leasing, acking]
    finally:
        await broker.close()


def _sizes(total: int, batch: int) -> list[int]:
    return [min(batch, total - start) for start in range(0, total, batch)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Create the throwaway database, benchmark, drop it, and return the report."""
    name = f"conveyor_bench_{uuid.uuid4().hex[:8]}"
    # Other work on the machine skews the figures; record how busy it was.
    load_before = os.getloadavg()[0]
    admin = await asyncpg.connect(args.dsn)
    try:
        server_version = await admin.fetchval("SHOW server_version")
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            phases = await bench(args.dsn.rpartition("/")[0] + f"/{name}", args)
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()
    return {
        "benchmark": "broker",
        "driver": "postgres",
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "tasks": args.tasks,
        "payload_bytes": args.payload,
        "postgres": server_version,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "phases": {phase.name: asdict(phase) for phase in phases},
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, run the benchmark, print and save the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="a database on the target server")
    parser.add_argument("--tasks", type=int, default=20000)
    parser.add_argument("--payload", type=int, default=128, help="payload bytes per task")
    parser.add_argument("--enqueue-batch", type=int, default=1000)
    parser.add_argument("--lease-batch", type=int, default=100)
    parser.add_argument("--ack-batch", type=int, default=100)
    parser.add_argument("--out", type=Path, default=RESULTS / "broker.json")
    args = parser.parse_args(argv)
    if args.tasks < 1:
        parser.error("--tasks must be >= 1")

    report = asyncio.run(run(args))
    for phase in report["phases"].values():
        print(
            f"{phase['name']:<14} batch={phase['batch']:<5} {phase['rows_per_s']:>10.0f} rows/s"
            f"  call p50={phase['call_p50_ms']:.2f}ms p99={phase['call_p99_ms']:.2f}ms"
            f"  ({phase['rows']} rows, {phase['calls']} calls, {phase['seconds']:.2f}s)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
