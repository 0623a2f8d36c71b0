"""The build-event ingest's nightly CAS prune as a Conveyor cron task.

    uv run python examples/bep_prune.py apply     # declare the cron entry (idempotent)
    uv run python examples/bep_prune.py worker    # run the task when it fires

The worker runs ``conveyor-bep prune`` with its own environment (``CONVEYOR_DSN``,
``CONVEYOR_BEP_BLOB_ROOT``, the same settings as ``conveyor-bep serve``): it deletes CAS
uploads no build pinned within their TTL and blobs whose builds retention has deleted.
Each upkeep pass of ``conveyor-bep serve`` does the same; the cron entry keeps it going
on a schedule of its own (03:00 UTC) and off the serving nodes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from conveyor import AdminClient, TaskContext, Worker, cron

TARGET = os.environ.get("CONVEYOR_TARGET", "127.0.0.1:50051")
ENTRY = cron("bep-prune", "0 3 * * *", "bep.prune", {}, queue="maintenance")


def apply() -> None:
    with AdminClient(TARGET) as admin:
        for entry in admin.apply_cron_entries([ENTRY]):
            print(f"{entry.name} {entry.schedule} next {entry.next_run_at}")


worker = Worker(TARGET, queues={"maintenance": 1}, concurrency=1)


@worker.task("bep.prune")
def prune(payload: dict[str, Any], ctx: TaskContext) -> str:
    """Run the prune once; its summary line is the task's result."""
    done = subprocess.run(
        ["conveyor-bep", "prune"], capture_output=True, text=True, timeout=3600, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"conveyor-bep prune exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout.strip()


if __name__ == "__main__":
    if sys.argv[1:] == ["apply"]:
        apply()
    elif sys.argv[1:] == ["worker"]:
        worker.run_forever()
    else:
        sys.exit(__doc__)
