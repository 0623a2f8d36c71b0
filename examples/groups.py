"""Quickstart aggregation groups: events per user, delivered as one digest per user.

    uv run python examples/groups.py   # against `conveyor dev` on 127.0.0.1:50051

Sets the group config of the ``digests`` queue (a user's events go together once 5 have
gathered, 30 seconds after the first, or 10 seconds after the last, whichever comes
first), enqueues a few events for three users, and shows the groups waiting. With
examples/worker.py running, each user's events reach its ``digest.send`` batch handler
in one call; ``conveyor group stats digests`` shows what still waits.
"""

from __future__ import annotations

import os

from conveyor import AdminClient, Client

TARGET = os.environ.get("CONVEYOR_TARGET", "127.0.0.1:50051")


def main() -> None:
    with AdminClient(TARGET) as admin, Client(TARGET) as client:
        admin.set_group_config(
            "digests", pattern="user:*", max_size=5, max_delay=30, grace_period=10
        )
        for user, events in (("ada", 5), ("grace", 2), ("linus", 3)):
            for n in range(events):
                client.enqueue(
                    "digest.send", {"event": f"event-{n}"}, queue="digests", group=f"user:{user}"
                )
        # user:ada has 5 events: due at once (max size). The others wait for their grace.
        for stats in admin.group_stats("digests"):
            print(f"{stats.group:<12} {stats.size} waiting since {stats.oldest_at:%H:%M:%S}")


if __name__ == "__main__":
    main()
