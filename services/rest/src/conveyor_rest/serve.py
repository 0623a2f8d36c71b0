"""The REST app on uvicorn inside an event loop that runs other things: ``conveyor dev``,
and ``python -m conveyor_rest`` (:mod:`conveyor_rest.__main__`), with the queue sampler
behind the dashboard's charts beside it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from conveyor_rest.app import create_app
from conveyor_rest.history import DEFAULT_INTERVAL, Clock, QueueHistory, QueueSampler
from conveyor_rest.link import ApiLink, ApiTarget

#: Seconds a graceful stop waits for open requests before cutting them.
GRACE = 5


class Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the process running it decides
    what SIGTERM and SIGINT do (set :attr:`should_exit`), and uvicorn does not raise the
    signal again once it has stopped."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Install nothing (see the class)."""
        yield


@dataclass
class RestServer:
    """A running REST server: its base URL, its sampler (None: not sampling), and how
    to stop it."""

    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]
    link: ApiLink
    history: QueueHistory
    sampler: QueueSampler | None = None

    async def stop(self) -> None:
        """Stop accepting, finish open requests (event streams are cut), stop sampling,
        close the channel to the api, and return."""
        self.server.should_exit = True
        self.server.force_exit = True
        try:
            await self.task
        finally:
            if self.sampler is not None:
                await self.sampler.stop()
            await self.link.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (0: any free port); OSError if it cannot be
    bound. Connections wait in its backlog until uvicorn accepts them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


async def start_rest(
    target: str | ApiTarget,
    host: str,
    port: int,
    *,
    sample_interval: float = DEFAULT_INTERVAL,
    token: str | None = None,
    clock: Clock = time.time,
    ssl: dict[str, Any] | None = None,
    log_level: str = "warning",
) -> RestServer:
    """Serve the REST API for the api at ``target`` on ``host:port`` (0: any free port),
    and sample every queue every ``sample_interval`` seconds (0: never) with ``token``
    for the dashboard's charts. ``ssl`` holds uvicorn's ``ssl_certfile`` and
    ``ssl_keyfile`` for HTTPS. Raises OSError if the port cannot be bound."""
    sock = bind(host, port)
    link = ApiLink(target)
    history = QueueHistory(interval=sample_interval)
    config = uvicorn.Config(
        create_app(link, history=history),
        log_level=log_level,
        log_config=None,
        access_log=False,
        lifespan="off",
        # A stop waits this long for open requests (an event stream never ends).
        timeout_graceful_shutdown=GRACE,
        **(ssl or {}),
    )
    server = Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    sampler = None
    if sample_interval > 0:
        sampler = QueueSampler(
            link.admin, history, interval=sample_interval, token=token, clock=clock
        )
        sampler.start()
    bound = sock.getsockname()[1]
    scheme = "https" if ssl else "http"
    shown = f"[{host}]" if ":" in host else host
    return RestServer(
        url=f"{scheme}://{shown}:{bound}",
        server=server,
        task=task,
        link=link,
        history=history,
        sampler=sampler,
    )
