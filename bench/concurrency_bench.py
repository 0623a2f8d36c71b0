"""A hot key must not slow the other keys (``python -m bench.e2e_bench --keyed
[--hot 10000] [--keys 100] [--per-key-tasks 40] [--rounds 1]``), measured through real
processes.

Each round runs two scenarios on fresh services (an api, a dispatcher, maintenance and
two SDK workers with 32 slots each, on a private nats-server and a throwaway database),
in a queue whose keys are limited to 2 at once and whose ``hot`` key is limited to 1:

- ``alone``: ``--keys`` x ``--per-key-tasks`` no-op tasks over that many keys;
- ``behind a hot key``: ``--hot`` tasks of the hot key first, then the same tasks.

Reported for each: how fast the other keys' tasks ran (their count over the time from
the first one's start to the last one's end) and, behind the hot key, how many of its
tasks had run by then. No head-of-line blocking means the two rates are about equal.

Prints a summary and writes bench/results/concurrency.json.
"""

from __future__ import annotations

import argparse
from typing import Any

import asyncpg
from conveyor import AsyncAdminClient, AsyncClient, spec
from conveyor_testkit.polling import wait_until

from bench.scratch import scratch_services
from tests.e2e.harness import POLL_INTERVAL, Cluster

HOT = "hot"
_COLD_DONE = """
SELECT count(*) FILTER (WHERE state = 'completed') AS done,
       min(started_at) AS first, max(completed_at) AS last
FROM conveyor_tasks WHERE queue = $1 AND concurrency_key <> $2
"""
_HOT_DONE = """
SELECT count(*) FROM conveyor_tasks
WHERE queue = $1 AND concurrency_key = $2 AND state = 'completed'
"""


async def _scenario(cluster: Cluster, queue: str, hot: int, keys: int, each: int) -> dict[str, Any]:
    api = await cluster.start_api()
    cluster.start_dispatcher()
    cluster.start_maintenance()
    target = f"127.0.0.1:{api.port}"
    for n in range(2):
        cluster.start_worker(
            target, queues={queue: 1}, concurrency=32, record=cluster.workdir / f"runs{n}"
        )
    async with AsyncAdminClient(target) as admin:
        await admin.set_concurrency_limit(queue, 2)
        await admin.set_concurrency_limit(queue, 1, pattern=HOT)
    cold = keys * each
    async with AsyncClient(target) as client:
        for start in range(0, hot, 1000):
            batch = [
                spec("e2e.noop", {}, queue=queue, concurrency_key=HOT)
                for _ in range(start, min(start + 1000, hot))
            ]
            await client.enqueue_batch(batch)
        tasks = [
            spec("e2e.noop", {}, queue=queue, concurrency_key=f"key-{i % keys}")
            for i in range(cold)
        ]
        for start in range(0, cold, 1000):
            await client.enqueue_batch(tasks[start : start + 1000])
    conn = await asyncpg.connect(cluster.dsn)
    try:

        async def cold_done() -> bool:
            row = await conn.fetchrow(_COLD_DONE, queue, HOT)
            return bool(row is not None and row["done"] == cold)

        await wait_until(cold_done, within=600, interval=POLL_INTERVAL, message="cold keys done")
        row = await conn.fetchrow(_COLD_DONE, queue, HOT)
        hot_done = await conn.fetchval(_HOT_DONE, queue, HOT)
    finally:
        await conn.close()
    assert row is not None
    seconds = (row["last"] - row["first"]).total_seconds()
    return {
        "hot_tasks": hot,
        "cold_tasks": cold,
        "cold_seconds": round(seconds, 3),
        "cold_per_second": round(cold / seconds, 1) if seconds > 0 else None,
        "hot_done_by_then": hot_done,
    }


async def run_concurrency(args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` rounds of both scenarios; each one's figures."""
    rounds: list[dict[str, Any]] = []
    async with scratch_services(args.admin_dsn, "keyed") as scratch:
        for n in range(args.rounds):
            got: dict[str, Any] = {}
            for name, hot in (("alone", 0), ("behind_hot_key", args.hot)):
                folder = scratch.workdir / f"round-{n}-{name}"
                folder.mkdir()
                cluster = Cluster(dsn=scratch.dsn, nats_url=scratch.nats.url, workdir=folder)
                try:
                    got[name] = await _scenario(
                        cluster, f"keyed-{n}-{name}", hot, args.keys, args.per_key_tasks
                    )
                finally:
                    cluster.stop_all()
            rounds.append(got)
            print(f"  round {n + 1}: {_line(got)}", flush=True)
    return {
        "hot": args.hot,
        "keys": args.keys,
        "per_key_tasks": args.per_key_tasks,
        "rounds": rounds,
    }


def _line(got: dict[str, Any]) -> str:
    alone, behind = got["alone"], got["behind_hot_key"]
    return (
        f"other keys {alone['cold_per_second']} tasks/s alone, "
        f"{behind['cold_per_second']} tasks/s behind {behind['hot_tasks']} tasks of a hot key "
        f"(which had run {behind['hot_done_by_then']} of them by then)"
    )


def report(result: dict[str, Any]) -> str:
    """The summary printed at the end."""
    head = (
        f"concurrency limits: {result['keys']} keys x {result['per_key_tasks']} tasks "
        f"(2 at once per key), a hot key of {result['hot']} (1 at once), "
        f"{len(result['rounds'])} round(s):"
    )
    return "\n".join([head, *(f"  {_line(got)}" for got in result["rounds"])])
