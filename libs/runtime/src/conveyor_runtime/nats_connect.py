"""Connect to NATS the way every service does: named, reconnecting forever, logged."""

from __future__ import annotations

import logging

from nats.aio.client import Client as NatsClient

logger = logging.getLogger(__name__)

__all__ = ["NatsClient", "close_nats", "connect_nats"]


def _servers(url: str) -> list[str]:
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError("no NATS server URL given")
    return servers


def _server(nc: NatsClient) -> str:
    url = nc.connected_url
    return url.netloc if url is not None else "?"


#: Seconds a draining close waits for pending messages before it closes anyway.
DRAIN_TIMEOUT = 5.0


async def connect_nats(
    url: str,
    *,
    name: str,
    reconnect_wait: float = 1.0,
    connect_timeout: float = 2.0,
) -> NatsClient:
    """Connect to the comma-separated NATS ``url`` list as ``name``.

    The client never gives up: the first connect and every reconnect retry forever
    (every ``reconnect_wait`` seconds), because every message we send is a hint and a
    service without NATS can only wait. Errors and connection changes are logged.
    """

    async def on_error(exc: Exception) -> None:
        logger.warning("nats.error name=%s error=%r", name, exc)

    async def on_disconnected() -> None:
        logger.warning("nats.disconnected name=%s", name)

    async def on_reconnected() -> None:
        logger.info("nats.reconnected name=%s server=%s", name, _server(nc))

    async def on_closed() -> None:
        logger.info("nats.closed name=%s", name)

    nc = NatsClient()
    await nc.connect(
        servers=_servers(url),
        name=name,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=reconnect_wait,  # type: ignore[arg-type]
        connect_timeout=connect_timeout,  # type: ignore[arg-type]
        # A drain at shutdown waits for every subscription's pending messages; they are
        # hints, so a stop waits this long at most (the client's default is 30 s).
        drain_timeout=DRAIN_TIMEOUT,  # type: ignore[arg-type]
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
        closed_cb=on_closed,
    )
    logger.info("nats.connected name=%s server=%s", name, _server(nc))
    return nc


async def close_nats(nc: NatsClient, *, drain: bool = True) -> None:
    """Close ``nc``, draining subscriptions and buffered publishes first when ``drain``.

    Never raises: a connection that is already broken is simply dropped.
    """
    if nc.is_closed:
        return
    if drain and nc.is_connected:
        try:
            await nc.drain()
            return
        except Exception as exc:
            logger.info("nats.drain_failed error=%r", exc)
    try:
        await nc.close()
    except Exception as exc:
        logger.info("nats.close_failed error=%r", exc)
