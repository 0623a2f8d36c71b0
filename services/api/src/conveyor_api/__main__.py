"""``python -m conveyor_api [flags]``: run the api service until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from conveyor_runtime.service import open_runtime, service_main
from conveyor_runtime.settings import ApiSettings

from conveyor_api.server import ApiServer


async def serve(settings: ApiSettings, stop: asyncio.Event) -> None:
    """Open the broker and NATS, serve until ``stop`` is set, then stop gracefully."""
    async with open_runtime(settings, name="api") as rt:
        server = ApiServer(settings, rt.broker, rt.nc, rt.clock, event_gate=rt.gate)
        await server.start()
        await stop.wait()
        await server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and environment, then serve until SIGTERM/SIGINT; the exit code."""
    return service_main(ApiSettings, serve, argv, name="api")


if __name__ == "__main__":
    sys.exit(main())
