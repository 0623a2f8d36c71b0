"""``conveyor migrate``: pending migrations one by one, with a progress bar."""

from __future__ import annotations

from conveyor_broker.postgres import migrate, migration_status
from rich.progress import Progress


async def run_migrations(dsn: str, *, show_progress: bool = True) -> list[int]:
    """Apply every pending migration in order; return the versions applied."""
    pending = [m.version for m in await migration_status(dsn) if m.applied_at is None]
    applied: list[int] = []
    with Progress(disable=not show_progress or not pending) as progress:
        bar = progress.add_task("migrating", total=len(pending))
        for version in pending:
            applied += await migrate(dsn, target=version)
            progress.advance(bar)
    return applied
