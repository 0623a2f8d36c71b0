"""Prometheus metrics through real processes: an api, a dispatcher, a maintenance and a
webhook service process, each serving ``/metrics`` on a port of its own, an SDK worker,
a webhook endpoint in the test process, a real Postgres and a private nats-server.

A known set of tasks runs: some succeed, some fail for good (a failure with no retry
left, a skip-retry), some fail once and succeed on their retry, some go through a webhook
registration (successes and failures), and a paused queue holds two tasks for a while.
Then every service's ``/metrics`` is scraped and its counters checked against what ran:
exactly where each attempt is counted once (tasks created, attempts started, outcomes,
run times, deliveries, breaker openings), as bounds where the count depends on timing
(dispatch offers, ownership claims). The oldest due age of the paused queue grows while
it waits and is 0 once it drained. Every wait is on a condition with a timeout."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from conveyor import AsyncAdminClient, AsyncClient, TaskState, spec
from conveyor_broker import TaskState as StoredState
from conveyor_broker.postgres import PostgresBroker
from conveyor_runtime.embedded_nats import free_port
from conveyor_testkit.polling import wait_until
from conveyor_testkit.webhooks import Delivery, Endpoint, rpc
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.harness import POLL_INTERVAL, Cluster, port_open
from tests.e2e.lifecycle import wait_state

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

Q = "metrics"
PAUSED = "m-paused"
HOOKS = "m-hooks"
HOOK = "m-hook"
SECRET = "e2e-metrics-secret-0123456789abcdef"

OK = 10  # e2e.noop: completed at once
RETRIED = 4  # e2e.retry_after: fails once, succeeds on the retry
DOOMED = 3  # e2e.fail with no retry: archived (and they open the type's breaker)
SKIPPED = 2  # e2e.skip: archived at once
HOOK_OK = 3  # hook.ok through the webhook registration: success
HOOK_BAD = 2  # hook.bad: the endpoint answers failure, no retry: archived
HELD = 2  # e2e.noop in the paused queue

#: Short ticks: retries, reaper sweeps, depth counts and reconciles within a second.
FAST = {
    "CONVEYOR_REAP_TICK": "0.2",
    "CONVEYOR_PROMOTE_TICK": "0.2",
    "CONVEYOR_DEPTH_TICK": "0.2",
    "CONVEYOR_RECONCILE_TICK": "0.2",
    "CONVEYOR_METRICS_HOST": "127.0.0.1",
}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, by name and sorted labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def scrape(port: int) -> Samples:
    """The samples a process serves on ``port`` now."""
    async with httpx.AsyncClient() as http:
        reply = await http.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    reply.raise_for_status()
    return parse(reply.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels`` (0 when the process has none)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


Expected = list[tuple[str, Mapping[str, str], float]]


def mismatches(samples: Samples, expected: Expected) -> list[str]:
    """The expectations ``samples`` does not meet, as text."""
    return [
        f"{name}{dict(labels)} = {value(samples, name, **labels)}, expected {want}"
        for name, labels, want in expected
        if value(samples, name, **labels) != want
    ]


async def settle(port: int, expected: Expected, what: str) -> Samples:
    """Wait until the process on ``port`` serves every value of ``expected`` (a counter
    moves just after the commit it counts); its samples then. Fails naming the values
    that never matched."""
    seen: list[Samples] = [{}]

    async def met() -> bool:
        seen[0] = await scrape(port)
        return not mismatches(seen[0], expected)

    try:
        await wait_until(met, within=30, interval=POLL_INTERVAL, message=what)
    except TimeoutError:
        raise AssertionError(f"{what}: " + "; ".join(mismatches(seen[0], expected))) from None
    return seen[0]


def tq(queue: str, task_type: str) -> dict[str, str]:
    return {"queue": queue, "type": task_type}


async def answer(delivery: Delivery) -> web.StreamResponse:
    """The endpoint: hook.bad fails, everything else succeeds."""
    if delivery.call["params"]["type"] == "hook.bad":
        return await rpc("failure", error="declined")(delivery)
    return await rpc("success")(delivery)


async def test_every_services_metrics_count_the_tasks_that_ran(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    cluster.settings_env.update(FAST)
    ports = {name: free_port() for name in ("api", "dispatcher", "maintenance", "webhook")}

    def metrics_env(name: str) -> dict[str, str]:
        return {"CONVEYOR_METRICS_PORT": str(ports[name])}

    api = await cluster.start_api(metrics_env("api"))
    target = f"127.0.0.1:{api.port}"
    cluster.start_dispatcher(metrics_env("dispatcher"))
    cluster.start_maintenance(metrics_env("maintenance"))
    cluster.start_webhook({**metrics_env("webhook"), "CONVEYOR_CALLBACK_ADDRESS": target})
    for name, port in ports.items():
        await wait_until(
            lambda port=port: port_open(port),  # type: ignore[misc]
            within=60,
            interval=POLL_INTERVAL,
            message=f"{name} metrics port",
        )

    async with (
        Endpoint(answer=answer) as endpoint,
        AsyncAdminClient(target) as admin,
        AsyncClient(target) as client,
    ):
        # Before any worker connects: the failing type's breaker, and the held queue.
        await admin.set_breaker_config(Q, DOOMED, window=60, cooldown=600, pattern="e2e.fail")
        await admin.pause_queue(PAUSED)
        await admin.upsert_webhook_worker(
            HOOK, endpoint.url, {HOOKS: 1}, concurrency=4, timeout=10, secrets=[SECRET]
        )
        cluster.start_worker(
            target, queues={Q: 1, PAUSED: 1}, concurrency=16, record=tmp_path / "runs"
        )
        results = await client.enqueue_batch(
            [spec("e2e.noop", {}, queue=Q) for _ in range(OK)]
            + [
                spec("e2e.retry_after", {"fails": 1, "delay": 0.2}, queue=Q, max_retry=3)
                for _ in range(RETRIED)
            ]
            + [spec("e2e.fail", {"error": "broken"}, queue=Q, max_retry=0) for _ in range(DOOMED)]
            + [spec("e2e.skip", {}, queue=Q, max_retry=5) for _ in range(SKIPPED)]
            + [spec("hook.ok", {}, queue=HOOKS, max_retry=0) for _ in range(HOOK_OK)]
            + [spec("hook.bad", {}, queue=HOOKS, max_retry=0) for _ in range(HOOK_BAD)]
            + [spec("e2e.noop", {}, queue=PAUSED) for _ in range(HELD)]
        )
        tasks = {r.task.id: r.task for r in results if r.task is not None}
        assert len(tasks) == len(results)

        # The paused queue's tasks wait: their age grows, and the depth counts them.
        maintenance = ports["maintenance"]

        async def held_long_enough() -> bool:
            samples = await scrape(maintenance)
            return (
                value(samples, "conveyor_queue_oldest_due_seconds", queue=PAUSED) >= 1.0
                and value(samples, "conveyor_queue_depth", queue=PAUSED, state="pending") == HELD
            )

        await wait_until(held_long_enough, within=60, interval=POLL_INTERVAL, message="held")

        # Everything else ends meanwhile; then the held queue is resumed and drains.
        async def ended(queues: set[str]) -> bool:
            for task_id, task in tasks.items():
                if task.queue in queues:
                    state = (await store.get_task(task_id)).state
                    if state not in (StoredState.COMPLETED, StoredState.ARCHIVED):
                        return False
            return True

        await wait_until(
            lambda: ended({Q, HOOKS}), within=60, interval=POLL_INTERVAL, message="ended"
        )
        await admin.resume_queue(PAUSED)
        for task_id, task in tasks.items():
            if task.queue == PAUSED:
                await wait_state(admin, task_id, TaskState.COMPLETED, within=30)

    # api: tasks created, and the stream gateway's outcomes, run times and breakers.
    completed = OK + RETRIED
    attempts = OK + 2 * RETRIED + DOOMED + SKIPPED
    api_samples = await settle(
        ports["api"],
        [
            ("conveyor_tasks_enqueued_total", tq(Q, "e2e.noop"), OK),
            ("conveyor_tasks_enqueued_total", tq(Q, "e2e.retry_after"), RETRIED),
            ("conveyor_tasks_enqueued_total", tq(Q, "e2e.fail"), DOOMED),
            ("conveyor_tasks_enqueued_total", tq(Q, "e2e.skip"), SKIPPED),
            ("conveyor_tasks_enqueued_total", tq(HOOKS, "hook.ok"), HOOK_OK),
            ("conveyor_tasks_enqueued_total", tq(HOOKS, "hook.bad"), HOOK_BAD),
            ("conveyor_tasks_enqueued_total", tq(PAUSED, "e2e.noop"), HELD),
            ("conveyor_tasks_completed_total", tq(Q, "e2e.noop"), OK),
            ("conveyor_tasks_completed_total", tq(Q, "e2e.retry_after"), RETRIED),
            ("conveyor_tasks_completed_total", tq(PAUSED, "e2e.noop"), HELD),
            ("conveyor_tasks_failed_total", tq(Q, "e2e.retry_after"), RETRIED),
            ("conveyor_tasks_failed_total", tq(Q, "e2e.fail"), DOOMED),
            ("conveyor_tasks_failed_total", tq(Q, "e2e.skip"), SKIPPED),
            ("conveyor_tasks_failed_total", tq(Q, "e2e.noop"), 0),
            ("conveyor_tasks_retried_total", tq(Q, "e2e.retry_after"), RETRIED),
            ("conveyor_tasks_retried_total", tq(Q, "e2e.fail"), 0),
            ("conveyor_tasks_archived_total", tq(Q, "e2e.fail"), DOOMED),
            ("conveyor_tasks_archived_total", tq(Q, "e2e.skip"), SKIPPED),
            ("conveyor_tasks_archived_total", tq(Q, "e2e.retry_after"), 0),
            ("conveyor_task_run_seconds_count", {"queue": Q}, attempts),
            ("conveyor_task_run_seconds_count", {"queue": PAUSED}, HELD),
            ("conveyor_leases_held", {}, 0),
            # The failing type's breaker opened once on the worker's gateway, and stays so.
            (
                "conveyor_type_breaker_transitions_total",
                {**tq(Q, "e2e.fail"), "event": "opened"},
                1,
            ),
            (
                "conveyor_type_breaker_transitions_total",
                {**tq(Q, "e2e.fail"), "event": "closed"},
                0,
            ),
            ("conveyor_type_breaker_state", tq(Q, "e2e.fail"), 2),
            ("conveyor_type_breakers_open", tq(Q, "e2e.fail"), 1),
            ("conveyor_nats_connected", {"service": "api"}, 1),
        ],
        "api metrics",
    )
    assert value(api_samples, "conveyor_db_pool_size", service="api") >= 1
    assert value(api_samples, "conveyor_task_run_seconds_sum", queue=Q) > 0
    # No outcome of the webhook queue is the api's: the webhook service applies them.
    assert value(api_samples, "conveyor_tasks_completed_total", **tq(HOOKS, "hook.ok")) == 0

    # dispatcher: one start per attempt, one latency sample per first attempt.
    dispatcher_samples = await settle(
        ports["dispatcher"],
        [
            ("conveyor_tasks_started_total", {"queue": Q}, attempts),
            ("conveyor_tasks_started_total", {"queue": HOOKS}, HOOK_OK + HOOK_BAD),
            ("conveyor_tasks_started_total", {"queue": PAUSED}, HELD),
            ("conveyor_dispatch_accepted_tasks_total", {"queue": Q}, attempts),
            (
                "conveyor_enqueue_to_start_seconds_count",
                {"queue": Q},
                OK + RETRIED + DOOMED + SKIPPED,
            ),
            ("conveyor_enqueue_to_start_seconds_count", {"queue": HOOKS}, HOOK_OK + HOOK_BAD),
            ("conveyor_enqueue_to_start_seconds_count", {"queue": PAUSED}, HELD),
            ("conveyor_ownership_changes_total", {"event": "lost"}, 0),
            ("conveyor_nats_connected", {"service": "dispatcher"}, 1),
        ],
        "dispatcher metrics",
    )
    for queue in (Q, HOOKS, PAUSED):
        offered = value(dispatcher_samples, "conveyor_dispatch_offered_tasks_total", queue=queue)
        accepted = value(dispatcher_samples, "conveyor_dispatch_accepted_tasks_total", queue=queue)
        assert offered >= accepted > 0, queue
        assert value(dispatcher_samples, "conveyor_dispatch_offers_total", queue=queue) >= 1
    assert value(dispatcher_samples, "conveyor_ownership_changes_total", event="claimed") >= 3
    # The paused queue's tasks waited at least the second the test saw them wait.
    held_sum = value(dispatcher_samples, "conveyor_enqueue_to_start_seconds_sum", queue=PAUSED)
    assert held_sum >= HELD * 1.0

    # webhook: its deliveries by outcome, their latency, its breaker, its outcomes.
    webhook_samples = await settle(
        ports["webhook"],
        [
            ("conveyor_webhook_deliveries_total", {"worker": HOOK, "outcome": "success"}, HOOK_OK),
            ("conveyor_webhook_deliveries_total", {"worker": HOOK, "outcome": "failure"}, HOOK_BAD),
            ("conveyor_webhook_deliveries_total", {"worker": HOOK, "outcome": "transport"}, 0),
            ("conveyor_webhook_delivery_seconds_count", {"worker": HOOK}, HOOK_OK + HOOK_BAD),
            ("conveyor_webhook_breaker_state", {"worker": HOOK}, 0),
            ("conveyor_webhook_breaker_transitions_total", {"worker": HOOK, "event": "opened"}, 0),
            ("conveyor_tasks_completed_total", tq(HOOKS, "hook.ok"), HOOK_OK),
            ("conveyor_tasks_failed_total", tq(HOOKS, "hook.bad"), HOOK_BAD),
            ("conveyor_tasks_archived_total", tq(HOOKS, "hook.bad"), HOOK_BAD),
            ("conveyor_task_run_seconds_count", {"queue": HOOKS}, HOOK_OK + HOOK_BAD),
            ("conveyor_leases_held", {}, 0),
            ("conveyor_leader_changes_total", {"role": "webhook-manager", "event": "won"}, 1),
            ("conveyor_nats_connected", {"service": "webhook"}, 1),
        ],
        "webhook metrics",
    )
    assert value(webhook_samples, "conveyor_webhook_delivery_seconds_sum", worker=HOOK) > 0

    # maintenance: the depth of every served queue, the held queue's wait over.
    await settle(
        maintenance,
        [
            ("conveyor_queue_depth", {"queue": Q, "state": "completed"}, completed),
            ("conveyor_queue_depth", {"queue": Q, "state": "archived"}, DOOMED + SKIPPED),
            ("conveyor_queue_depth", {"queue": Q, "state": "pending"}, 0),
            ("conveyor_queue_depth", {"queue": Q, "state": "active"}, 0),
            ("conveyor_queue_depth", {"queue": PAUSED, "state": "completed"}, HELD),
            ("conveyor_queue_depth", {"queue": PAUSED, "state": "pending"}, 0),
            ("conveyor_queue_depth", {"queue": HOOKS, "state": "completed"}, HOOK_OK),
            ("conveyor_queue_depth", {"queue": HOOKS, "state": "archived"}, HOOK_BAD),
            ("conveyor_queue_oldest_due_seconds", {"queue": PAUSED}, 0),
            ("conveyor_queue_oldest_due_seconds", {"queue": Q}, 0),
            ("conveyor_leases_expired_total", {}, 0),
            ("conveyor_leader_changes_total", {"role": "reaper", "event": "won"}, 1),
            ("conveyor_nats_connected", {"service": "maintenance"}, 1),
        ],
        "maintenance metrics",
    )
