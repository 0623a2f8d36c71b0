"""Big payloads through the push path: a dispatch offer whose tasks together exceed what
one NATS message may carry still reaches the worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from conveyor import AsyncAdminClient, AsyncClient, TaskState

from tests.e2e.harness import Cluster
from tests.e2e.lifecycle import start_stack, wait_state

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]


async def test_a_burst_of_big_tasks_is_dispatched_in_pieces(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Twelve tasks of 900 kB each, leased in one batch by a worker with room for all:
    about 11 MB in one offer, past the 8 MB a NATS message carries here."""
    stack = await start_stack(cluster, tmp_path, queues={"big": 1}, concurrency=16)
    async with AsyncAdminClient(stack.target) as admin, AsyncClient(stack.target) as client:
        blob = "x" * 900_000
        # Paused while they go in, so that one lease takes them all.
        await admin.pause_queue("big")
        tasks = [await client.enqueue("e2e.noop", {"blob": blob}, queue="big") for _ in range(12)]
        await admin.resume_queue("big")
        for task in tasks:
            done = await wait_state(admin, task.id, TaskState.COMPLETED, within=30)
            assert done.retried == 0
