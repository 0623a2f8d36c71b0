"""``python -m conveyor_webhook [flags]``: run one webhook instance until SIGTERM/SIGINT.

Flags mirror WebhookSettings (``--help`` lists them); ``CONVEYOR_*`` variables too.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from conveyor_runtime.service import open_runtime, service_main
from conveyor_runtime.settings import WebhookSettings

from conveyor_webhook.manager import WebhookManager


async def serve(settings: WebhookSettings, stop: asyncio.Event) -> None:
    """Run a WebhookManager until ``stop`` is set, then drain its gateways."""
    async with open_runtime(settings, name="webhook") as rt:
        manager = WebhookManager(settings, rt.broker, rt.nc, rt.clock, health=rt.health)
        await manager.start()
        try:
            await stop.wait()
        finally:
            await manager.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and environment, then serve until SIGTERM/SIGINT; the exit code."""
    return service_main(WebhookSettings, serve, argv, name="webhook")


if __name__ == "__main__":
    sys.exit(main())
