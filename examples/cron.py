"""Quickstart cron: declares two cron entries on the server and lists them.

uv run python examples/cron.py    # against `conveyor dev` on 127.0.0.1:50051

Applying is idempotent: run it again (an application would at every start) and the
entries keep their next runs. The server fires them from then on, whether or not this
program runs; `conveyor cron list` shows them, and examples/worker.py runs their tasks.
"""

from __future__ import annotations

import os

from conveyor import AdminClient, cron

ENTRIES = [
    # Every 10 seconds, for the demo: watch examples/worker.py build these reports.
    cron(
        "demo-report", "@every 10s", "report.build", {"name": "demo", "pages": 1}, queue="reports"
    ),
    # Mondays at 09:00 in Paris, daylight saving time included.
    cron(
        "weekly-report",
        "0 9 * * MON",
        "report.build",
        {"name": "weekly", "pages": 3},
        queue="reports",
        timezone="Europe/Paris",
    ),
]


def main() -> None:
    with AdminClient(os.environ.get("CONVEYOR_TARGET", "127.0.0.1:50051")) as admin:
        for entry in admin.apply_cron_entries(ENTRIES):
            print(
                f"{entry.name:<14} {entry.schedule:<12} {entry.timezone:<13} next {entry.next_run_at}"
            )


if __name__ == "__main__":
    main()
