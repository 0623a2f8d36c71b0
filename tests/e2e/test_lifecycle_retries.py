"""Retries, results and lifecycle events through real processes: api, dispatcher,
maintenance and an SDK worker over Postgres and a private nats-server."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from pathlib import Path

import nats
import pytest
from conveyor import AsyncAdminClient, AsyncClient, TaskEvent, TaskState
from conveyor_testkit.polling import wait_until
from nats.aio.msg import Msg

from tests.e2e.harness import POLL_INTERVAL, Cluster
from tests.e2e.lifecycle import start_stack, wait_state

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

Q = "life"
P, A, R, C, X = (
    TaskState.PENDING,
    TaskState.ACTIVE,
    TaskState.RETRY,
    TaskState.COMPLETED,
    TaskState.ARCHIVED,
)


def history(events: list[TaskEvent], task_id: str) -> list[TaskEvent]:
    """The events of one task, in the order they happened."""
    return sorted((e for e in events if e.task_id == task_id), key=lambda e: e.at)


async def test_retries_results_and_events(cluster: Cluster, tmp_path: Path) -> None:
    stack = await start_stack(
        cluster,
        tmp_path,
        queues={Q: 1},
        # Tasks that leave max_retry unset get 1; results are capped at 2000 bytes.
        env={"CONVEYOR_DEFAULT_MAX_RETRY": "1", "CONVEYOR_MAX_RESULT": "2000"},
    )
    events: list[TaskEvent] = []
    subjects: list[str] = []
    nc = await nats.connect(cluster.nats_url)

    async def on_raw(msg: Msg) -> None:
        subjects.append(msg.subject)

    await nc.subscribe(f"conveyor.events.{Q}.*", cb=on_raw)
    await nc.flush()
    async with (
        AsyncAdminClient(stack.target) as admin,
        AsyncClient(stack.target) as client,
        admin.watch_events(queues=[Q]) as watch,
    ):

        async def collect() -> None:
            async for event in watch:
                events.append(event)

        collector = asyncio.create_task(collect())
        flaky = await client.enqueue("e2e.fail", {"fails": 2}, queue=Q, max_retry=3)
        doomed = await client.enqueue("e2e.fail", {"error": "always broken"}, queue=Q, max_retry=1)
        defaulted = await client.enqueue("e2e.fail", {}, queue=Q)
        skipper = await client.enqueue("e2e.skip", {"error": "bad input"}, queue=Q, max_retry=5)
        later = await client.enqueue("e2e.retry_after", {"fails": 1, "delay": 1.5}, queue=Q)
        answer = await client.enqueue("e2e.result", {"result": {"answer": 42}}, queue=Q)
        huge = await client.enqueue("e2e.result", {"size": 5000}, queue=Q, max_retry=0)
        # Past gRPC's frame limit: refused by the SDK (which learned the server's limit from
        # Welcome) before it could break the stream.
        giant = await client.enqueue("e2e.result", {"size": 3_000_000}, queue=Q, max_retry=0)
        assert defaulted.max_retry == 1  # the server-wide default

        # A handler-requested delay: the retry is due exactly 1.5 s after the failure.
        waiting = await wait_state(admin, later.id, R)
        assert waiting.next_process_at is not None
        assert waiting.updated_at is not None
        assert waiting.next_process_at - waiting.updated_at == timedelta(seconds=1.5)
        assert waiting.last_error == "RetryAfter: come back later"
        assert (await wait_state(admin, later.id, C)).retried == 1

        # Exponential backoff: fails twice, then succeeds on the third attempt.
        done = await wait_state(admin, flaky.id, C)
        assert (done.retried, done.result, done.last_error) == (
            2,
            {"attempt": 3},
            "RuntimeError: boom",
        )
        assert [f[2] for f in stack.lines("start", flaky.id)] == ["1", "2", "3"]

        # Exhausted retries: archived with the last error, after max_retry + 1 attempts.
        archived = await wait_state(admin, doomed.id, X)
        assert (archived.retried, archived.last_error) == (2, "RuntimeError: always broken")
        assert len(stack.lines("start", doomed.id)) == 2
        assert (await wait_state(admin, defaulted.id, X)).retried == 2

        # SkipRetry archives at once, whatever retries remain.
        skipped = await wait_state(admin, skipper.id, X)
        assert (skipped.retried, skipped.last_error) == (0, "bad input")
        assert len(stack.lines("start", skipper.id)) == 1

        # Results: stored on ack and read back; one past the limit fails with a clear error.
        assert (await wait_state(admin, answer.id, C)).result == {"answer": 42}
        assert (await client.get_task(answer.id)).result == {"answer": 42}
        too_big = await wait_state(admin, huge.id, X)
        assert too_big.result is None
        assert too_big.last_error == "result is 5002 bytes; the limit is 2000"
        refused = await wait_state(admin, giant.id, X)
        assert refused.last_error == "result is 3000002 bytes; the limit is 2000"
        assert len(stack.lines("start", giant.id)) == 1

        await wait_until(
            lambda: len(history(events, flaky.id)) == 7,
            within=30,
            interval=POLL_INTERVAL,
            message="flaky's 7 events",
        )
        await wait_until(
            lambda: len(history(events, huge.id)) == 3,
            within=30,
            interval=POLL_INTERVAL,
            message="huge's 3 events",
        )
        watch.close()
        with contextlib.suppress(asyncio.CancelledError):
            await collector

    # Every state change is an event; a retry is leased straight from RETRY.
    flaky_events = history(events, flaky.id)
    assert [(e.previous_state, e.state) for e in flaky_events] == [
        (None, P),
        (P, A),
        (A, R),
        (R, A),
        (A, R),
        (R, A),
        (A, C),
    ]
    assert [e.error for e in flaky_events if e.state is R] == ["RuntimeError: boom"] * 2
    # The first retry waits 0.5-1 s (1 s minus jitter), the second 1-2 s.
    first_gap = flaky_events[3].at - flaky_events[2].at
    second_gap = flaky_events[5].at - flaky_events[4].at
    assert timedelta(seconds=0.5) <= first_gap < timedelta(seconds=3)
    assert timedelta(seconds=1) <= second_gap < timedelta(seconds=4)
    assert [(e.state, e.error) for e in history(events, skipper.id)][-1] == (X, "bad input")

    await nc.drain()
    assert {s.rsplit(".", 1)[1] for s in subjects} >= {
        "pending",
        "active",
        "retry",
        "completed",
        "archived",
    }
    assert all(s.startswith(f"conveyor.events.{Q}.") for s in subjects)


async def test_a_retry_starts_when_due_not_at_the_reapers_next_sweep(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The api wakes the queue when a retry falls due. With the reaper's due-queue sweep
    five minutes apart and capacity re-announced once a minute, nothing else would: the
    dispatcher leases on wakes, announcements and freed credit, and the credit comes back
    before the retry is due."""
    stack = await start_stack(
        cluster,
        tmp_path,
        queues={Q: 1},
        env={"CONVEYOR_REAP_TICK": "300", "CONVEYOR_REGISTER_TICK": "60"},
    )
    async with AsyncAdminClient(stack.target) as admin, AsyncClient(stack.target) as client:
        task = await client.enqueue("e2e.retry_after", {"fails": 2, "delay": 0.3}, queue=Q)
        done = await wait_state(admin, task.id, C, within=20)
    assert done.retried == 2
