"""``conveyor-bep-web``: the build-event web UI and its JSON API.

    conveyor-bep-web serve [--port 8986 ...]     # settings: flags or CONVEYOR_* variables

It reads the ingest's Postgres schema (``CONVEYOR_DSN``; applies the ingest's migrations
when ``CONVEYOR_AUTO_MIGRATE``) and follows running builds through the ingest's digests
on NATS (``CONVEYOR_BEP_WEB_USE_NATS``; off: pages poll Postgres).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence

from conveyor_bep.store import BEP_MIGRATIONS
from conveyor_runtime import health
from conveyor_runtime.broker_factory import postgres_pool
from conveyor_runtime.nats_connect import NatsSecurity, close_nats, connect_nats
from conveyor_runtime.service import service_main
from conveyor_runtime.settings import BepWebSettings

from conveyor_bep_web.serve import start_web

logger = logging.getLogger(__name__)


async def serve(settings: BepWebSettings, stop: asyncio.Event) -> None:
    """Serve the web UI until ``stop`` is set."""
    if settings.auto_migrate:
        await BEP_MIGRATIONS.migrate(settings.dsn)
    pool = await postgres_pool(settings)
    nc = None
    try:
        if settings.bep_web_use_nats:
            nc = await connect_nats(
                settings.nats_url, name="bep-web", security=NatsSecurity.from_settings(settings)
            )
        web = await start_web(settings, pool, nc)
        print(f"conveyor-bep-web listening on {web.url}", flush=True)
        logger.info("bep_web.started url=%s nats=%s", web.url, "on" if nc else "off")
        beat = (
            asyncio.ensure_future(health.beat(settings.health_file, nc, health.PoolProbe(pool)))
            if settings.health_file
            else None
        )
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([stopped, web.task], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if beat is not None:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
        await web.stop()
        if web.app.state.blobs is not None:
            web.app.state.blobs.close()
    finally:
        if nc is not None:
            await close_nats(nc)
        await pool.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor-bep-web", description=(__doc__ or "").split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the web UI (flags: the service settings)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``conveyor-bep-web`` command."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "serve":
        return service_main(BepWebSettings, serve, args_list[1:], name="bep-web")
    _parser().parse_args(args_list)
    return 2


if __name__ == "__main__":
    sys.exit(main())
