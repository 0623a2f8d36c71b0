"""The many-queues mode of the end-to-end benchmark (``--many-queues N``).

    uv run python -m bench.e2e_bench --many-queues 10000 [--busy-rate 500] [--window 20]

What a cluster costs when N queues hold due work that no worker serves, and what that does
to a busy queue beside them. Starts the same processes as the default mode (a private
nats-server with its monitoring port, a throwaway database, one api, one dispatcher, one
maintenance process) and one SDK worker that serves only the queue ``busy``; then

1. alone: the producer enqueues into ``busy`` at ``--busy-rate`` tasks/s for ``--window``
   seconds, one task per call, each timed from just before its Enqueue to its handler's
   start (both ends read CLOCK_MONOTONIC);
2. enqueues one task into each of N queues (``mq00000``...; batches of 1,000), which no
   worker serves, and waits ``--settle`` seconds;
3. idle: measures a window with nothing else running (the cost of the N queues alone);
4. beside: the busy load of step 1 again, beside the N queues;
5. late: after the dispatcher's idle timeout has passed since step 2, one more quiet
   window (whatever is claimed by then stays claimed).

For each window it reports the NATS messages per second (nats-server's ``/varz``: messages
in, and out to subscribers), the JetStream operations per second (``/jsz``: API requests,
plus writes to the ownership and leader buckets, read from their streams' sequence
numbers), the CPU each service spent (share of one core, from /proc), the queues with an
ownership key at its end, and, for the busy windows, the enqueue -> start latency p50,
p99 and max of ``busy``. Prints a summary and writes ``bench/results/many_queues.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import nats
from conveyor import AsyncClient, spec
from conveyor_broker.postgres import migrate
from conveyor_runtime.embedded_nats import EmbeddedNats, free_port
from conveyor_testkit.polling import wait_until

from bench.e2e_bench import RESULTS, RecordTail, cpu_seconds, percentile, postgres_backends
from tests.e2e.harness import POLL_INTERVAL, Cluster

BUSY = "busy"
#: The buckets whose writes count as JetStream operations (default subject prefix).
BUCKETS = ("KV_conveyor_owners", "KV_conveyor_leaders")


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as response:  # a loopback monitoring port
        data: dict[str, Any] = json.load(response)
        return data


class NatsCounters:
    """Counters of a nats-server, read from its monitoring port."""

    def __init__(self, port: int) -> None:
        self._base = f"http://127.0.0.1:{port}"

    def read(self) -> dict[str, int]:
        """Messages in and out, JetStream API requests, and each bucket's last sequence."""
        varz = _get(f"{self._base}/varz")
        jsz = _get(f"{self._base}/jsz?accounts=true&streams=true")
        counters = {
            "in_msgs": int(varz["in_msgs"]),
            "out_msgs": int(varz["out_msgs"]),
            "js_api": int(jsz.get("api", {}).get("total", 0)),
        }
        for account in jsz.get("account_details", []):
            for stream in account.get("stream_detail", []):
                if stream["name"] in BUCKETS:
                    counters[stream["name"]] = int(stream["state"]["last_seq"])
        return counters


class Window:
    """What one measured window cost: NATS and JetStream traffic, and CPU by service."""

    def __init__(self, cluster: Cluster, counters: NatsCounters, dbname: str) -> None:
        self._cluster = cluster
        self._counters = counters
        self._dbname = dbname

    def _cpu(self) -> dict[str, float]:
        cpu: dict[str, float] = {}
        for proc in self._cluster.procs:
            role = proc.name.rstrip("0123456789")
            cpu[role] = cpu.get(role, 0.0) + cpu_seconds(proc.pid)
        cpu["postgres"] = sum(cpu_seconds(pid) for pid in postgres_backends(self._dbname))
        cpu["bench client"] = time.process_time()
        return cpu

    def begin(self) -> None:
        self._t0 = time.monotonic()
        self._n0 = self._counters.read()
        self._cpu0 = self._cpu()

    def end(self) -> dict[str, Any]:
        seconds = time.monotonic() - self._t0
        n1 = self._counters.read()
        cpu1 = self._cpu()
        n0 = self._n0

        def rate(key: str) -> float:
            return round((n1.get(key, 0) - n0.get(key, 0)) / seconds, 1)

        kv_writes = sum(n1.get(b, 0) - n0.get(b, 0) for b in BUCKETS)
        return {
            "seconds": round(seconds, 1),
            "nats_in_per_s": rate("in_msgs"),
            "nats_out_per_s": rate("out_msgs"),
            "js_api_per_s": rate("js_api"),
            "kv_writes_per_s": round(kv_writes / seconds, 1),
            "js_ops_per_s": round(rate("js_api") + kv_writes / seconds, 1),
            "cpu_core_share": {
                role: round((cpu1[role] - self._cpu0.get(role, 0.0)) / seconds, 3) for role in cpu1
            },
        }


async def owned_queues(nats_url: str) -> int:
    """Queues with an ownership key right now (the owners bucket's live keys)."""
    nc = await nats.connect(nats_url, name="bench-owners")
    try:
        kv = await nc.jetstream().key_value("conveyor_owners")
        try:
            return len(await kv.keys())
        except nats.js.errors.NoKeysError:
            return 0
    finally:
        await nc.close()


async def busy_load(
    client: AsyncClient, tail: RecordTail, rate: float, seconds: float
) -> dict[str, Any]:
    """Enqueue into ``busy`` at ``rate`` tasks/s for ``seconds``, one task per call (each
    call in flight on its own, so a slow one does not hold the next back); the
    enqueue -> start latencies once every task started."""
    tail.reset()
    sent: dict[str, int] = {}
    errors: Counter[str] = Counter()

    async def one() -> None:
        before = time.monotonic_ns()
        try:
            task = await client.enqueue("e2e.noop", {}, queue=BUSY)
        except Exception as exc:
            errors[getattr(exc, "code", None) or type(exc).__name__] += 1
            return
        sent[task.id] = before

    calls: set[asyncio.Task[None]] = set()
    interval = 1 / rate
    began = time.monotonic()
    for n in range(round(rate * seconds)):
        call = asyncio.create_task(one())
        calls.add(call)
        call.add_done_callback(calls.discard)
        # The load's pacing: the n+1-th call goes out at its own moment.
        await asyncio.sleep(max(0.0, began + (n + 1) * interval - time.monotonic()))
    await asyncio.gather(*calls)
    # Reported, not raised: a stall this long is a finding (the tasks left out are counted).
    with contextlib.suppress(TimeoutError):
        await wait_until(
            lambda: tail.count("start") >= len(sent),
            within=120,
            interval=POLL_INTERVAL,
            message="busy tasks started",
        )
    starts = {f[1]: int(f[5]) for f in tail.lines["start"]}
    latencies = [(starts[i] - t) / 1e6 for i, t in sent.items() if i in starts] or [0.0]
    return {
        "tasks": len(sent),
        "not_started_in_120s": sum(1 for i in sent if i not in starts),
        "enqueue_errors": dict(errors),
        "p50_ms": round(percentile(latencies, 50), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "max_ms": round(max(latencies), 2),
        "mean_ms": round(statistics.fmean(latencies), 2),
    }


async def measured(
    cluster: Cluster,
    counters: NatsCounters,
    nats_url: str,
    dbname: str,
    busy: tuple[AsyncClient, RecordTail, float] | None,
    seconds: float,
) -> dict[str, Any]:
    """One window: the busy load (or ``seconds`` of quiet) and what it cost."""
    window = Window(cluster, counters, dbname)
    window.begin()
    latency = None
    if busy is not None:
        latency = await busy_load(*busy, seconds=seconds)
    else:
        await asyncio.sleep(seconds)  # a quiet window is measured over time itself
    result = window.end()
    result["owned_queues"] = await owned_queues(nats_url)
    if latency is not None:
        result["busy"] = latency
    return result


async def run_many_queues(args: argparse.Namespace) -> dict[str, Any]:
    admin = args.admin_dsn
    name = f"conveyor_bench_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(admin)
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()
    dsn = admin.rpartition("/")[0] + f"/{name}"
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    monitor = free_port()
    server = EmbeddedNats(config=f'http: "127.0.0.1:{monitor}"')
    server.start()
    counters = NatsCounters(monitor)
    cluster = Cluster(dsn=dsn, nats_url=server.url, workdir=workdir)
    cluster.settings_env["CONVEYOR_LOG_LEVEL"] = "warning"
    idle_timeout = 30.0  # the dispatcher's default CONVEYOR_IDLE_TIMEOUT
    try:
        await migrate(dsn)
        target = await cluster.start_services()
        record = workdir / "record.txt"
        tail = RecordTail(record)
        cluster.start_worker(target, queues={BUSY: 1}, concurrency=args.concurrency, record=record)
        async with AsyncClient(target) as client:
            await client.enqueue("e2e.noop", {}, queue=BUSY)
            await wait_until(
                lambda: tail.count("done") >= 1,
                within=60,
                interval=POLL_INTERVAL,
                message="warm-up task",
            )
            busy = (client, tail, args.busy_rate)
            alone = await measured(cluster, counters, server.url, name, busy, args.window)

            names = [f"mq{n:05d}" for n in range(args.many_queues)]
            t0 = time.monotonic()
            for start in range(0, len(names), 1000):
                await client.enqueue_batch(
                    [spec("e2e.noop", {}, queue=q) for q in names[start : start + 1000]]
                )
            enqueued_at = time.monotonic()
            await asyncio.sleep(args.settle)  # the settling time the mode promises
            idle = await measured(cluster, counters, server.url, name, None, args.window)
            beside = await measured(cluster, counters, server.url, name, busy, args.window)
            # Past the idle timeout since the enqueue: what has not let go by now never will.
            rest = enqueued_at + idle_timeout + args.settle - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)
            late = await measured(cluster, counters, server.url, name, None, args.window)
        return {
            "many_queues": args.many_queues,
            "busy_rate": args.busy_rate,
            "window_seconds": args.window,
            "enqueue_seconds": round(enqueued_at - t0, 2),
            "alone": alone,
            "idle": idle,
            "beside": beside,
            "late": late,
        }
    finally:
        cluster.stop_all()
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        conn = await asyncpg.connect(admin)
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.close()


def report(result: dict[str, Any]) -> str:
    """The summary printed at the end of a many-queues run."""

    def line(label: str, w: dict[str, Any]) -> str:
        cpu = ", ".join(f"{role} {share:.0%}" for role, share in w["cpu_core_share"].items())
        text = (
            f"  {label:<7} NATS {w['nats_in_per_s']:>8.0f} in/s {w['nats_out_per_s']:>8.0f} out/s"
            f"  JetStream {w['js_ops_per_s']:>7.0f} ops/s ({w['kv_writes_per_s']:.0f} KV writes)"
            f"  owned {w['owned_queues']:>5}\n          CPU (share of a core): {cpu}"
        )
        if "busy" in w:
            b = w["busy"]
            text += (
                f"\n          busy: {b['tasks']} tasks, enqueue -> start p50 {b['p50_ms']} ms"
                f"  p99 {b['p99_ms']} ms  max {b['max_ms']} ms"
            )
            if b["not_started_in_120s"]:
                text += f"  NOT STARTED within 120 s: {b['not_started_in_120s']}"
            if b["enqueue_errors"]:
                text += f"  enqueue errors {b['enqueue_errors']}"
        return text

    return (
        f"many queues: one task in each of {result['many_queues']} queues no worker serves "
        f"(enqueued in {result['enqueue_seconds']} s), a busy queue at "
        f"{result['busy_rate']:.0f} tasks/s, windows of {result['window_seconds']} s\n"
        + "\n".join(
            line(label, result[key])
            for label, key in (
                ("alone", "alone"),
                ("idle", "idle"),
                ("beside", "beside"),
                ("late", "late"),
            )
        )
    )


def write(result: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "many_queues.json").write_text(json.dumps(result, indent=2) + "\n")
