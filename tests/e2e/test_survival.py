"""Survival (issue 11): prompt stops, bounded waits, and what a wedged link does to the
services, through real processes."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from conveyor import AsyncClient, spec
from conveyor_broker import TaskState
from conveyor_broker.postgres import PostgresBroker
from conveyor_runtime.embedded_nats import free_port
from conveyor_testkit.polling import wait_until
from conveyor_testkit.proxy import WedgeProxy

from tests.e2e.harness import POLL_INTERVAL, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

SERVICES = {
    "api": ["-m", "conveyor_api"],
    "dispatcher": ["-m", "conveyor_dispatcher"],
    "maintenance": ["-m", "conveyor_maintenance"],
    "webhook": ["-m", "conveyor_webhook"],
}


@pytest.mark.parametrize("service", sorted(SERVICES))
async def test_first_sigterm_stops_a_service_waiting_for_nats(
    service: str, migrated_dsn: str, tmp_path: Path
) -> None:
    # Nothing listens on this port: the service waits for NATS (retrying forever).
    cluster = Cluster(
        dsn=migrated_dsn, nats_url=f"nats://127.0.0.1:{free_port()}", workdir=tmp_path
    )
    try:
        proc = cluster.spawn(
            service,
            SERVICES[service],
            {"CONVEYOR_HOST": "127.0.0.1", "CONVEYOR_PORT": "0", "CONVEYOR_STOP_GRACE": "60"},
        )
        await wait_until(
            lambda: "nats.error" in proc.log() or not proc.alive(),
            within=30,
            message="the service trying NATS",
            interval=POLL_INTERVAL,
        )
        assert proc.alive(), proc.log()
        started = time.monotonic()
        code = proc.terminate(timeout=20)
        # One signal, well within the grace period (60 s): the wait was abandoned.
        assert code == 0, proc.log()
        assert time.monotonic() - started < 10
        assert "during=start-up waiting_for=nats" in proc.log()
        assert "forced_stop" not in proc.log()
    finally:
        cluster.stop_all()


async def test_a_dispatcher_on_a_wedged_database_connection_hands_its_queue_over(
    cluster: Cluster, store: PostgresBroker, tmp_path: Path
) -> None:
    parts = urlsplit(cluster.dsn)
    async with WedgeProxy(parts.hostname or "127.0.0.1", parts.port or 5432) as proxy:
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@127.0.0.1:{proxy.port}" if auth else f"127.0.0.1:{proxy.port}"
        api = await cluster.start_api()
        cluster.start_maintenance()
        # Its database link goes through the proxy; only the watchdog can save the queue
        # (the command timeout is far away).
        stuck = cluster.start_dispatcher(
            {
                "CONVEYOR_DSN": urlunsplit(parts._replace(netloc=netloc)),
                "CONVEYOR_PROGRESS_DEADLINE": "2",
                "CONVEYOR_DB_COMMAND_TIMEOUT": "300",
                "CONVEYOR_OWNER_TTL": "60",
                "CONVEYOR_STOP_GRACE": "5",
            }
        )
        target = f"127.0.0.1:{api.port}"
        record = tmp_path / "record.txt"
        cluster.start_worker(target, queues={"wedged": 1}, concurrency=4, record=record)
        async with AsyncClient(target) as client:
            first = (await client.enqueue_batch([spec("e2e.noop", {}, queue="wedged")]))[0]
            assert first.task is not None

            async def completed(ids: list[str]) -> bool:
                states = [(await store.get_task(i)).state for i in ids]
                return all(s is TaskState.COMPLETED for s in states)

            first_id = first.task.id
            await wait_until(
                lambda: completed([first_id]),
                within=60,
                message="first",
                interval=POLL_INTERVAL,
            )
            assert "dispatcher.queue_claimed queue=wedged" in stuck.log()
            healthy = cluster.start_dispatcher({"CONVEYOR_OWNER_TTL": "60"})
            await wait_until(
                lambda: "dispatcher.started" in healthy.log(),
                within=30,
                message="started",
                interval=POLL_INTERVAL,
            )

            proxy.wedge(new_connections=True)
            results = await client.enqueue_batch(
                [spec("e2e.noop", {"i": i}, queue="wedged") for i in range(5)]
            )
            ids = [r.task.id for r in results if r.task is not None]
            assert len(ids) == 5
            await wait_until(
                lambda: completed(ids),
                within=90,
                message="tasks after the wedge",
                interval=POLL_INTERVAL,
            )
        assert "dispatcher.queue_abandoned queue=wedged" in stuck.log()
        assert "dispatcher.queue_claimed queue=wedged" in healthy.log()
        # Stop the stuck one while its connections are still wedged: it exits within its
        # grace period all the same.
        started = time.monotonic()
        assert stuck.terminate(timeout=60) in (0, 1), stuck.log()
        assert time.monotonic() - started < 20
