"""End-to-end benchmark: Postgres-backed services as processes, SDK workers, no-op tasks.

    uv run python -m bench.e2e_bench [--tasks 20000] [--workers 2] [--concurrency 64]
    uv run python -m bench.e2e_bench --encryption both --rounds 3   # its cost, on vs off
    uv run python -m bench.e2e_bench --metrics both --rounds 5      # metrics: on vs off
    uv run python -m bench.e2e_bench --recovery [--rounds 3]

Starts a private nats-server, a throwaway database (dropped afterwards), one api, one
dispatcher, one maintenance process and SDK worker processes; with ``--retained N`` the
task table first gets N completed tasks of the same queue (history kept for retention, as
in production; vacuumed and analyzed); then

1. throughput: enqueues a burst of no-op tasks into the empty database and drains it,
   reporting enqueue rate and tasks/s drained end to end (first enqueue to last completion),
   how many completed while the enqueue was still running, the drain rate after it, and
   the CPU each process role spent per task during the burst (read from /proc);
2. latency at light load: enqueues one task at a time at a low rate and reports
   enqueue -> handler-start latency p50/p95/p99 (both ends read CLOCK_MONOTONIC).

``--encryption on`` gives every service CONVEYOR_ENCRYPTION_KEYS (payloads, results...
stored encrypted); ``--encryption both`` measures the cost: ``--rounds`` rounds of one
run without and one with, alternating which goes first (so a machine that other work
slows down weighs on both), each on its own fresh database and processes, then the
medians of each and their difference. ``--payload-bytes`` pads each task's payload.

``--metrics on`` has every service serve ``/metrics`` on a port of its own and scrapes
them all every ``--scrape-interval`` seconds (1 s: more often than Prometheus would) for the
whole run; ``--metrics off`` turns the instrumentation itself off in every process
(bench/metrics_off: prometheus_client's recording calls and conveyor_runtime.metrics'
own become no-ops) and serves nothing; without the flag the services count but serve nothing, as in tests. ``--metrics
both`` measures the cost like ``--encryption both``: ``--rounds`` pairs of runs off and on.

Prints a summary and writes bench/results/e2e.json (``--encryption both``:
bench/results/e2e-encryption.json, ``--metrics both``: bench/results/e2e-metrics.json,
every run and the medians).

``--many-queues N`` runs another mode instead (bench/many_queues.py): one task in each of
N queues that no worker serves, a busy queue beside them, and what they cost in NATS
messages, JetStream operations and CPU, and in the busy queue's latency.

With ``--rate-limit`` it measures how closely a rate-limited queue's starts keep to the
limit (bench/rate_bench.py; writes bench/results/rate-limit.json).

With ``--keyed`` it measures how much a hot key under a concurrency limit slows the
other keys (bench/concurrency_bench.py; writes bench/results/concurrency.json).

With ``--fair-slots`` it measures how a worker with fewer slots than queues shares them
out by weight (bench/fair_bench.py; writes bench/results/fair-slots.json).

With ``--recovery`` it measures recovery instead: the stall after the queue's owning dispatcher is killed (or stopped)
and how soon a killed api's tasks run again (bench/recovery_bench.py; writes
bench/results/recovery.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import uvloop
from conveyor import AsyncClient, spec
from conveyor_broker.keyring import generate_key
from conveyor_broker.postgres import migrate
from conveyor_runtime.embedded_nats import EmbeddedNats, free_port
from conveyor_testkit.polling import wait_until

from bench.recovery_bench import report as recovery_report
from bench.recovery_bench import run_recovery
from tests.e2e.harness import POLL_INTERVAL, Cluster, port_open

RESULTS = Path(__file__).resolve().parent / "results"
#: On the PYTHONPATH of every process of a ``--metrics off`` run: no instrumentation.
METRICS_OFF = Path(__file__).resolve().parent / "metrics_off"
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def postgres_backends(dbname: str) -> list[int]:
    """Pids of the Postgres backends serving ``dbname`` (read from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if cmdline.startswith("postgres:") and f" {dbname} " in cmdline:
            pids.append(int(entry.name))
    return pids


def machine_busy_seconds() -> float:
    """CPU seconds every process of the machine has spent so far (/proc/stat: all but
    idle and iowait), to tell how much ran beside the benchmark."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / _TICK


def cpu_snapshot(cluster: Cluster, dbname: str) -> dict[str, float]:
    """CPU seconds so far by role: each service, the workers, Postgres, and this process."""
    snap: dict[str, float] = {}
    for proc in cluster.procs:
        role = proc.name.rstrip("0123456789")
        snap[role] = snap.get(role, 0.0) + cpu_seconds(proc.pid)
    snap["postgres"] = sum(cpu_seconds(pid) for pid in postgres_backends(dbname))
    snap["bench client"] = time.process_time()
    return snap


class RecordTail:
    """Reads the workers' record file incrementally: each poll parses only the new bytes.

    Re-reading the whole file on every poll (megabytes by the end of a burst) would cost
    the benchmark a good share of a core, taken from the processes it measures.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""
        self.lines: dict[str, list[list[str]]] = {"start": [], "done": []}

    def reset(self) -> None:
        """Empty the file and forget what was read."""
        self._path.write_text("")
        self._offset = 0
        self._partial = b""
        self.lines = {"start": [], "done": []}

    def count(self, kind: str) -> int:
        """Lines of ``kind`` written so far."""
        if self._path.exists():
            with self._path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
            self._offset += len(data)
            *complete, self._partial = (self._partial + data).split(b"\n")
            for line in complete:
                fields = line.decode().split()
                if fields and fields[0] in self.lines:
                    self.lines[fields[0]].append(fields)
        return len(self.lines[kind])


#: Completed tasks for --retained, made by the database itself (ids in ULID form, older
#: than any new task's, sorting before them as history does).
RETAIN = """
INSERT INTO conveyor_tasks (id, queue, type, payload, state, max_retry, available_at,
                            created_at, updated_at, started_at, completed_at)
SELECT lpad(i::text, 26, '0'), 'bench', 'e2e.noop', '\\x7b7d'::bytea, 'completed', 25,
       now(), now(), now(), now(), now()
FROM generate_series(1, $1::bigint) AS i
"""


async def retain(dsn: str, n: int) -> None:
    """Fill the task table with ``n`` completed tasks, then VACUUM ANALYZE it."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(RETAIN, n)
        await conn.execute("VACUUM ANALYZE conveyor_tasks")
    finally:
        await conn.close()


async def checkpoint(dsn: str) -> None:
    """Flush every dirty page now: the run before this one (and the database it dropped,
    which forces a checkpoint of its own) left writes that would otherwise be flushed
    during this run's burst, slowing it by a share that varies from run to run."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))
    return ordered[index]


class Scraper:
    """Scrapes every ``/metrics`` port every ``interval`` seconds, as Prometheus would
    (more often), until stopped; counts the scrapes and the bytes they read."""

    def __init__(self, ports: list[int], interval: float) -> None:
        self._ports = ports
        self._interval = interval
        self._task: asyncio.Task[None] | None = None
        self.scrapes = 0
        self.bytes = 0

    def start(self) -> None:
        """Start scraping in the background."""
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        async with httpx.AsyncClient() as http:
            while True:
                for port in self._ports:
                    reply = await http.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
                    reply.raise_for_status()
                    self.scrapes += 1
                    self.bytes += len(reply.content)
                await asyncio.sleep(self._interval)  # the scrape interval

    async def stop(self) -> None:
        """Stop scraping (raising what made a scrape fail, if one did)."""
        task, self._task = self._task, None
        if task is None:
            return
        if task.done():
            task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def start_services(cluster: Cluster, metrics: str | None) -> tuple[str, list[int]]:
    """One api, one dispatcher and one maintenance process; the api's address and the
    metrics ports (one per service with ``metrics`` on, else none)."""
    if metrics != "on":
        return await cluster.start_services(), []
    ports = [free_port() for _ in range(3)]
    env = [{"CONVEYOR_METRICS_PORT": str(port)} for port in ports]
    api = await cluster.start_api(env[0])
    cluster.start_dispatcher(env[1])
    cluster.start_maintenance(env[2])
    return f"127.0.0.1:{api.port}", ports


async def run(
    args: argparse.Namespace, *, encrypted: bool = False, metrics: str | None = None
) -> dict[str, Any]:
    """One run: ``metrics`` on (served and scraped), off (not even counted) or None (as
    the services run by default: counted, not served)."""
    admin = args.admin_dsn
    name = f"conveyor_bench_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(admin)
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()
    dsn = admin.rpartition("/")[0] + f"/{name}"
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    nats = EmbeddedNats()
    nats.start()
    cluster = Cluster(dsn=dsn, nats_url=nats.url, workdir=workdir)
    cluster.settings_env["CONVEYOR_LOG_LEVEL"] = "warning"
    if encrypted:
        cluster.settings_env["CONVEYOR_ENCRYPTION_KEYS"] = generate_key("bench")
    if metrics == "off":
        path = os.environ.get("PYTHONPATH")
        cluster.settings_env["PYTHONPATH"] = os.pathsep.join(
            [str(METRICS_OFF), *([path] if path else [])]
        )
    else:
        cluster.settings_env["CONVEYOR_METRICS_HOST"] = "127.0.0.1"
    scraper: Scraper | None = None
    payload: dict[str, Any] = {"pad": "x" * args.payload_bytes} if args.payload_bytes else {}
    try:
        await migrate(dsn)
        if args.retained:
            await retain(dsn, args.retained)
        await checkpoint(admin)
        target, ports = await start_services(cluster, metrics)
        if ports:
            await wait_until(
                lambda: all(port_open(port) for port in ports),
                within=60,
                interval=POLL_INTERVAL,
                message="metrics ports",
            )
            scraper = Scraper(ports, args.scrape_interval)
            scraper.start()
        record = workdir / "record.txt"
        # The burst goes round-robin over the queues; every worker serves them all.
        queues = ["bench"] + [f"bench{n}" for n in range(1, args.queues)]
        tail = RecordTail(record)
        for _ in range(args.workers):
            cluster.start_worker(
                target, queues=dict.fromkeys(queues, 1), concurrency=args.concurrency, record=record
            )

        async with AsyncClient(target) as client:
            # Warm up: every worker connected and one task through.
            await client.enqueue("e2e.noop", {}, queue="bench")
            await wait_until(
                lambda: tail.count("done") >= 1,
                within=60,
                interval=POLL_INTERVAL,
                message="warm-up task",
            )
            tail.reset()

            # 1. Throughput: a burst into the (nearly) empty table, drained at once.
            cpu0 = cpu_snapshot(cluster, name)
            busy0 = machine_busy_seconds()
            t0 = time.perf_counter()
            batch = 1000
            pending = [
                client.enqueue_batch(
                    [spec("e2e.noop", payload, queue=queues[n % len(queues)]) for n in range(batch)]
                )
                for _ in range(args.tasks // batch)
            ]
            for chunk in range(0, len(pending), 4):
                await asyncio.gather(*pending[chunk : chunk + 4])
            t_enqueued = time.perf_counter()
            done_at_enqueued = tail.count("done")
            await wait_until(
                lambda: tail.count("done") >= args.tasks,
                within=600,
                interval=0.02,
                message="burst drained",
            )
            t_drained = time.perf_counter()
            cpu1 = cpu_snapshot(cluster, name)
            busy1 = machine_busy_seconds()

            # 2. Latency at light load.
            tail.reset()
            sent: dict[str, int] = {}
            for _ in range(args.latency_samples):
                before = time.monotonic_ns()
                task = await client.enqueue("e2e.noop", payload, queue="bench")
                sent[task.id] = before
                await asyncio.sleep(1 / args.latency_rate)  # the light load's pacing
            await wait_until(
                lambda: tail.count("start") >= len(sent),
                within=60,
                interval=POLL_INTERVAL,
                message="latency tasks",
            )
        if scraper is not None:
            await scraper.stop()
        starts = {f[1]: int(f[5]) for f in tail.lines["start"]}
        latencies = [(starts[i] - t) / 1e6 for i, t in sent.items() if i in starts]
        result = {
            "encryption": encrypted,
            "metrics": metrics or "unserved",
            "scrapes": scraper.scrapes if scraper is not None else 0,
            "scraped_bytes": scraper.bytes if scraper is not None else 0,
            "payload_bytes": args.payload_bytes,
            "tasks": args.tasks,
            "retained": args.retained,
            "queues": args.queues,
            "workers": args.workers,
            "concurrency": args.concurrency,
            "enqueue_per_s": round(args.tasks / (t_enqueued - t0)),
            "drained_per_s": round(args.tasks / (t_drained - t0)),
            "drain_seconds": round(t_drained - t0, 3),
            # Completed before the last enqueue returned, and the rate of the rest.
            "done_while_enqueuing": done_at_enqueued,
            "drain_only_per_s": round((args.tasks - done_at_enqueued) / (t_drained - t_enqueued)),
            # CPU microseconds per task during the burst, by process role.
            "cpu_us_per_task": {
                role: round((cpu1[role] - cpu0.get(role, 0.0)) / args.tasks * 1e6) for role in cpu1
            },
            # CPU the rest of the machine spent meanwhile (other work slows a run down).
            "others_cpu_s": round(
                max(0.0, (busy1 - busy0) - sum(cpu1[r] - cpu0.get(r, 0.0) for r in cpu1)), 2
            ),
            "latency_ms": {
                "samples": len(latencies),
                "p50": round(percentile(latencies, 50), 2),
                "p95": round(percentile(latencies, 95), 2),
                "p99": round(percentile(latencies, 99), 2),
                "mean": round(statistics.fmean(latencies), 2),
            },
        }
        return result
    finally:
        if scraper is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await scraper.stop()
        cluster.stop_all()
        nats.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        conn = await asyncpg.connect(admin)
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.close()


def summary(result: dict[str, Any]) -> str:
    """One run's figures, as printed."""
    lat = result["latency_ms"]
    return (
        f"e2e: {result['tasks']} no-op tasks, {result['workers']} workers x {result['concurrency']}"
        f", {result['queues']} queue(s), {result['retained']} completed tasks retained before, "
        f"encryption {'on' if result['encryption'] else 'off'}, metrics {result['metrics']}"
        + (f" ({result['scrapes']} scrapes)" if result["scrapes"] else "")
        + "\n"
        f"  enqueue  {result['enqueue_per_s']:>8} tasks/s\n"
        f"  drained  {result['drained_per_s']:>8} tasks/s end to end ({result['drain_seconds']} s); "
        f"{result['done_while_enqueuing']} done while enqueuing, then "
        f"{result['drain_only_per_s']} tasks/s\n"
        f"  latency  p50 {lat['p50']} ms  p95 {lat['p95']} ms  p99 {lat['p99']} ms  ({lat['samples']} samples)\n"
        "  CPU per task during the burst (us): "
        + ", ".join(f"{role} {us}" for role, us in result["cpu_us_per_task"].items())
        + f", total {sum(result['cpu_us_per_task'].values())}"
        + f"\n  others on the machine meanwhile: {result['others_cpu_s']} CPU s"
    )


def compare(
    runs: list[dict[str, Any]], field: str = "encryption", off: Any = False, on: Any = True
) -> dict[str, Any]:
    """The medians of the runs whose ``field`` is ``off`` and of those where it is ``on``
    (encryption by default), and their difference."""
    medians: dict[str, dict[str, float]] = {}
    for mode, setting in (("off", off), ("on", on)):
        mine = [r for r in runs if r[field] == setting]
        medians[mode] = {
            "runs": len(mine),
            "enqueue_per_s": statistics.median(r["enqueue_per_s"] for r in mine),
            "drained_per_s": statistics.median(r["drained_per_s"] for r in mine),
            "p50_ms": round(statistics.median(r["latency_ms"]["p50"] for r in mine), 2),
            "p99_ms": round(statistics.median(r["latency_ms"]["p99"] for r in mine), 2),
            "cpu_us_per_task": statistics.median(sum(r["cpu_us_per_task"].values()) for r in mine),
        }
    off, on = medians["off"], medians["on"]
    return {
        **medians,
        "drained_change_pct": round(100 * (on["drained_per_s"] / off["drained_per_s"] - 1), 1),
        "enqueue_change_pct": round(100 * (on["enqueue_per_s"] / off["enqueue_per_s"] - 1), 1),
        "p50_change_ms": round(on["p50_ms"] - off["p50_ms"], 2),
        "cpu_change_us": round(on["cpu_us_per_task"] - off["cpu_us_per_task"]),
    }


def _separate_mode(args: argparse.Namespace) -> tuple[str, Any, Any] | None:
    """The mode that replaces the burst benchmark, if one was asked for: its results file,
    its coroutine function and its report."""
    if args.fair_slots:
        from bench import fair_bench

        return "fair-slots.json", fair_bench.run_fair_slots, fair_bench.report
    if args.keyed:
        from bench import concurrency_bench

        return "concurrency.json", concurrency_bench.run_concurrency, concurrency_bench.report
    if args.rate_limit:
        from bench import rate_bench

        return "rate-limit.json", rate_bench.run_rate_limit, rate_bench.report
    if args.recovery:
        return "recovery.json", run_recovery, recovery_report
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--queues", type=int, default=1, help="queues the burst is spread over")
    parser.add_argument(
        "--retained", type=int, default=0, help="completed tasks in the table beforehand"
    )
    parser.add_argument("--latency-samples", type=int, default=300)
    parser.add_argument("--latency-rate", type=float, default=50.0, help="tasks/s at light load")
    parser.add_argument(
        "--encryption",
        choices=["off", "on", "both"],
        default="off",
        help="store task values encrypted (on), or compare (both: see --rounds)",
    )
    parser.add_argument(
        "--metrics",
        choices=["off", "on", "both"],
        default=None,
        help="serve every service's metrics and scrape them (on), turn the instrumentation "
        "off (off), or compare (both: see --rounds); unset: counted, not served",
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="with --metrics on or both: seconds between scrapes of every service",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --encryption or --metrics both: pairs of runs; with --recovery, "
        "--rate-limit, --keyed, --fair-slots: rounds",
    )
    parser.add_argument(
        "--payload-bytes", type=int, default=0, help="pad each task's payload to about this"
    )
    parser.add_argument("--admin-dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    many = parser.add_argument_group("many-queues mode")
    many.add_argument(
        "--many-queues",
        type=int,
        default=0,
        metavar="N",
        help="one task into each of N queues no worker serves, beside a busy queue",
    )
    many.add_argument("--busy-rate", type=float, default=500.0, help="busy queue's tasks/s")
    many.add_argument("--window", type=float, default=20.0, help="seconds per measured window")
    many.add_argument(
        "--settle", type=float, default=5.0, help="seconds after the N enqueues before measuring"
    )
    keyed = parser.add_argument_group("concurrency-limit mode")
    keyed.add_argument(
        "--keyed",
        action="store_true",
        help="measure how much a hot key under a concurrency limit slows the others instead",
    )
    keyed.add_argument("--hot", type=int, default=10_000, help="tasks of the hot key")
    keyed.add_argument("--keys", type=int, default=100, help="other keys")
    keyed.add_argument("--per-key-tasks", type=int, default=40, help="tasks per other key")
    rated = parser.add_argument_group("rate-limit mode")
    rated.add_argument(
        "--rate-limit", action="store_true", help="measure a rate limit's accuracy instead"
    )
    rated.add_argument("--rate", type=float, default=50.0, help="the limit, tasks/s")
    rated.add_argument("--burst", type=int, default=5)
    rated.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    rated.add_argument("--kill", action="store_true", help="kill -9 the owner halfway")
    fair = parser.add_argument_group("fair-slots mode")
    fair.add_argument(
        "--fair-slots",
        action="store_true",
        help="measure how one worker with fewer slots than queues shares them (--concurrency"
        " defaults to 2 here)",
    )
    fair.add_argument("--fair-tasks", type=int, default=10_000, help="completions counted")
    parser.add_argument(
        "--recovery",
        action="store_true",
        help="measure recovery after kill -9 of the owning dispatcher and of an api instead",
    )
    args = parser.parse_args()
    if args.many_queues:
        from bench import many_queues

        found = uvloop.run(many_queues.run_many_queues(args))
        many_queues.write(found)
        print(many_queues.report(found))
        return
    mode = _separate_mode(args)
    if mode is not None:
        name, result_of, report_of = mode
        separate = uvloop.run(result_of(args))
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / name).write_text(json.dumps(separate, indent=2) + "\n")
        print(report_of(separate))
        return
    # The producer runs on uvloop, as the services and the SDK's Worker do. On the default
    # asyncio loop, grpc's asyncio client costs about 1 ms more per call here (measured:
    # light-load p50 5.2-5.7 ms instead of 4.1-4.6 ms).
    RESULTS.mkdir(exist_ok=True)
    if args.metrics == "both":
        compare_metrics(args)
        return
    if args.encryption != "both":
        result = uvloop.run(run(args, encrypted=args.encryption == "on", metrics=args.metrics))
        (RESULTS / "e2e.json").write_text(json.dumps(result, indent=2) + "\n")
        print(summary(result))
        return
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        # Alternate which goes first, so that a slow spell of the machine is shared.
        for encrypted in (False, True) if round_ % 2 == 0 else (True, False):
            runs.append(uvloop.run(run(args, encrypted=encrypted, metrics=args.metrics)))
            print(summary(runs[-1]), flush=True)
    compared = compare(runs)
    (RESULTS / "e2e-encryption.json").write_text(
        json.dumps({"runs": runs, "compared": compared}, indent=2) + "\n"
    )
    print(medians_report("encryption", compared))


def compare_metrics(args: argparse.Namespace) -> None:
    """``--metrics both``: ``--rounds`` pairs of runs with the metrics off and on, which
    goes first alternating; prints and writes bench/results/e2e-metrics.json."""
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for metrics in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            runs.append(uvloop.run(run(args, encrypted=args.encryption == "on", metrics=metrics)))
            print(summary(runs[-1]), flush=True)
    compared = compare(runs, "metrics", "off", "on")
    (RESULTS / "e2e-metrics.json").write_text(
        json.dumps({"runs": runs, "compared": compared}, indent=2) + "\n"
    )
    print(medians_report("metrics", compared))


def medians_report(what: str, compared: dict[str, Any]) -> str:
    """The medians of a comparison (:func:`compare`), as printed."""
    off, on = compared["off"], compared["on"]
    return (
        f"{what}, medians of {off['runs']} runs each (off -> on):\n"
        f"  drained  {off['drained_per_s']:.0f} -> {on['drained_per_s']:.0f} tasks/s "
        f"({compared['drained_change_pct']:+}%)\n"
        f"  enqueue  {off['enqueue_per_s']:.0f} -> {on['enqueue_per_s']:.0f} tasks/s "
        f"({compared['enqueue_change_pct']:+}%)\n"
        f"  p50      {off['p50_ms']} -> {on['p50_ms']} ms ({compared['p50_change_ms']:+} ms)\n"
        f"  p99      {off['p99_ms']} -> {on['p99_ms']} ms\n"
        f"  CPU      {off['cpu_us_per_task']:.0f} -> {on['cpu_us_per_task']:.0f} us per task "
        f"({compared['cpu_change_us']:+} us)"
    )


if __name__ == "__main__":
    main()
