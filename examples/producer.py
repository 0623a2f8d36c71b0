"""Quickstart producer: enqueues a few tasks and waits until they are done.

uv run python examples/producer.py    # against `conveyor dev` on 127.0.0.1:50051
"""

from __future__ import annotations

import os
import sys
import time

from conveyor import Client, TaskState, spec

TERMINAL = {TaskState.COMPLETED, TaskState.ARCHIVED, TaskState.CANCELED}


def main() -> int:
    with Client(os.environ.get("CONVEYOR_TARGET", "127.0.0.1:50051")) as client:
        tasks = [
            client.enqueue(
                "email.send",
                {"to": f"user{i}@example.com", "subject": "Welcome!"},
                queue="emails",
                max_retry=3,
            )
            for i in range(5)
        ]
        # Many at once, in one call (all-or-nothing: enqueue_tx).
        tasks += client.enqueue_tx(
            [
                spec("report.build", {"name": f"weekly-{i}", "pages": 3}, queue="reports")
                for i in range(3)
            ]
        )
        print(f"enqueued {len(tasks)} tasks")

        deadline = time.monotonic() + 60
        while True:
            states = [client.get_task(t.id) for t in tasks]
            if all(s.state in TERMINAL for s in states):
                break
            if time.monotonic() > deadline:
                print("timed out waiting for the worker: is examples/worker.py running?")
                return 1
            time.sleep(0.2)  # poll the task states once in a while

        for info in states:
            print(f"{info.id} {info.type:<13} {info.state.value:<10} result={info.result!r}")
        completed = sum(1 for s in states if s.state is TaskState.COMPLETED)
        print(f"{completed} of {len(tasks)} tasks completed")
        return 0 if completed == len(tasks) else 1


if __name__ == "__main__":
    sys.exit(main())
