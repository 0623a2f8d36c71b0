"""``python -m conveyor_maintenance`` as a real process: it sweeps, and stops on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid
from pathlib import Path

import pytest
from conveyor_broker.postgres import PostgresBroker, migrate
from conveyor_broker.types import NewTask
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.nats_connect import close_nats, connect_nats
from conveyor_runtime.ownership import KeyLease, open_lease_bucket
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.cluster_keys import cluster_auth
from conveyor_testkit.polling import wait_until

pytestmark = pytest.mark.postgres


async def test_maintenance_process_wakes_due_queues_and_stops_on_sigterm(
    nats_url: str, fresh_pg_dsn: str, tmp_path: Path
) -> None:
    subjects = Subjects(prefix=f"t{uuid.uuid4().hex[:12]}")
    await migrate(fresh_pg_dsn)
    broker = await PostgresBroker.connect(fresh_pg_dsn, max_size=2)
    nc = await connect_nats(nats_url, name="process-test")
    woken: list[str] = []
    bus = Bus(nc, subjects, cluster_auth())
    await bus.subscribe(cluster_pb2.Wake, lambda wake: woken.append(wake.queue))
    await nc.flush()
    # Due work nobody announced, in a queue a gateway serves: the reaper's sweep must
    # find it. Due work in a queue nobody serves is left alone.
    await broker.enqueue(NewTask(queue="forgotten", type="t"))
    await broker.enqueue(NewTask(queue="unserved", type="t"))

    async def served_and_woken() -> bool:
        # A gateway registers every register tick; this one at every look.
        await bus.publish(cluster_pb2.Register(gateway="gw", queue="forgotten", capacity=1))
        return woken.count("forgotten") >= 3

    log_path = tmp_path / "maintenance.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "conveyor_maintenance",
            "--nats-url",
            nats_url,
            "--subject-prefix",
            subjects.prefix,
            "--dsn",
            fresh_pg_dsn,
            "--reap-tick",
            "0.1",
            "--log-format",
            "json",
            stdout=log,
            stderr=log,
        )
    try:
        await wait_until(served_and_woken, within=30)
        assert "unserved" not in woken
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await proc.wait() == 0
        # Leadership was given up on the way out.
        kv = await open_lease_bucket(nc, subjects.leaders_bucket, ttl=5)
        assert await KeyLease(kv, "reaper", "anyone").holder() is None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await broker.close()
        await close_nats(nc)
    output = log_path.read_text()
    assert '"event": "service.stopped", "name": "maintenance"' in output, output
