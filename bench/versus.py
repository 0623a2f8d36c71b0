"""Conveyor and pgqueuer side by side, through one harness, in one run.

    uv run python -m bench.versus [--tasks 20000] [--rounds 3] [--sustained 2000,5000]

Each round runs both systems, the order alternating (so a slow spell of the machine
weighs on both), each on its own fresh database on the same Postgres:

- **Conveyor**: one api, one dispatcher, one maintenance process (a private nats-server),
  two SDK worker processes (tests/e2e/worker_app.py) x ``--concurrency`` slots;
- **pgqueuer**: two worker processes (bench/pgqueuer_worker.py: QueueManager,
  LISTEN/NOTIFY, ``batch_size`` ``--pgq-batch-size``), its schema installed by
  ``Queries.install``.

Through the same phases:

1. **batch enqueue**: ``--tasks`` no-op tasks, 1,000 per call, four calls in flight, with
   no worker running: tasks/s;
2. **backlog drain**: then the two workers start, and the drain is timed from the first
   handler start to the moment the backend reports nothing unfinished (Conveyor: no task
   row that is not completed; pgqueuer: an empty queue table): tasks/s, and how busy the
   machine's cores were meanwhile (CPU of every process involved, Postgres backends
   included, over the window and the cores);
3. **latency** against idle workers: ``--latency-samples`` single enqueues on a
   ``--grid-ms`` grid: enqueue -> handler start p50/p99 (both ends CLOCK_MONOTONIC), and the
   single enqueue call's own p50;
4. with ``--sustained R1,R2...``: for each rate, a steady stream for ``--duration`` seconds
   (the producer sends rate/100 tasks in one call every 10 ms, calls not waiting on each
   other): enqueue -> start p50/p99/p99.9, the rate of starts, and the backlog left.

Before phase 1 each system takes a warm-up burst (4,000 tasks and one single enqueue),
deleted from its tables before the clock starts. Both producers run on uvloop in this
process. Prints each round and a table of medians
with the ratio Conveyor / pgqueuer; writes bench/results/versus.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import uvloop
from conveyor import AsyncClient, spec
from conveyor_broker.postgres import migrate
from conveyor_runtime.embedded_nats import EmbeddedNats
from conveyor_testkit.polling import wait_until
from pgqueuer import Queries

from bench.e2e_bench import cpu_seconds, percentile, postgres_backends
from tests.e2e.harness import Cluster

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
QUEUE = "bench"
#: The producers' batch size, and how many batch calls are in flight at once.
BATCH = 1000
IN_FLIGHT = 4
#: The sustained stream's tick.
TICK = 0.01


class Starts:
    """The handler starts the workers wrote to a record file (``start <id> ... <ns>``),
    read incrementally: each poll parses only the new bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.at: dict[str, int] = {}

    def poll(self) -> int:
        """Read what was appended; the number of starts so far."""
        if self.path.exists():
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
            self._offset += len(data)
            *complete, self._partial = (self._partial + data).split(b"\n")
            for line in complete:
                fields = line.split()
                if fields and fields[0] == b"start":
                    # The first start of each task (a redelivery would be a second).
                    self.at.setdefault(fields[1].decode(), int(fields[-1]))
        return len(self.at)


@dataclass
class System:
    """One system under test: how to enqueue to it, how to start its workers, and how to
    ask its backend what is unfinished."""

    name: str
    dsn: str
    cluster: Cluster
    record: Path
    enqueue_many: Callable[[int], Awaitable[list[str]]]
    enqueue_one: Callable[[], Awaitable[str]]
    start_workers: Callable[[], None]
    unfinished_sql: str
    #: Empties the backend after the warm-up (no worker runs yet).
    clear_sql: str
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def unfinished(self, conn: asyncpg.Connection[asyncpg.Record]) -> int:
        return int(await conn.fetchval(self.unfinished_sql))

    def cpu(self, dbname: str) -> float:
        """CPU seconds so far of every process of this system, its backends included."""
        procs = sum(cpu_seconds(p.pid) for p in self.cluster.procs)
        return procs + sum(cpu_seconds(pid) for pid in postgres_backends(dbname))


async def _database(admin: str, prefix: str) -> tuple[str, str]:
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(admin)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return name, admin.rpartition("/")[0] + f"/{name}"


async def _drop(admin: str, name: str) -> None:
    conn = await asyncpg.connect(admin)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def conveyor_system(args: argparse.Namespace, dsn: str, workdir: Path) -> System:
    """Conveyor's services started (no worker yet) on the migrated database ``dsn``."""
    await migrate(dsn)
    nats = EmbeddedNats()
    nats.start()
    cluster = Cluster(dsn=dsn, nats_url=nats.url, workdir=workdir)
    cluster.settings_env["CONVEYOR_LOG_LEVEL"] = "warning"
    if args.backlog_limit:
        cluster.settings_env["CONVEYOR_ENQUEUE_BACKLOG_LIMIT"] = str(args.backlog_limit)
    target = await cluster.start_services()
    client = AsyncClient(target)
    await client.__aenter__()
    record = workdir / "record.txt"

    async def enqueue_many(n: int) -> list[str]:
        results = await client.enqueue_batch([spec("e2e.noop", {}, queue=QUEUE) for _ in range(n)])
        return [r.task.id for r in results if r.task is not None]

    async def enqueue_one() -> str:
        return (await client.enqueue("e2e.noop", {}, queue=QUEUE)).id

    def start_workers() -> None:
        for _ in range(args.workers):
            cluster.start_worker(
                target, queues={QUEUE: 1}, concurrency=args.concurrency, record=record
            )

    async def close() -> None:
        await client.__aexit__(None, None, None)
        cluster.stop_all()
        nats.stop()

    return System(
        "conveyor",
        dsn,
        cluster,
        record,
        enqueue_many,
        enqueue_one,
        start_workers,
        "SELECT count(*) FROM conveyor_tasks WHERE state <> 'completed'",
        "DELETE FROM conveyor_tasks",
        [close],
    )


async def pgqueuer_system(args: argparse.Namespace, dsn: str, workdir: Path) -> System:
    """pgqueuer's schema installed on ``dsn`` (no worker yet)."""
    pool = await asyncpg.create_pool(dsn, min_size=IN_FLIGHT + 1, max_size=IN_FLIGHT + 1)
    await Queries.from_asyncpg_pool(pool).install()
    single = await asyncpg.connect(dsn)
    batches = Queries.from_asyncpg_pool(pool)
    one = Queries.from_asyncpg_connection(single)
    cluster = Cluster(dsn=dsn, nats_url="nats://127.0.0.1:1", workdir=workdir)
    record = workdir / "record.txt"

    async def enqueue_many(n: int) -> list[str]:
        ids = await batches.enqueue(["noop"] * n, [None] * n, [0] * n)
        return [str(i) for i in ids]

    async def enqueue_one() -> str:
        return str((await one.enqueue("noop", None))[0])

    def start_workers() -> None:
        worker = str(ROOT / "bench" / "pgqueuer_worker.py")
        for _ in range(args.workers):
            cluster.spawn(
                "pgqueuer",
                [
                    worker,
                    *("--dsn", dsn, "--record", str(record)),
                    *("--batch-size", str(args.pgq_batch_size)),
                ],
            )

    async def close() -> None:
        cluster.stop_all()
        await single.close()
        await pool.close()

    return System(
        "pgqueuer",
        dsn,
        cluster,
        record,
        enqueue_many,
        enqueue_one,
        start_workers,
        "SELECT count(*) FROM pgqueuer",
        "DELETE FROM pgqueuer",
        [close],
    )


def _latency(sent: dict[str, int], starts: Starts) -> list[float]:
    return [(starts.at[i] - t) / 1e6 for i, t in sent.items() if i in starts.at]


async def _burst(system: System, total: int) -> float:
    """Enqueue ``total`` tasks in batches of BATCH, IN_FLIGHT at once: seconds taken."""
    t0 = time.perf_counter()
    sizes = [min(BATCH, total - n) for n in range(0, total, BATCH)]
    for chunk in range(0, len(sizes), IN_FLIGHT):
        await asyncio.gather(*(system.enqueue_many(n) for n in sizes[chunk : chunk + IN_FLIGHT]))
    return time.perf_counter() - t0


async def _sustained(
    system: System,
    conn: asyncpg.Connection[asyncpg.Record],
    starts: Starts,
    rate: int,
    seconds: float,
) -> dict[str, Any]:
    """A steady stream of ``rate`` tasks/s for ``seconds``, rate/100 per call every TICK."""
    per_tick = max(1, round(rate * TICK))
    sent: dict[str, int] = {}
    calls: set[asyncio.Task[None]] = set()

    async def send() -> None:
        before = time.monotonic_ns()
        for task_id in await system.enqueue_many(per_tick):
            sent[task_id] = before

    starts.poll()
    started_before = len(starts.at)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    ticks = round(seconds / TICK)
    for n in range(ticks):
        call = asyncio.create_task(send())
        calls.add(call)
        call.add_done_callback(calls.discard)
        delay = t0 + (n + 1) * TICK - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)  # the stream's pacing
        if n % 20 == 0:
            starts.poll()
    window = loop.time() - t0
    starts.poll()
    started = len(starts.at) - started_before
    await asyncio.gather(*calls)
    # What admission control refused (Conveyor with --backlog-limit): offered, not sent.
    refused = per_tick * ticks - len(sent)
    backlog = await system.unfinished(conn)
    # Let the backlog drain (bounded) so the latencies of the stream's tail are counted.
    await wait_until(
        lambda: starts.poll() >= started_before + len(sent),
        within=max(60.0, backlog / 1000),
        interval=0.05,
        message=f"{system.name}: the sustained stream's tasks started",
    )
    latencies = _latency(sent, starts)
    return {
        "rate": rate,
        "sent": len(sent),
        "refused": refused,
        "started_per_s": round(started / window),
        "backlog_at_end": backlog,
        "p50_ms": round(percentile(latencies, 50), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "p999_ms": round(percentile(latencies, 99.9), 2),
    }


async def run_system(args: argparse.Namespace, which: str) -> dict[str, Any]:
    """Every phase on one system, on a fresh database and processes."""
    dbname, dsn = await _database(args.admin_dsn, f"versus_{which}")
    workdir = Path(tempfile.mkdtemp(prefix=f"versus-{which}-"))
    make = conveyor_system if which == "conveyor" else pgqueuer_system
    system = await make(args, dsn, workdir)
    conn = await asyncpg.connect(dsn)
    try:
        # Warm-up (connections, statements, first calls), then an empty backend.
        await _burst(system, IN_FLIGHT * BATCH)
        await system.enqueue_one()
        await conn.execute(system.clear_sql)
        # 1. Batch enqueue, no worker running.
        enqueue_s = await _burst(system, args.tasks)
        assert await system.unfinished(conn) == args.tasks
        # 2. Backlog drain.
        starts = Starts(system.record)
        cpu0, wall0 = system.cpu(dbname), time.monotonic_ns()
        system.start_workers()
        await wait_until(
            lambda: starts.poll() > 0, within=60, interval=0.01, message=f"{which} first start"
        )
        first = min(starts.at.values())

        async def drained() -> bool:
            return await system.unfinished(conn) == 0

        await wait_until(drained, within=600, interval=0.01, message=f"{which} drained")
        drained_ns = time.monotonic_ns()
        cpu1, wall1 = system.cpu(dbname), time.monotonic_ns()
        busy = (cpu1 - cpu0) / ((wall1 - wall0) / 1e9 * (os.cpu_count() or 1))
        drain_s = (drained_ns - first) / 1e9
        # 3. Latency against idle workers: single enqueues on a grid.
        sent: dict[str, int] = {}
        calls: list[float] = []
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        grid = args.grid_ms / 1000
        for n in range(args.latency_samples):
            before = time.monotonic_ns()
            task_id = await system.enqueue_one()
            calls.append((time.monotonic_ns() - before) / 1e6)
            sent[task_id] = before
            delay = t0 + (n + 1) * grid - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # the grid's pacing
        await wait_until(
            lambda: starts.poll() >= args.tasks + len(sent),
            within=60,
            interval=0.02,
            message=f"{which} latency tasks started",
        )
        latencies = _latency(sent, starts)
        sustained = [
            await _sustained(system, conn, starts, rate, args.duration) for rate in args.sustained
        ]
        return {
            "system": which,
            "enqueue_per_s": round(args.tasks / enqueue_s),
            "drain_per_s": round(args.tasks / drain_s),
            "drain_busy_pct": round(100 * busy),
            "p50_ms": round(percentile(latencies, 50), 2),
            "p99_ms": round(percentile(latencies, 99), 2),
            "call_p50_ms": round(percentile(calls, 50), 2),
            "sustained": sustained,
        }
    finally:
        await conn.close()
        for close in system.closers:
            await close()
        shutil.rmtree(workdir, ignore_errors=True)
        await _drop(args.admin_dsn, dbname)


#: The table's rows: key, label, whether higher is better.
ROWS = (
    ("enqueue_per_s", "batch enqueue (1,000 per call), tasks/s", True),
    ("drain_per_s", "backlog drain, tasks/s", True),
    ("drain_busy_pct", "  cores busy during the drain, %", None),
    ("p50_ms", "enqueue -> handler start p50, ms", False),
    ("p99_ms", "enqueue -> handler start p99, ms", False),
    ("call_p50_ms", "single enqueue call p50, ms", False),
)


def table(runs: list[dict[str, Any]], rates: list[int]) -> tuple[str, dict[str, Any]]:
    """The medians per system and their ratio, as printed and as stored."""
    mine = {s: [r for r in runs if r["system"] == s] for s in ("conveyor", "pgqueuer")}
    medians: dict[str, dict[str, float]] = {}
    for system, rs in mine.items():
        if not rs:  # a run of one system only (--systems)
            medians[system] = defaultdict(float)
            continue
        medians[system] = {key: statistics.median(r[key] for r in rs) for key, _, _ in ROWS}
        for i, rate in enumerate(rates):
            for key in ("started_per_s", "p50_ms", "p99_ms", "p999_ms", "backlog_at_end"):
                values = [r["sustained"][i][key] for r in rs]
                medians[system][f"sustained {rate}/s {key}"] = statistics.median(values)
    lines = [f"{'':46} {'conveyor':>10} {'pgqueuer':>10} {'ratio':>7}"]
    keys = [(key, label) for key, label, _ in ROWS] + [
        (f"sustained {rate}/s {key}", f"sustained {rate}/s: {key}")
        for rate in rates
        for key in ("started_per_s", "p50_ms", "p99_ms", "p999_ms", "backlog_at_end")
    ]
    ratios: dict[str, float | None] = {}
    for key, label in keys:
        c, p = medians["conveyor"][key], medians["pgqueuer"][key]
        ratio = round(c / p, 2) if p else None
        ratios[key] = ratio
        shown = "" if ratio is None else f"{ratio:.2f}x"
        lines.append(f"{label:46} {c:>10} {p:>10} {shown:>7}")
    runs_each = max(len(rs) for rs in mine.values())
    lines.insert(0, f"medians of {runs_each} run(s) each (ratio: conveyor / pgqueuer)")
    return "\n".join(lines), {"medians": medians, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="worker processes, each system")
    parser.add_argument("--concurrency", type=int, default=64, help="slots per Conveyor worker")
    parser.add_argument("--pgq-batch-size", type=int, default=100)
    parser.add_argument("--latency-samples", type=int, default=500)
    parser.add_argument("--grid-ms", type=float, default=5.0)
    parser.add_argument(
        "--sustained",
        type=lambda text: [int(r) for r in text.split(",") if r],
        default=[],
        help="comma-separated steady rates (tasks/s) to hold, each for --duration",
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per steady rate")
    parser.add_argument(
        "--backlog-limit",
        type=int,
        default=0,
        help="Conveyor's CONVEYOR_ENQUEUE_BACKLOG_LIMIT (admission control; 0: none)",
    )
    parser.add_argument(
        "--systems",
        type=lambda text: [s for s in text.split(",") if s],
        default=["conveyor", "pgqueuer"],
        help="comma-separated systems to run (conveyor, pgqueuer): one alone, to iterate",
    )
    parser.add_argument("--admin-dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        order = ("conveyor", "pgqueuer") if round_ % 2 == 0 else ("pgqueuer", "conveyor")
        for which in (w for w in order if w in args.systems):
            result = uvloop.run(run_system(args, which))
            runs.append(result)
            print(f"round {round_ + 1} {which}: {json.dumps(result)}", flush=True)
    printed, stored = table(runs, args.sustained)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "versus.json").write_text(
        json.dumps({"args": vars(args), "runs": runs, **stored}, indent=2) + "\n"
    )
    print(printed)


if __name__ == "__main__":
    main()
