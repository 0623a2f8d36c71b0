"""``conveyor migrate``: pending migrations one by one, with a progress bar."""

from __future__ import annotations

from conveyor_broker.postgres import migrate, migration_status
from conveyor_runtime.broker_factory import postgres_connection
from conveyor_runtime.settings import CommonSettings
from rich.progress import Progress


async def run_migrations(settings: CommonSettings, *, show_progress: bool = True) -> list[int]:
    """Apply every pending migration in order on ``settings.dsn`` (over TLS as the
    ``db_ssl*`` settings say); return the versions applied."""
    async with postgres_connection(settings) as conn:
        pending = [m.version for m in await migration_status(conn) if m.applied_at is None]
        applied: list[int] = []
        with Progress(disable=not show_progress or not pending) as progress:
            bar = progress.add_task("migrating", total=len(pending))
            for version in pending:
                applied += await migrate(conn, target=version)
                progress.advance(bar)
    return applied
