"""Liveness for container health checks: a file touched while the process is healthy.

A service started with ``--health-file PATH`` rewrites PATH every ``interval`` seconds
while its NATS connection is up and its broker answers; ``conveyor health --file PATH``
fails when the file is older than a few intervals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

from conveyor_broker.interface import Broker
from nats.aio.client import Client as NatsClient

logger = logging.getLogger(__name__)

INTERVAL = 2.0


async def beat(path: str, nc: NatsClient, broker: Broker, interval: float = INTERVAL) -> None:
    """Touch ``path`` every ``interval`` seconds while NATS and the broker are healthy."""
    target = Path(path)
    while True:
        try:
            await asyncio.wait_for(broker.info(), timeout=interval)
            healthy = nc.is_connected
        except Exception:
            healthy = False
        if healthy:
            tmp = target.with_suffix(target.suffix + ".tmp")
            tmp.write_text(f"{time.time():.3f}\n")
            os.replace(tmp, target)
        else:
            logger.warning("health.unhealthy path=%s nats_connected=%s", path, nc.is_connected)
        await asyncio.sleep(interval)  # the beat's period


def is_fresh(path: str, max_age: float) -> bool:
    """True when ``path`` was touched within ``max_age`` seconds."""
    with contextlib.suppress(OSError):
        return time.time() - Path(path).stat().st_mtime <= max_age
    return False
