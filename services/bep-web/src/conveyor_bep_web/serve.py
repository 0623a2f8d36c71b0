"""The web app on uvicorn inside an event loop that runs other things (the service's
NATS connection, a test's ingest): :func:`start_web` binds, serves in a task and
returns a handle to stop it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import uvicorn

# uvicorn inside a loop that runs other things: the REST service's pieces, shared.
from conveyor_rest.serve import Server, bind
from conveyor_runtime.settings import BepWebSettings
from fastapi import FastAPI

from conveyor_bep_web.app import create_app

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient

#: Seconds a graceful stop waits for open requests (live streams are cut after it).
GRACE = 2


@dataclass
class WebServer:
    """A running web server: its base URL, its app, and how to stop it."""

    url: str
    app: FastAPI
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        """Stop accepting, give open requests :data:`GRACE` seconds, and return."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), GRACE + 1)
        except TimeoutError:
            self.server.force_exit = True
            await self.task


async def start_web(
    settings: BepWebSettings,
    pool: Any,
    nc: NatsClient | None = None,
    *,
    app: FastAPI | None = None,
    log_level: str = "warning",
) -> WebServer:
    """Serve ``app`` (default: :func:`create_app` of the arguments) on
    ``settings.host:settings.port`` (0: any free port). Raises OSError if the port cannot
    be bound."""
    sock = bind(settings.host, settings.port)
    app = app if app is not None else create_app(settings, pool, nc)
    config = uvicorn.Config(
        app,
        log_level=log_level,
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=GRACE,
        ssl_certfile=settings.tls_cert,
        ssl_keyfile=settings.tls_key,
    )
    server = Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    bound = sock.getsockname()[1]
    shown = f"[{settings.host}]" if ":" in settings.host else settings.host
    scheme = "https" if settings.tls_cert else "http"
    return WebServer(url=f"{scheme}://{shown}:{bound}", app=app, server=server, task=task)
