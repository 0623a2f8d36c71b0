"""``python -m conveyor_webhook`` as a real process (Postgres, NATS, a real endpoint and an
in-process dispatcher): it delivers, and stops on SIGTERM giving the role up. Also
``conveyor dev`` runs the webhook manager in its process."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
from conveyor_broker import TaskState
from conveyor_broker.postgres import PostgresBroker, migrate
from conveyor_cli.dev import DevOptions, run_dev
from conveyor_dispatcher import Dispatcher
from conveyor_runtime.bus import Bus
from conveyor_runtime.nats_connect import close_nats, connect_nats
from conveyor_runtime.ownership import KeyLease, open_lease_bucket
from conveyor_runtime.settings import DispatcherSettings
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.cluster_keys import cluster_auth
from conveyor_testkit.polling import wait_until
from conveyor_testkit.webhooks import LOCAL_ENDPOINTS, WEBHOOK_KEY, Endpoint, register, rpc, submit
from conveyor_webhook import ROLE


@pytest.mark.postgres
async def test_webhook_process_delivers_and_stops_on_sigterm(
    nats_url: str, fresh_pg_dsn: str, tmp_path: Path
) -> None:
    subjects = Subjects(prefix=f"t{uuid.uuid4().hex[:12]}")
    await migrate(fresh_pg_dsn)
    broker = await PostgresBroker.connect(fresh_pg_dsn, max_size=2)
    nc = await connect_nats(nats_url, name="webhook-process-test")
    dispatcher = Dispatcher(
        DispatcherSettings(nats_url=nats_url, subject_prefix=subjects.prefix, broker="memory"),
        broker,
        nc,
    )
    await dispatcher.start()
    log_path = tmp_path / "webhook.log"
    async with Endpoint(answer=rpc("success", result=b"done")) as endpoint:
        await register(broker, endpoint.url, "proc")
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "conveyor_webhook",
                "--nats-url",
                nats_url,
                "--subject-prefix",
                subjects.prefix,
                "--dsn",
                fresh_pg_dsn,
                "--reconcile-tick",
                "0.2",
                "--log-format",
                "json",
                "--webhook-allow-networks",
                LOCAL_ENDPOINTS,
                # The key in the environment, as an operator keeps it out of `ps`.
                env={**os.environ, "CONVEYOR_WEBHOOK_SECRET_KEY": WEBHOOK_KEY},
                stdout=log,
                stderr=log,
            )
        try:
            task_id = await submit(broker, Bus(nc, subjects, cluster_auth()), "hooks")

            async def completed() -> bool:
                task = await broker.get_task(task_id)
                return task.state == TaskState.COMPLETED and task.result == b"done"

            await wait_until(completed, within=30, interval=0.2)
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(15):
                assert await proc.wait() == 0
            kv = await open_lease_bucket(nc, subjects.leaders_bucket, ttl=5)
            assert await KeyLease(kv, ROLE, "anyone").holder() is None
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await dispatcher.stop()
            await broker.close()
            await close_nats(nc)
    output = log_path.read_text()
    assert '"event": "service.stopped", "name": "webhook"' in output, output
    assert "webhook.gateway_started" in output


async def test_conveyor_dev_runs_the_webhook_manager(nats_url: str) -> None:
    stop = asyncio.Event()
    dev = asyncio.create_task(run_dev(DevOptions(port=0, nats_url=nats_url), stop))
    nc = await connect_nats(nats_url, name="dev-test")
    try:
        kv = await open_lease_bucket(nc, Subjects().leaders_bucket, ttl=5)

        async def leads() -> bool:
            return await KeyLease(kv, ROLE, "anyone").holder() == "dev"

        await wait_until(leads, within=30)
        stop.set()
        await dev
        # Stopping dev gave the role up.
        assert await KeyLease(kv, ROLE, "anyone").holder() is None
    finally:
        stop.set()
        await dev
        await close_nats(nc)
