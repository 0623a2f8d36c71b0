"""The REST app on uvicorn inside an event loop that runs other things (``conveyor dev``)."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import uvicorn

from conveyor_rest.app import create_app


@dataclass
class RestServer:
    """A running REST server: its base URL, and how to stop it."""

    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        """Stop accepting, finish open requests (event streams are cut), and return."""
        self.server.should_exit = True
        self.server.force_exit = True
        await self.task


async def start_rest(target: str, host: str, port: int) -> RestServer:
    """Serve the REST API for the api at ``target`` on ``host:port`` (0: any free port).
    Raises OSError if the port cannot be bound."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)  # connections wait in the backlog until uvicorn accepts them
    except OSError:
        sock.close()
        raise
    config = uvicorn.Config(create_app(target), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    bound = sock.getsockname()[1]
    return RestServer(url=f"http://{host}:{bound}", server=server, task=task)
