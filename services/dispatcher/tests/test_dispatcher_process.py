"""``python -m conveyor_dispatcher`` as a real process: it serves, and SIGTERM hands over."""

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


async def test_dispatcher_process_dispatches_and_hands_over_on_sigterm(
    nats_url: str, fresh_pg_dsn: str, tmp_path: Path
) -> None:
    subjects = Subjects(prefix=f"t{uuid.uuid4().hex[:12]}")
    queue, gateway = "mail", "gw-proc"
    log_path = tmp_path / "dispatcher.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "conveyor_dispatcher",
            "--nats-url",
            nats_url,
            "--subject-prefix",
            subjects.prefix,
            "--dsn",
            fresh_pg_dsn,
            "--instance-id",
            "proc-dispatcher",
            "--owner-ttl",
            "30",
            stdout=log,
            stderr=log,
        )
    nc = await connect_nats(nats_url, name="process-test")
    broker: PostgresBroker | None = None
    bus = Bus(nc, subjects, cluster_auth())
    try:
        owner_changes: list[str] = []
        received: list[str] = []

        def on_dispatch(request: cluster_pb2.DispatchRequest) -> cluster_pb2.DispatchReply:
            received.extend(env.id for env in request.tasks)
            return cluster_pb2.DispatchReply(
                accepted=[env.id for env in request.tasks], credits=5 - len(received)
            )

        await bus.subscribe_owner_changed(owner_changes.append, queue=queue)
        await bus.serve_dispatch(gateway, on_dispatch)
        register = cluster_pb2.Register(gateway=gateway, queue=queue, capacity=5, weight=1)

        async def claimed() -> bool:
            # Keep announcing until the process is up and has claimed the queue.
            await bus.publish(register)
            await nc.flush()
            return len(owner_changes) > 0

        await wait_until(claimed, within=30)

        await migrate(fresh_pg_dsn)
        broker = await PostgresBroker.connect(fresh_pg_dsn, max_size=2)
        task = (await broker.enqueue(NewTask(queue=queue, type="t"))).task
        await bus.publish(cluster_pb2.Wake(queue=queue))
        await wait_until(lambda: received == [task.id])

        claims = len(owner_changes)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await proc.wait() == 0
        # The stopping owner deleted its key and told the gateways to re-register.
        await wait_until(lambda: len(owner_changes) > claims)
        kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=30)
        assert await KeyLease(kv, queue, "anyone").holder() is None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if broker is not None:
            await broker.close()
        await close_nats(nc)
    output = log_path.read_text()
    assert "service.stopped name=dispatcher" in output, output
