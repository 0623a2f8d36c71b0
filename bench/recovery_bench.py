"""Recovery benchmark (``python -m bench.e2e_bench --recovery [--rounds 3]``): how long
work stands still when a process dies, measured through real processes.

Each round starts fresh services (a private nats-server and a throwaway database shared
by the rounds, a queue of its own per round) and measures, with the scenarios of
tests/e2e/recovery.py:

1. owner kill: a steady stream of no-op tasks (50/s), two dispatchers; the one that owns
   the queue gets ``kill -9``. Reported: the longest gap between two task starts (the
   stall), and from the kill to the first start of a task enqueued after it;
2. owner stop: the same with SIGTERM (a graceful hand-over);
3. api kill: two api processes, a worker on each; ``kill -9`` of the api whose worker
   runs 4 tasks. Reported: from the kill until the other api's worker has started them
   (the reaper found the api dead and released its tasks).

Prints a summary and writes bench/results/recovery.json.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.scratch import scratch_services
from tests.e2e.harness import Cluster
from tests.e2e.recovery import api_release, owner_stall


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "runs": [round(v, 3) for v in values],
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
    }


async def run_recovery(args: argparse.Namespace) -> dict[str, Any]:
    """Every scenario, ``args.rounds`` times; the figures in seconds."""
    figures: dict[str, list[float]] = {
        "owner_kill_stall": [],
        "owner_kill_first_start": [],
        "owner_stop_stall": [],
        "api_kill_first": [],
        "api_kill_all": [],
    }
    async with scratch_services(args.admin_dsn, "recovery") as scratch:
        dsn, nats_url, workdir = scratch.dsn, scratch.nats.url, scratch.workdir
        for n in range(args.rounds):
            for how in ("kill", "term"):
                folder = workdir / f"owner-{how}-{n}"
                folder.mkdir()
                cluster = Cluster(dsn=dsn, nats_url=nats_url, workdir=folder)
                try:
                    stall = await owner_stall(
                        cluster, folder / "record.txt", how=how, queue=f"steady{how}{n}"
                    )
                finally:
                    cluster.stop_all()
                if how == "kill":
                    figures["owner_kill_stall"].append(stall.longest_gap)
                    figures["owner_kill_first_start"].append(stall.first_start_after)
                else:
                    figures["owner_stop_stall"].append(stall.longest_gap)
            folder = workdir / f"api-{n}"
            folder.mkdir()
            cluster = Cluster(dsn=dsn, nats_url=nats_url, workdir=folder)
            try:
                released = await api_release(cluster, folder / "record.txt", queue=f"held{n}")
            finally:
                cluster.stop_all()
            figures["api_kill_first"].append(released.first)
            figures["api_kill_all"].append(released.last)
            print(
                f"  round {n + 1}: owner kill stall {figures['owner_kill_stall'][-1]:.2f} s, "
                f"owner stop stall {figures['owner_stop_stall'][-1]:.2f} s, api kill "
                f"released {released.first:.2f}-{released.last:.2f} s",
                flush=True,
            )
    return {"rounds": args.rounds, **{k: _summary(v) for k, v in figures.items()}}


def report(result: dict[str, Any]) -> str:
    """The summary printed after a run."""

    def line(label: str, key: str) -> str:
        fig = result[key]
        runs = ", ".join(f"{v:.2f}" for v in fig["runs"])
        return f"  {label:<44} median {fig['median']:.2f} s  max {fig['max']:.2f} s  ({runs})"

    return "\n".join(
        [
            f"recovery: {result['rounds']} round(s)",
            line("owner kill -9: longest gap between starts", "owner_kill_stall"),
            line("owner kill -9: first task enqueued after it starts", "owner_kill_first_start"),
            line("owner SIGTERM: longest gap between starts", "owner_stop_stall"),
            line("api kill -9: its first task running again", "api_kill_first"),
            line("api kill -9: all its tasks running again", "api_kill_all"),
        ]
    )
