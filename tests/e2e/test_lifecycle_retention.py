"""Retention through real processes: the reaper purges completed rows after their own
retention, archived and canceled rows after the server-wide archive retention, and never
touches a task that is still waiting."""

from __future__ import annotations

from pathlib import Path

import pytest
from conveyor import AsyncAdminClient, AsyncClient, InvalidArgument, TaskState

from tests.e2e.harness import Cluster
from tests.e2e.lifecycle import start_stack, wait_gone, wait_state

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]


async def test_terminal_rows_are_purged_after_their_retention(
    cluster: Cluster, tmp_path: Path
) -> None:
    stack = await start_stack(
        cluster, tmp_path, queues={"keep": 1}, env={"CONVEYOR_ARCHIVE_RETENTION": "1.5"}
    )
    async with AsyncClient(stack.target) as client, AsyncAdminClient(stack.target) as admin:
        with pytest.raises(InvalidArgument, match="retention must be >= 0"):
            await client.enqueue("e2e.noop", {}, queue="keep", retention=-1)
        short = await client.enqueue("e2e.noop", {}, queue="keep", retention=0.5)
        kept = await client.enqueue("e2e.noop", {}, queue="keep")  # the default: a day
        skipped = await client.enqueue("e2e.skip", {}, queue="keep")
        waiting = await client.enqueue("e2e.noop", {}, queue="unserved")
        canceled = await admin.cancel_task(
            (await client.enqueue("e2e.noop", {}, queue="unserved")).id
        )
        assert canceled.state is TaskState.CANCELED
        assert (await wait_state(admin, kept.id, TaskState.COMPLETED)).options.retention is not None
        await wait_state(admin, skipped.id, TaskState.ARCHIVED)

        await wait_gone(admin, short.id)
        await wait_gone(admin, skipped.id)
        await wait_gone(admin, canceled.id)
        # Purged rows are gone for good; the others stay.
        assert (await admin.get_task(kept.id)).state is TaskState.COMPLETED
        assert (await admin.get_task(waiting.id)).state is TaskState.PENDING
        remaining = {t.id async for t in admin.iter_tasks(queue="keep")}
        assert kept.id in remaining
        assert not remaining & {short.id, skipped.id}
