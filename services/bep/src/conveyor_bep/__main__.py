"""``conveyor-bep``: run the Build Event Protocol ingest, migrate its schema, manage
projects and API keys.

    conveyor-bep serve [--port 8985 ...]          # settings: flags or CONVEYOR_* variables
    conveyor-bep migrate
    conveyor-bep project create SLUG [--name N] [--max-streams N] [--max-unacked N]
    conveyor-bep key create PROJECT [--name N]    # prints the key once
    conveyor-bep key revoke KEY_ID
    conveyor-bep prune                            # the CAS sink's nightly prune

Every command reads ``CONVEYOR_DSN`` (and the other Postgres settings) like the services.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from conveyor_runtime import health
from conveyor_runtime.broker_factory import postgres_pool
from conveyor_runtime.nats_connect import NatsSecurity, close_nats, connect_nats
from conveyor_runtime.service import service_main
from conveyor_runtime.settings import BepSettings
from conveyor_runtime.tls import postgres_ssl

from conveyor_bep.blobs import prune
from conveyor_bep.cas import CasConfig
from conveyor_bep.ingest import IngestLimits
from conveyor_bep.keys import KeyCache, create_key, create_project, revoke_key
from conveyor_bep.live import LivePublisher
from conveyor_bep.server import BepServer
from conveyor_bep.store import BEP_MIGRATIONS, upkeep
from conveyor_bep.stores import open_store

logger = logging.getLogger(__name__)


async def _upkeep_loop(pool: Any, settings: BepSettings, cas: CasConfig | None) -> None:
    while True:
        try:
            async with pool.acquire() as conn:
                await upkeep(
                    conn,
                    datetime.now(UTC).date(),
                    segment_days=settings.bep_segment_retention_days,
                    build_days=settings.bep_build_retention_days,
                )
                if cas is not None:
                    await prune(conn, cas.root, datetime.now(UTC), store=cas.store)
        except Exception:
            logger.exception("bep.upkeep.failed")
        await asyncio.sleep(settings.bep_upkeep_interval)


def _cas_config(settings: BepSettings) -> CasConfig | None:
    """The CAS sink's config (None: no sink). With S3 the blob root only stages uploads."""
    configured = open_store(settings)
    if configured is None:
        return None
    return CasConfig(
        configured.root,
        upload_ttl=timedelta(hours=settings.bep_upload_ttl_hours),
        max_blob_bytes=settings.bep_max_blob_bytes,
        max_batch_bytes=min(4 * 1024 * 1024, settings.bep_max_message),
        store=configured.store,
    )


async def serve(settings: BepSettings, stop: asyncio.Event) -> None:
    """Run the ingest until ``stop`` is set."""
    if settings.auto_migrate:
        await BEP_MIGRATIONS.migrate(settings.dsn)
    pool = await postgres_pool(settings)
    nc = None
    live: LivePublisher | None = None
    cas = _cas_config(settings)
    try:
        keys = KeyCache(pool, ttl=settings.bep_key_cache_ttl)
        if settings.bep_use_nats:
            nc = await connect_nats(
                settings.nats_url, name="bep", security=NatsSecurity.from_settings(settings)
            )
            await keys.subscribe(nc, settings.subject_prefix)
            live = LivePublisher(nc, settings.subject_prefix)
            live.start()
        tls = (settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        server = BepServer(
            pool,
            keys,
            host=settings.host,
            port=settings.port,
            shards=settings.bep_writer_shards,
            commit_interval=settings.bep_commit_interval,
            limits=IngestLimits(
                settings.bep_batch_window, settings.bep_batch_events, settings.bep_batch_bytes
            ),
            max_message=settings.bep_max_message,
            tls=tls if settings.tls_cert and settings.tls_key else None,  # type: ignore[arg-type]
            on_committed=live.committed if live is not None else None,
            cas=cas,
        )
        port = await server.start()
        print(f"conveyor-bep listening on {settings.host}:{port}", flush=True)
        background = [asyncio.ensure_future(_upkeep_loop(pool, settings, cas))]
        if settings.health_file:
            background.append(
                asyncio.ensure_future(health.beat(settings.health_file, nc, health.PoolProbe(pool)))
            )
        await stop.wait()
        for task in background:
            task.cancel()
        for task in background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await server.stop(settings.stop_grace / 2)
    finally:
        if live is not None:
            await live.stop()
        if nc is not None:
            await close_nats(nc)
        if cas is not None and cas.store is not None:
            cas.store.close()
        await pool.close()


async def _admin(args: argparse.Namespace, settings: BepSettings) -> int:
    conn = await asyncpg.connect(settings.dsn, ssl=postgres_ssl(settings))
    try:
        if args.command == "migrate":
            applied = await BEP_MIGRATIONS.migrate(conn)
            print(f"applied {applied}" if applied else "up to date")
            return 0
        await BEP_MIGRATIONS.migrate(conn)
        if args.command == "prune":
            cas = _cas_config(settings)
            if cas is None:
                print("conveyor-bep: no CONVEYOR_BEP_BLOB_ROOT: nothing to prune", file=sys.stderr)
                return 2
            try:
                result = await prune(conn, cas.root, datetime.now(UTC), store=cas.store)
            finally:
                if cas.store is not None:
                    cas.store.close()
            print(
                f"pruned {result.blobs} blobs ({result.bytes} bytes),"
                f" {result.stale_uploads} stale uploads"
            )
            return 0
        if args.command == "project":
            project_id = await create_project(
                conn,
                args.slug,
                name=args.name,
                max_streams=args.max_streams,
                max_unacked=args.max_unacked,
            )
            print(f"project {args.slug} created (id {project_id})")
            return 0
        if args.action == "create":
            issued = await create_key(conn, args.project, name=args.name or "")
            print(issued.key)
            return 0
        nc = None
        if settings.bep_use_nats:
            nc = await connect_nats(
                settings.nats_url, name="bep-admin", security=NatsSecurity.from_settings(settings)
            )
        try:
            revoked = await revoke_key(conn, args.key_id, nc=nc, prefix=settings.subject_prefix)
        finally:
            if nc is not None:
                await close_nats(nc)
        print("revoked" if revoked else f"no live key {args.key_id}")
        return 0 if revoked else 1
    finally:
        await conn.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor-bep", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the ingest (flags: the service settings)", add_help=False)
    sub.add_parser("migrate", help="apply the ingest's schema migrations")
    project = sub.add_parser("project", help="create a project")
    project_sub = project.add_subparsers(dest="action", required=True)
    create = project_sub.add_parser("create")
    create.add_argument("slug")
    create.add_argument("--name")
    create.add_argument("--max-streams", type=int, default=200)
    create.add_argument("--max-unacked", type=int, default=5000)
    key = sub.add_parser("key", help="issue or revoke an API key")
    key_sub = key.add_subparsers(dest="action", required=True)
    key_create = key_sub.add_parser("create")
    key_create.add_argument("project")
    key_create.add_argument("--name")
    key_revoke = key_sub.add_parser("revoke")
    key_revoke.add_argument("key_id")
    sub.add_parser(
        "prune",
        help="delete CAS uploads no build pinned within their TTL and blobs whose builds "
        "retention deleted (meant to run nightly)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``conveyor-bep`` command."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "serve":
        return service_main(BepSettings, serve, args_list[1:], name="bep")
    args = _parser().parse_args(args_list)
    try:
        settings = BepSettings()
    except ValueError as exc:
        print(f"conveyor-bep: invalid settings: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_admin(args, settings))
    except ValueError as exc:
        print(f"conveyor-bep: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
