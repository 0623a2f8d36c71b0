"""Build-event ingest benchmark: N concurrent Bazel-like streams against one
``conveyor-bep serve`` process over a throwaway database.

    uv run python -m bench.bep_ingest [--streams 1,100,1000] [--tests 50] [--clients 2]
    uv run python -m bench.bep_ingest --streams 100 --rate 50    # paced: 5,000 events/s

Each stream replays a synthetic small build (``conveyor_testkit.bep.sample_stream``:
command lines, options, metadata, progress, per test target a configured, result,
completed and summary event; ``--tests`` sets how many) as fast as the ingest acks it,
or, with ``--rate``, at that many events/s per stream (builds running side by side, as
real Bazels stream: the ack latency then says what a build sees at that load).
``--clients`` processes share the streams (the load generator's own CPU would otherwise
cap the figure). Reports per level: events/s ingested (first send to last ack), ack
latency p50/p99 (an event's send to its ack), bytes stored per build (row bytes of the ``bep`` tables, and their
on-disk size with indexes, over the builds), and the ingest process's and Postgres' CPU per event (from /proc).
Writes bench/results/bep_ingest.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg

ADMIN_DSN = os.environ.get("CONVEYOR_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
RESULTS = Path(__file__).resolve().parent / "results"
_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _postgres_cpu() -> float:
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"postgres" in (entry / "cmdline").read_bytes()[:200]:
                total += _cpu_seconds(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return total


async def _client(port: int, key: str, ids: list[str], tests: int, rate: float) -> dict[str, Any]:
    import grpc
    from conveyor_bep.bazel.google.devtools.build.v1 import publish_build_event_pb2_grpc
    from conveyor_testkit.bep import sample_stream

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = publish_build_event_pb2_grpc.PublishBuildEventStub(channel)  # type: ignore[no-untyped-call]
    latencies: list[float] = []
    events = 0
    failures = 0

    async def one(index: int, invocation_id: str) -> None:
        nonlocal events, failures
        requests = sample_stream(invocation_id, tests=tests)
        sent: dict[int, float] = {}

        async def source() -> Any:
            # Paced (--rate): event i of a stream leaves at its start + i / rate, the
            # streams' starts spread over one interval, as builds that run side by side.
            begin = time.monotonic() + (index / max(1, len(ids))) / rate if rate else 0.0
            for i, item in enumerate(requests):
                if rate:
                    delay = begin + i / rate - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                sent[item.ordered_build_event.sequence_number] = time.monotonic()
                yield item

        call = stub.PublishBuildToolEventStream(source(), metadata=(("x-api-key", key),))
        try:
            async for response in call:
                latencies.append(time.monotonic() - sent[response.sequence_number])
                events += 1
        except grpc.aio.AioRpcError:
            failures += 1

    started = time.monotonic()
    await asyncio.gather(*(one(n, i) for n, i in enumerate(ids)))
    ended = time.monotonic()
    await channel.close()
    return {
        "latencies": latencies,
        "events": events,
        "failures": failures,
        "started": started,
        "ended": ended,
    }


def _client_process(port: int, key: str, ids: list[str], tests: int, rate: float, out: Any) -> None:
    import uvloop

    out.put(uvloop.run(_client(port, key, ids, tests, rate)))


async def _size_per_build(dsn: str, builds: int) -> tuple[float, float]:
    """(row bytes per build, on-disk bytes per build with indexes and free space)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("VACUUM ANALYZE")
        total = await conn.fetchval(
            "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c JOIN pg_namespace n"
            " ON n.oid = c.relnamespace WHERE n.nspname = 'bep' AND c.relkind IN ('r')"
            " AND c.relname NOT IN ('projects', 'api_keys', 'tag_keys')"
        )
        data = await conn.fetchval(
            "SELECT (SELECT coalesce(sum(pg_column_size(i.*)), 0) FROM bep.invocations i)"
            " + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM bep.targets t)"
            " + (SELECT coalesce(sum(pg_column_size(r.*)), 0) FROM bep.test_results r)"
            " + (SELECT coalesce(sum(pg_column_size(s.*)), 0) FROM bep.event_segments s)"
            " + (SELECT coalesce(sum(pg_column_size(l.*)), 0) FROM bep.log_segments l)"
            " + (SELECT coalesce(sum(pg_column_size(m.*)), 0) FROM bep.invocation_metrics m)"
        )
        return float(data) / builds, float(total or 0) / builds
    finally:
        await conn.close()


def _start_ingest(env: dict[str, str]) -> tuple[subprocess.Popen[str], int]:
    """A ``conveyor-bep serve`` process on a free port, and the port."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor_bep", "serve", "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    match = re.search(r":(\d+)$", proc.stdout.readline().strip())
    assert match, "ingest did not start"
    return proc, int(match[1])


async def _level(streams: int, args: argparse.Namespace) -> dict[str, Any]:
    from conveyor_bep.keys import create_key, create_project
    from conveyor_bep.store import BEP_MIGRATIONS

    name = f"conveyor_bench_bep_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(ADMIN_DSN)
    await admin.execute(f'CREATE DATABASE "{name}"')
    dsn = ADMIN_DSN.rsplit("/", 1)[0] + f"/{name}"
    proc = None
    try:
        await BEP_MIGRATIONS.migrate(dsn)
        conn = await asyncpg.connect(dsn)
        await create_project(conn, "bench", max_streams=streams + 10, max_unacked=5000)
        key = (await create_key(conn, "bench")).key
        await conn.close()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
        env.update(CONVEYOR_DSN=dsn, CONVEYOR_BEP_USE_NATS="false", CONVEYOR_LOG_LEVEL="warning")
        proc, port = _start_ingest(env)
        ids = [f"bench-{i}" for i in range(streams)]
        clients = max(1, min(args.clients, streams))
        queue: Any = multiprocessing.get_context("spawn").Queue()
        cpu0, pg0 = _cpu_seconds(proc.pid), _postgres_cpu()
        workers = [
            multiprocessing.get_context("spawn").Process(
                target=_client_process,
                args=(port, key, ids[i::clients], args.tests, args.rate, queue),
            )
            for i in range(clients)
        ]
        for w in workers:
            w.start()
        results = [queue.get() for _ in workers]
        for w in workers:
            w.join()
        cpu1, pg1 = _cpu_seconds(proc.pid), _postgres_cpu()
        events = sum(r["events"] for r in results)
        latencies = sorted(x for r in results for x in r["latencies"])
        elapsed = max(r["ended"] for r in results) - min(r["started"] for r in results)
        size, disk = await _size_per_build(dsn, streams)
        return {
            "streams": streams,
            "offered_per_s": round(args.rate * streams) if args.rate else None,
            "events": events,
            "failures": sum(r["failures"] for r in results),
            "seconds": round(elapsed, 3),
            "events_per_s": round(events / elapsed),
            "ack_p50_ms": round(statistics.median(latencies) * 1000, 1),
            "ack_p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 1),
            "bytes_per_build": round(size),
            "disk_bytes_per_build": round(disk),
            "ingest_cpu_us_per_event": round((cpu1 - cpu0) / events * 1e6, 1),
            "postgres_cpu_us_per_event": round((pg1 - pg0) / events * 1e6, 1),
        }
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
            if proc.stdout:
                proc.stdout.close()
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def _main(args: argparse.Namespace) -> None:
    rows = []
    for streams in (int(s) for s in args.streams.split(",")):
        row = await _level(streams, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(
        "| streams | offered/s | events/s | ack p50 ms | ack p99 ms | bytes/build "
        "| ingest µs/event | postgres µs/event |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['streams']} | {r['offered_per_s'] or 'max'} | {r['events_per_s']} "
            f"| {r['ack_p50_ms']} | {r['ack_p99_ms']} "
            f"| {r['bytes_per_build']} | {r['ingest_cpu_us_per_event']} "
            f"| {r['postgres_cpu_us_per_event']} |"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bep_ingest.json").write_text(json.dumps(rows, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="1,100,1000", help="comma-separated levels")
    parser.add_argument("--tests", type=int, default=50, help="test targets per build")
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="events/s each stream sends (0: as fast as flow control lets it)",
    )
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
