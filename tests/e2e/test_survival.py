"""Survival (issue 11): prompt stops, bounded waits, and what a wedged link does to the
services, through real processes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conveyor_runtime.embedded_nats import free_port

from tests.e2e.harness import Cluster, wait_for

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
        await wait_for(
            lambda: "nats.error" in proc.log() or not proc.alive(),
            timeout=30,
            message="the service trying NATS",
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
