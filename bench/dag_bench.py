"""Dependency benchmark: how fast a completion reaches the tasks that wait for it, through
Postgres-backed services as processes and SDK workers (no-op tasks).

    uv run python -m bench.dag_bench [--fan 10000] [--chain 1000] [--workers 2]

Starts the same stack as ``bench.e2e_bench`` (a private nats-server, a throwaway
database, one api, one dispatcher, one maintenance process, SDK workers), then runs:

1. fan-in: ``--fan`` parents and one child that waits for all of them. The parents are
   enqueued on a paused queue and the child after them (blocked), then the queue is
   resumed. Reports the time from the last parent's completion (its handler's end) to the
   child's start.
2. fan-out: one parent and ``--fan`` children that wait for it (enqueued while the parent
   waits on a paused queue). Reports the time from the parent's completion to the first
   and the last child's start.
3. chain: ``--chain`` tasks, each waiting for the one before, enqueued in one EnqueueTx.
   Reports the per-link overhead: the time from one link's completion to the next one's
   start (p50, p95, max), and the chain's total time.
4. for scale, the plain dispatch path on the same machine at the same time: the time
   from an enqueue's return to the task's start, one task at a time (no dependencies).

Both ends of every interval are CLOCK_MONOTONIC readings of the worker processes (their
record file), so the figures include the ack's commit, the Resolve, the resolution, the
wake, the lease and the dispatch. Prints a summary and writes bench/results/dag.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import uvloop
from conveyor import AsyncAdminClient, AsyncClient, new_task_id, spec
from conveyor_broker.postgres import migrate
from conveyor_runtime.embedded_nats import EmbeddedNats
from conveyor_testkit.polling import wait_until

from bench.e2e_bench import RESULTS, RecordTail, percentile
from tests.e2e.harness import POLL_INTERVAL, Cluster

BATCH = 1000


def _times(tail: RecordTail, kind: str) -> dict[str, int]:
    """Task id -> the monotonic ns of its ``kind`` line (the last one, if it ran twice)."""
    tail.count(kind)
    return {fields[1]: int(fields[-1]) for fields in tail.lines[kind]}


async def _wait_lines(tail: RecordTail, kind: str, count: int, what: str) -> None:
    await wait_until(lambda: tail.count(kind) >= count, within=900, interval=0.05, message=what)


async def fan_in(
    client: AsyncClient, admin: AsyncAdminClient, tail: RecordTail, n: int
) -> dict[str, Any]:
    await admin.pause_queue("fan-in")
    parents = [new_task_id() for _ in range(n)]
    for start in range(0, n, BATCH):
        await client.enqueue_tx(
            [spec("e2e.noop", {}, queue="fan-in", id=p) for p in parents[start : start + BATCH]]
        )
    t0 = time.perf_counter()
    child = await client.enqueue("e2e.noop", {}, queue="fan-in-child", depends_on=parents)
    enqueue_child_ms = (time.perf_counter() - t0) * 1e3
    tail.reset()
    await admin.resume_queue("fan-in")
    await _wait_lines(tail, "start", n + 1, "fan-in child")
    done, starts = _times(tail, "done"), _times(tail, "start")
    last_parent = max(done[p] for p in parents)
    return {
        "parents": n,
        "enqueue_child_ms": round(enqueue_child_ms, 1),
        "parents_ran_s": round((last_parent - min(starts[p] for p in parents)) / 1e9, 2),
        "child_start_after_last_parent_ms": round((starts[child.id] - last_parent) / 1e6, 2),
    }


async def fan_out(
    client: AsyncClient, admin: AsyncAdminClient, tail: RecordTail, n: int
) -> dict[str, Any]:
    await admin.pause_queue("fan-out")
    parent = await client.enqueue("e2e.noop", {}, queue="fan-out")
    children: list[str] = []
    for start in range(0, n, BATCH):
        made = await client.enqueue_tx(
            [
                spec("e2e.noop", {}, queue="fan-out-children", depends_on=[parent.id])
                for _ in range(min(BATCH, n - start))
            ]
        )
        children += [t.id for t in made]
    tail.reset()
    await admin.resume_queue("fan-out")
    await _wait_lines(tail, "start", n + 1, "fan-out children")
    done, starts = _times(tail, "done"), _times(tail, "start")
    ended = done[parent.id]
    child_starts = sorted(starts[c] for c in children)
    return {
        "children": n,
        "first_child_start_ms": round((child_starts[0] - ended) / 1e6, 2),
        "last_child_start_ms": round((child_starts[-1] - ended) / 1e6, 2),
        "children_started_per_s": round(n / max((child_starts[-1] - ended) / 1e9, 1e-9)),
    }


async def chain(client: AsyncClient, tail: RecordTail, n: int) -> dict[str, Any]:
    links = [new_task_id() for _ in range(n)]
    tail.reset()
    for start in range(0, n, BATCH):
        # A chain longer than a transaction goes in pieces; each piece names the last
        # link of the one before (stored by then).
        await client.enqueue_tx(
            [
                spec(
                    "e2e.noop", {}, queue="chain", id=link, depends_on=links[i - 1 : i] if i else []
                )
                for i, link in enumerate(links[start : start + BATCH], start)
            ]
        )
    await _wait_lines(tail, "start", n, "chain")
    done, starts = _times(tail, "done"), _times(tail, "start")
    gaps = [(starts[links[i]] - done[links[i - 1]]) / 1e6 for i in range(1, n)]
    return {
        "links": n,
        "total_s": round((done[links[-1]] - starts[links[0]]) / 1e9, 2),
        "per_link_ms": {
            "p50": round(percentile(gaps, 50), 2),
            "p95": round(percentile(gaps, 95), 2),
            "max": round(max(gaps), 2),
            "mean": round(statistics.fmean(gaps), 2),
        },
    }


async def dispatch_latency(client: AsyncClient, tail: RecordTail, n: int) -> dict[str, Any]:
    tail.reset()
    sent: dict[str, int] = {}
    for _ in range(n):
        before = time.monotonic_ns()
        task = await client.enqueue("e2e.noop", {}, queue="warm")
        sent[task.id] = before
        await _wait_lines(tail, "start", len(sent), "latency task")
    starts = _times(tail, "start")
    latencies = [(starts[i] - t) / 1e6 for i, t in sent.items()]
    return {
        "samples": n,
        "p50": round(percentile(latencies, 50), 2),
        "p95": round(percentile(latencies, 95), 2),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    admin_dsn = args.admin_dsn
    name = f"conveyor_bench_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(admin_dsn)
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()
    dsn = admin_dsn.rpartition("/")[0] + f"/{name}"
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    nats = EmbeddedNats()
    nats.start()
    cluster = Cluster(dsn=dsn, nats_url=nats.url, workdir=workdir)
    cluster.settings_env["CONVEYOR_LOG_LEVEL"] = "warning"
    try:
        await migrate(dsn)
        target = await cluster.start_services()
        record = workdir / "record.txt"
        tail = RecordTail(record)
        queues = ["warm", "fan-in", "fan-in-child", "fan-out", "fan-out-children", "chain"]
        for _ in range(args.workers):
            cluster.start_worker(
                target, queues=dict.fromkeys(queues, 1), concurrency=args.concurrency, record=record
            )
        async with AsyncClient(target) as client, AsyncAdminClient(target) as admin:
            await client.enqueue("e2e.noop", {}, queue="warm")
            await wait_until(
                lambda: tail.count("done") >= 1, within=60, interval=POLL_INTERVAL, message="warm"
            )
            result: dict[str, Any] = {"workers": args.workers, "concurrency": args.concurrency}
            if "fan-in" in args.only:
                result["fan_in"] = await fan_in(client, admin, tail, args.fan)
            if "fan-out" in args.only:
                result["fan_out"] = await fan_out(client, admin, tail, args.fan)
            if "chain" in args.only:
                result["chain"] = await chain(client, tail, args.chain)
            if "latency" in args.only:
                result["enqueue_to_start_ms"] = await dispatch_latency(
                    client, tail, args.latency_samples
                )
            return result
    finally:
        cluster.stop_all()
        nats.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        conn = await asyncpg.connect(admin_dsn)
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--fan", type=int, default=10_000, help="parents of the fan-in, children of the fan-out"
    )
    parser.add_argument("--chain", type=int, default=1000, help="links of the chain")
    parser.add_argument("--latency-samples", type=int, default=200)
    parser.add_argument(
        "--only",
        type=lambda text: set(text.split(",")),
        default={"fan-in", "fan-out", "chain", "latency"},
        help="scenarios to run, comma-separated (fan-in, fan-out, chain, latency)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--admin-dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    result = uvloop.run(run(args))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dag.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"dag: {result['workers']} workers x {result['concurrency']}"]
    if "fan_in" in result:
        fin = result["fan_in"]
        lines.append(
            f"  fan-in   {fin['parents']} parents -> 1 child: child started "
            f"{fin['child_start_after_last_parent_ms']} ms after the last parent completed "
            f"(parents ran in {fin['parents_ran_s']} s; enqueueing the child took "
            f"{fin['enqueue_child_ms']} ms)"
        )
    if "fan_out" in result:
        fout = result["fan_out"]
        lines.append(
            f"  fan-out  1 parent -> {fout['children']} children: first started "
            f"{fout['first_child_start_ms']} ms, last {fout['last_child_start_ms']} ms after the "
            f"parent completed ({fout['children_started_per_s']} children/s)"
        )
    if "chain" in result:
        ch = result["chain"]
        link = ch["per_link_ms"]
        lines.append(
            f"  chain    {ch['links']} links in {ch['total_s']} s: per link p50 {link['p50']} ms, "
            f"p95 {link['p95']} ms, max {link['max']} ms (mean {link['mean']} ms)"
        )
    if "enqueue_to_start_ms" in result:
        base = result["enqueue_to_start_ms"]
        lines.append(
            f"  no deps  enqueue -> start p50 {base['p50']} ms, p95 {base['p95']} ms "
            f"({base['samples']} tasks, one at a time: the dispatch path alone, for scale)"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
