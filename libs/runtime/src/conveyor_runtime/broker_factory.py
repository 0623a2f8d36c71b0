"""Open the broker a service's settings ask for."""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from conveyor_broker.clock import Clock, SystemClock
from conveyor_broker.interface import Broker

from conveyor_runtime.settings import CommonSettings
from conveyor_runtime.tls import describe_hosts, dsn_hosts, effective_sslmode, postgres_ssl

logger = logging.getLogger(__name__)

__all__ = ["PostgresConnectError", "open_broker", "postgres_connection", "postgres_pool"]


class PostgresConnectError(ConnectionError):
    """Postgres could not be reached as the settings ask (TLS refused or failed...)."""


def _connect_error(settings: CommonSettings, exc: BaseException) -> PostgresConnectError:
    """A one-line error naming the host and sslmode (never the DSN: it may hold a
    password), with a hint for the TLS failures."""
    where = describe_hosts(dsn_hosts(settings.dsn))
    mode = effective_sslmode(settings)
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    hint = ""
    if "rejected SSL upgrade" in text:
        hint = (
            f": the server does not accept TLS, but sslmode={mode} requires it (enable ssl "
            "on the server, or lower CONVEYOR_DB_SSLMODE)"
        )
    elif isinstance(exc, ssl.SSLCertVerificationError):
        hint = (
            f": TLS handshake failed, the server's certificate is not trusted "
            f"({exc.verify_message}): check CONVEYOR_DB_SSLROOTCERT"
        )
    elif isinstance(exc, ssl.SSLError):
        hint = f": TLS handshake failed ({exc.reason})"
    return PostgresConnectError(
        f"cannot connect to Postgres at {where} (sslmode={mode}): {text}{hint}"
    )


@asynccontextmanager
async def postgres_connection(settings: CommonSettings) -> AsyncIterator[asyncpg.Connection]:
    """One connection to ``settings.dsn`` with the settings' TLS (for migrations)."""
    try:
        conn = await asyncpg.connect(
            settings.dsn, ssl=postgres_ssl(settings), timeout=settings.db_connect_timeout
        )
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise _connect_error(settings, exc) from exc
    try:
        yield conn
    finally:
        await conn.close()


async def postgres_pool(settings: CommonSettings, *, min_size: int = 1) -> asyncpg.Pool[Any]:
    """A connection pool on ``settings.dsn`` with the settings' TLS, pool size and
    timeouts, for the processes that speak SQL of their own (the build-event ingest and
    its web UI); the task queue's services open theirs through :func:`open_broker`."""
    server_settings: dict[str, str] = {}
    if settings.db_statement_timeout:
        server_settings["statement_timeout"] = str(
            max(1, round(settings.db_statement_timeout * 1000))
        )
    try:
        pool = await asyncpg.create_pool(
            settings.dsn,
            min_size=min(min_size, settings.db_pool_size),
            max_size=settings.db_pool_size,
            ssl=postgres_ssl(settings),
            server_settings=server_settings,
            command_timeout=settings.db_command_timeout or None,
            timeout=settings.db_connect_timeout,
        )
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise _connect_error(settings, exc) from exc
    assert pool is not None
    return pool


async def open_broker(
    settings: CommonSettings, clock: Clock | None = None, *, migrate: bool | None = None
) -> Broker:
    """A connected broker: ``memory`` or ``postgres`` (on ``settings.dsn``, over TLS as the
    ``db_ssl*`` settings say), inside an
    :class:`~conveyor_broker.encrypted.EncryptedBroker` when encryption keys are
    configured (``encryption_keys`` or ``encryption_keys_file``).

    For postgres, pending migrations are applied first when ``migrate`` (default:
    ``settings.auto_migrate``) is true; that is safe with several processes starting at
    once (the migrator takes an advisory lock).
    """
    keyring = settings.encryption_keyring()
    broker = await _open_inner(settings, clock or SystemClock(), migrate=migrate)
    if keyring is None:
        return broker
    from conveyor_broker.encrypted import EncryptedBroker

    # Key ids only: key material is never logged.
    logger.info("broker.encrypted primary_key=%s keys=%s", keyring.primary, ",".join(keyring.ids))
    return EncryptedBroker(broker, keyring)


async def _open_inner(settings: CommonSettings, clock: Clock, *, migrate: bool | None) -> Broker:
    if settings.broker == "memory":
        from conveyor_broker.memory import MemoryBroker

        logger.info("broker.opened driver=memory")
        return MemoryBroker(clock)
    from conveyor_broker.postgres import PostgresBroker
    from conveyor_broker.postgres import migrate as apply_migrations

    if settings.auto_migrate if migrate is None else migrate:
        async with postgres_connection(settings) as conn:
            applied = await apply_migrations(conn)
        logger.info("broker.migrated applied=%s", applied)
    try:
        broker = await PostgresBroker.connect(
            settings.dsn,
            clock,
            max_size=settings.db_pool_size,
            ssl=postgres_ssl(settings),
            statement_timeout=settings.db_statement_timeout,
            command_timeout=settings.db_command_timeout,
            acquire_timeout=settings.db_acquire_timeout,
            connect_timeout=settings.db_connect_timeout,
        )
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise _connect_error(settings, exc) from exc
    logger.info(
        "broker.opened driver=postgres pool=%d sslmode=%s statement_timeout=%s "
        "command_timeout=%s acquire_timeout=%s",
        settings.db_pool_size,
        effective_sslmode(settings),
        settings.db_statement_timeout,
        settings.db_command_timeout,
        settings.db_acquire_timeout,
    )
    return broker
