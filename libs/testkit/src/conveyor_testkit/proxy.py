"""A TCP proxy that can wedge its connections: the half-open link of a real outage.

:class:`WedgeProxy` forwards every connection to a target (Postgres, say). ``wedge()``
stops forwarding on the connections open at that moment without closing them, so each
side keeps a socket that accepts writes and never answers: what a peer behind a dead
NAT entry or a frozen host looks like. Connections made afterwards are forwarded as
usual (``wedge(new_connections=True)`` wedges those too), so a client that gives the
stuck link up and reconnects gets through.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

__all__ = ["WedgeProxy"]


@dataclass(slots=True)
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    pipes: list[asyncio.Task[None]] = field(default_factory=list)


class WedgeProxy:
    """Forward ``127.0.0.1:<port>`` to ``target_host:target_port``; see the module doc."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._links: list[_Link] = []
        self._wedge_new = False
        #: Every link ever wedged keeps its sockets open until :meth:`close`.
        self._wedged: list[_Link] = []
        self.port = 0

    async def start(self) -> WedgeProxy:
        """Listen on a free loopback port (:attr:`port`)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aenter__(self) -> WedgeProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connections(self) -> int:
        """Connections being forwarded now (not wedged, not closed)."""
        return len(self._links)

    def wedge(self, *, new_connections: bool = False) -> int:
        """Stop forwarding on every open connection, leaving it open; with
        ``new_connections`` also on those made from now on. The number wedged."""
        self._wedge_new = new_connections
        links, self._links = self._links, []
        for link in links:
            for pipe in link.pipes:
                pipe.cancel()
        self._wedged += links
        return len(links)

    def unwedge_new(self) -> None:
        """Forward connections made from now on again."""
        self._wedge_new = False

    async def close(self) -> None:
        """Stop listening and close every connection, wedged or not."""
        if self._server is not None:
            self._server.close()
        for link in self._links + self._wedged:
            for pipe in link.pipes:
                pipe.cancel()
            for writer in (link.client, link.upstream):
                writer.close()
        self._links.clear()
        self._wedged.clear()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        link = _Link(writer, up_writer)
        if self._wedge_new:
            self._wedged.append(link)
            return
        link.pipes = [
            asyncio.create_task(self._pipe(reader, up_writer, link)),
            asyncio.create_task(self._pipe(up_reader, writer, link)),
        ]
        self._links.append(link)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link
    ) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        # One side ended on its own (not wedged): end the other, as a plain proxy would.
        if link in self._links:
            self._links.remove(link)
        link.client.close()
        link.upstream.close()
