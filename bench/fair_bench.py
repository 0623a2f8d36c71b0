"""Fair slots (``python -m bench.e2e_bench --fair-slots [--fair-tasks 10000]
[--concurrency 2] [--rounds 1]``), measured through real processes.

Each round runs the scenario of tests/e2e/fairness.py on fresh services (an api, a
dispatcher, maintenance and one SDK worker of ``--concurrency`` slots, 2 unless given, a
private nats-server and a throwaway database) over 10 busy queues of weights
1, 1, 1, 1, 1, 1, 1, 2, 3, 4: how many of the first ``--fair-tasks`` completions each
queue had, against its share by weight.

Prints a summary and writes bench/results/fair-slots.json.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.scratch import scratch_services
from tests.e2e.fairness import fair_run
from tests.e2e.harness import Cluster

#: The queues and their weights.
WEIGHTS = {f"q{n}": w for n, w in enumerate([1, 1, 1, 1, 1, 1, 1, 2, 3, 4])}


async def run_fair_slots(args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` runs; each one's figures."""
    concurrency = args.concurrency if args.concurrency != 64 else 2
    runs: list[dict[str, Any]] = []
    async with scratch_services(args.admin_dsn, "fair") as scratch:
        for n in range(args.rounds):
            folder = scratch.workdir / f"round-{n}"
            folder.mkdir()
            cluster = Cluster(dsn=scratch.dsn, nats_url=scratch.nats.url, workdir=folder)
            try:
                run = await fair_run(
                    cluster,
                    weights=WEIGHTS,
                    concurrency=concurrency,
                    count=args.fair_tasks,
                    prefix=f"fair{n}",
                )
            finally:
                cluster.stop_all()
            runs.append(
                {
                    "done": dict(run.done),
                    "ratio_to_fair": {q: round(run.ratio(q), 3) for q in WEIGHTS},
                    "worst_deviation_pct": round(run.worst() * 100, 1),
                    "tasks_per_second": round(run.count / run.seconds, 1),
                }
            )
            print(f"  round {n + 1}: {_line(runs[-1])}", flush=True)
    return {
        "weights": WEIGHTS,
        "concurrency": concurrency,
        "tasks": args.fair_tasks,
        "runs": runs,
    }


def _line(run: dict[str, Any]) -> str:
    shares = " ".join(f"{q}={run['done'].get(q, 0)}" for q in WEIGHTS)
    return (
        f"{shares}; worst queue {run['worst_deviation_pct']}% off its share, "
        f"{run['tasks_per_second']} tasks/s"
    )


def report(result: dict[str, Any]) -> str:
    """The summary printed at the end."""
    weights = " ".join(f"{q}:{w}" for q, w in result["weights"].items())
    head = (
        f"fair slots: one worker of {result['concurrency']} slots over 10 busy queues "
        f"(weights {weights}), the first {result['tasks']} completions, "
        f"{len(result['runs'])} round(s):"
    )
    return "\n".join([head, *(f"  {_line(run)}" for run in result["runs"])])
