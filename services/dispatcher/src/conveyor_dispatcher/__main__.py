"""``python -m conveyor_dispatcher [flags]``: run one dispatcher instance.

Flags mirror DispatcherSettings (``--help`` lists them); ``CONVEYOR_*`` variables too.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from conveyor_runtime.service import open_runtime, service_main
from conveyor_runtime.settings import DispatcherSettings

from conveyor_dispatcher.dispatcher import Dispatcher


async def serve(settings: DispatcherSettings, stop: asyncio.Event) -> None:
    """Run a Dispatcher until ``stop`` is set."""
    async with open_runtime(settings, name="dispatcher") as rt:
        dispatcher = Dispatcher(settings, rt.broker, rt.nc, rt.clock, health=rt.health)
        await dispatcher.start()
        try:
            await stop.wait()
        finally:
            await dispatcher.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and environment, then serve until SIGTERM/SIGINT; the exit code."""
    return service_main(DispatcherSettings, serve, argv, name="dispatcher")


if __name__ == "__main__":
    sys.exit(main())
