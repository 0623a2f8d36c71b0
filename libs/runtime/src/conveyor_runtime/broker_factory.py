"""Open the broker a service's settings ask for."""

from __future__ import annotations

import logging

from conveyor_broker.clock import Clock, SystemClock
from conveyor_broker.interface import Broker

from conveyor_runtime.settings import CommonSettings

logger = logging.getLogger(__name__)


async def open_broker(
    settings: CommonSettings, clock: Clock | None = None, *, migrate: bool | None = None
) -> Broker:
    """A connected broker: ``memory`` or ``postgres`` (on ``settings.dsn``).

    For postgres, pending migrations are applied first when ``migrate`` (default:
    ``settings.auto_migrate``) is true; that is safe with several processes starting at
    once (the migrator takes an advisory lock).
    """
    clock = clock or SystemClock()
    if settings.broker == "memory":
        from conveyor_broker.memory import MemoryBroker

        logger.info("broker.opened driver=memory")
        return MemoryBroker(clock)
    from conveyor_broker.postgres import PostgresBroker
    from conveyor_broker.postgres import migrate as apply_migrations

    if settings.auto_migrate if migrate is None else migrate:
        applied = await apply_migrations(settings.dsn)
        logger.info("broker.migrated applied=%s", applied)
    broker = await PostgresBroker.connect(settings.dsn, clock, max_size=settings.db_pool_size)
    logger.info("broker.opened driver=postgres pool=%d", settings.db_pool_size)
    return broker
