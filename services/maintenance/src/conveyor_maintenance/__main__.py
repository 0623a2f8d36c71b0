"""``python -m conveyor_maintenance [flags]``: run one maintenance instance.

Flags mirror MaintenanceSettings (``--help`` lists them); ``CONVEYOR_*`` variables too.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from conveyor_runtime.service import open_runtime, service_main
from conveyor_runtime.settings import MaintenanceSettings

from conveyor_maintenance.maintenance import Maintenance


async def serve(settings: MaintenanceSettings, stop: asyncio.Event) -> None:
    """Run a Maintenance instance until ``stop`` is set."""
    async with open_runtime(settings, name="maintenance") as rt:
        maintenance = Maintenance(settings, rt.broker, rt.nc, rt.clock, health=rt.health)
        await maintenance.start()
        try:
            await stop.wait()
        finally:
            await maintenance.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and environment, then serve until SIGTERM/SIGINT; the exit code."""
    return service_main(MaintenanceSettings, serve, argv, name="maintenance")


if __name__ == "__main__":
    sys.exit(main())
