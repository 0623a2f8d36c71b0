"""Rate-limit accuracy (``python -m bench.e2e_bench --rate-limit [--rate 50] [--burst 5]
[--seconds 60] [--rounds 1]``), measured through real processes.

Each round runs the scenario of tests/e2e/rates.py on fresh services (two api
processes, two dispatchers, two SDK workers with 64 slots each, a private nats-server
and a throwaway database): a queue limited to ``--rate`` a second with ``--burst``,
``--seconds`` worth of no-op tasks and 10% more enqueued at once. Reported: the starts
(leases) within the first ``--seconds`` against rate x seconds (+ the burst the bucket
starts with), and the busiest one-second window against rate + burst. ``--kill`` kills
the owning dispatcher (kill -9) halfway through.

Prints a summary and writes bench/results/rate-limit.json.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

from bench.scratch import scratch_services
from tests.e2e.harness import Cluster
from tests.e2e.rates import rate_run


async def run_rate_limit(args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` runs; each one's figures."""
    window = timedelta(seconds=args.seconds)
    tasks = int(args.rate * args.seconds * 1.1) + args.burst
    runs: list[dict[str, Any]] = []
    async with scratch_services(args.admin_dsn, "rate") as scratch:
        for n in range(args.rounds):
            folder = scratch.workdir / f"round-{n}"
            folder.mkdir()
            cluster = Cluster(dsn=scratch.dsn, nats_url=scratch.nats.url, workdir=folder)
            try:
                run = await rate_run(
                    cluster,
                    folder,
                    queue=f"rated{n}",
                    rate=args.rate,
                    burst=args.burst,
                    tasks=tasks,
                    kill_at=tasks // 2 if args.kill else None,
                )
            finally:
                cluster.stop_all()
            expected = args.rate * args.seconds
            started = run.in_first(window)
            runs.append(
                {
                    "starts_in_window": started,
                    "expected": expected,
                    "deviation_pct": round((started / expected - 1) * 100, 2),
                    "busiest_second": run.busiest(),
                    "allowed_per_second": args.rate + args.burst,
                }
            )
            print(f"  round {n + 1}: {_line(runs[-1], args)}", flush=True)
    return {
        "rate": args.rate,
        "burst": args.burst,
        "seconds": args.seconds,
        "kill": args.kill,
        "runs": runs,
    }


def _line(run: dict[str, Any], args: argparse.Namespace) -> str:
    return (
        f"{run['starts_in_window']} starts in {args.seconds:g} s against "
        f"{run['expected']:g} ({run['deviation_pct']:+}%), busiest second "
        f"{run['busiest_second']} (at most {run['allowed_per_second']:g})"
    )


def report(result: dict[str, Any]) -> str:
    """The summary printed at the end."""
    args = argparse.Namespace(seconds=result["seconds"])
    head = (
        f"rate limit {result['rate']:g}/s, burst {result['burst']}, "
        f"{'a dispatcher killed halfway, ' if result['kill'] else ''}"
        f"{len(result['runs'])} run(s):"
    )
    return "\n".join([head, *(f"  {_line(run, args)}" for run in result["runs"])])
