"""When the task table needs an ANALYZE or a VACUUM sooner than autovacuum gives it one.

A queue's table swings from empty to hundreds of thousands of rows within seconds, and
every task leaves two dead row versions behind (PENDING -> ACTIVE -> COMPLETED).
Autovacuum looks at a table about once a minute and only after a fifth of it changed, so
right after a burst two things go wrong (both measured after 100k tasks through a table
that started empty, one task at a time):

- Query plans cached while the table was tiny stay in use: a prepared ack joined to a
  sequential scan took 14-15 ms instead of 0.6 ms until something invalidated it.
- The lease's index scan steps over every dead entry the burst left in the due index:
  1.4-1.5 ms instead of 0.5-0.6 ms per lease until a vacuum removes them.

An ANALYZE (about 90 ms there) makes every session re-plan; a VACUUM (about 60 ms there)
removes the dead entries. The maintenance service's storage role asks for both through
:meth:`~conveyor_broker.interface.Broker.upkeep_storage`, with the thresholds below:
checked every few seconds instead of every minute, and at most once per
:data:`MIN_INTERVAL`. (Autovacuum's own defaults: ANALYZE after 50 rows plus a tenth of the
table changed, VACUUM after 50 plus a fifth dead.)

A manual VACUUM does not give way to other lock requests as autovacuum does, so upkeep
never waits for the table (SKIP_LOCKED), holds the migration lock while it runs (a
migration waits for it instead of queueing a table lock that would hold up every insert
and update), and runs without the session's statement timeout (a timeout would cancel it
every time, redoing the work each check). A run that fails backs off, doubling up to
:data:`MAX_BACKOFF`. :class:`TableUpkeep` does all this for one broker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import asyncpg

from conveyor_broker.postgres.migrations import MIGRATION_LOCK_KEY
from conveyor_broker.types import StorageUpkeep

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    Pool = asyncpg.Pool[asyncpg.Record]

logger = logging.getLogger(__name__)

#: The table the hot path lives in; the others stay small.
TABLE = "conveyor_tasks"

#: Fewest changed (or dead) rows worth an ANALYZE (or a VACUUM) at all.
MIN_ROWS = 1000
#: ANALYZE once the rows written since the last one reach this share of the rows the
#: planner believes the table holds (a table that grew by half, or turned over by half).
ANALYZE_SHARE = 0.5
#: VACUUM once the dead row versions reach this share of the live rows.
VACUUM_SHARE = 0.2
#: Least time between two runs that did something: each ANALYZE makes every session
#: re-plan, and a table with few live rows and a high throughput would otherwise get
#: one every check.
MIN_INTERVAL = timedelta(seconds=10)
#: Longest wait after runs that failed (the wait doubles from MIN_INTERVAL).
MAX_BACKOFF = timedelta(hours=1)

#: The counters the decision reads, in one round trip. ``planned_rows`` is what the
#: planner believes (-1 before the first ANALYZE or VACUUM); ``vacuums`` and ``analyzes``
#: count the manual runs that completed (a skipped one does not count); ``maintainable``
#: is whether this role may ANALYZE and VACUUM the table: a member of the role that owns
#: it or the database (a superuser is every role's member), or, from PostgreSQL 17, a
#: holder of MAINTAIN on it. Anyone else would get a warning and nothing done.
STATS = f"""
SELECT c.reltuples::float8 AS planned_rows,
       coalesce(s.n_live_tup, 0) AS live_rows,
       coalesce(s.n_dead_tup, 0) AS dead_rows,
       coalesce(s.n_mod_since_analyze, 0) AS changed_rows,
       coalesce(s.vacuum_count, 0) AS vacuums,
       coalesce(s.analyze_count, 0) AS analyzes,
       pg_has_role(c.relowner, 'USAGE')
         OR pg_has_role((SELECT d.datdba FROM pg_database d
                         WHERE d.datname = current_database()), 'USAGE')
         OR CASE WHEN current_setting('server_version_num')::int >= 170000
                 THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END
         AS maintainable
FROM pg_class c LEFT JOIN pg_stat_all_tables s ON s.relid = c.oid
WHERE c.oid = '{TABLE}'::regclass
"""

# SKIP_LOCKED: when autovacuum (or an operator) is already at it, do not queue up behind
# it; that run does the same work.
ANALYZE = f"ANALYZE (SKIP_LOCKED) {TABLE}"
VACUUM = f"VACUUM (SKIP_LOCKED) {TABLE}"
VACUUM_ANALYZE = f"VACUUM (ANALYZE, SKIP_LOCKED) {TABLE}"
#: The client-side timeout of the upkeep statement: a day (asyncpg has no "none" per
#: call once the pool sets a command timeout).
UNTIMED = 86400.0


@dataclass(frozen=True, slots=True)
class TableStats:
    """The task table's counters, as :data:`STATS` reads them."""

    planned_rows: float
    live_rows: int
    dead_rows: int
    changed_rows: int
    maintainable: bool = True
    vacuums: int = 0
    analyzes: int = 0


def needs_analyze(stats: TableStats) -> bool:
    """True when the planner's statistics are far enough behind the table to re-gather."""
    return stats.changed_rows >= max(MIN_ROWS, ANALYZE_SHARE * max(stats.planned_rows, 0.0))


def needs_vacuum(stats: TableStats, floor: int) -> bool:
    """True when enough dead row versions have piled up to remove.

    ``floor`` is how many dead rows the last VACUUM left behind (still visible to an open
    transaction, so it could not remove them): only the ones beyond it count, or a
    long-running transaction elsewhere would have the table vacuumed on every check.
    """
    return stats.dead_rows - floor >= max(MIN_ROWS, VACUUM_SHARE * stats.live_rows)


def upkeep_statement(stats: TableStats, floor: int) -> str | None:
    """The statement to run now (ANALYZE, VACUUM or both), or None."""
    if not stats.maintainable:
        return None
    analyze = needs_analyze(stats)
    if needs_vacuum(stats, floor):
        return VACUUM_ANALYZE if analyze else VACUUM
    return ANALYZE if analyze else None


def backoff(failures: int) -> timedelta:
    """The wait after ``failures`` failed runs in a row (1 or more)."""
    doubled: timedelta = MIN_INTERVAL * 2 ** min(max(failures - 1, 0), 16)
    return min(MAX_BACKOFF, doubled)


class TableUpkeep:
    """One broker's storage upkeep: reads the counters, runs what
    :func:`upkeep_statement` asks for, and paces itself (at most once per MIN_INTERVAL
    after acting, backing off after failures)."""

    def __init__(self) -> None:
        # Dead rows the last VACUUM could not remove, when the next check may act, failed
        # runs in a row, and whether the role was refused.
        self._dead_floor = 0
        self._resume_at = datetime.min.replace(tzinfo=UTC)
        self._failures = 0
        self._refused = False

    async def check(self, pool: Pool, now: datetime) -> StorageUpkeep:
        """ANALYZE and/or VACUUM the task table when its counters say it drifted; one
        cheap read of them otherwise (nothing at all while resting)."""
        if now < self._resume_at:
            return StorageUpkeep()
        stats = await _read_stats_untimed(pool)
        self._dead_floor = min(self._dead_floor, stats.dead_rows)
        seen = StorageUpkeep(
            live_rows=stats.live_rows, dead_rows=stats.dead_rows, changed_rows=stats.changed_rows
        )
        if not stats.maintainable:
            if not self._refused:
                self._refused = True
                logger.warning(
                    "broker.storage_upkeep_not_permitted table=%s: this role neither owns "
                    "the table or the database nor may maintain it; autovacuum alone "
                    "keeps it up",
                    TABLE,
                )
            return seen
        statement = upkeep_statement(stats, self._dead_floor)
        if statement is None:
            return seen
        try:
            after = await _run(pool, statement)
        except (asyncpg.PostgresError, OSError) as exc:
            self._failures += 1
            wait = backoff(self._failures)
            self._resume_at = now + wait
            logger.warning(
                "broker.storage_upkeep_failed statement=%r failures=%d retry_in=%s error=%r",
                statement,
                self._failures,
                wait,
                exc,
            )
            return seen
        if after is None:
            return seen  # a migration holds the lock: next check
        vacuumed = after.vacuums > stats.vacuums
        analyzed = after.analyzes > stats.analyzes
        if vacuumed:
            self._dead_floor = after.dead_rows
        if vacuumed or analyzed:
            self._failures = 0
            self._resume_at = now + MIN_INTERVAL
        logger.debug(
            "broker.storage_upkeep statement=%r analyzed=%s vacuumed=%s",
            statement,
            analyzed,
            vacuumed,
        )
        return StorageUpkeep(
            analyzed=analyzed,
            vacuumed=vacuumed,
            live_rows=stats.live_rows,
            dead_rows=stats.dead_rows,
            changed_rows=stats.changed_rows,
        )


async def _run(pool: Pool, statement: str) -> TableStats | None:
    """Run ``statement`` holding the migration lock, without a statement timeout; the
    table's counters after it. None, running nothing, while a migration holds the lock."""
    async with pool.acquire() as conn:
        if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", MIGRATION_LOCK_KEY):
            return None
        try:
            await conn.execute("SET statement_timeout = 0")
            try:
                # Clear of the client's command timeout as well: a VACUUM of a big
                # table may rightly run for longer than any statement should.
                await conn.execute(statement, timeout=UNTIMED)
            finally:
                await conn.execute("RESET statement_timeout")
            return await read_stats(conn)
        finally:
            try:
                await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
            except Exception:
                # Ending the session is what releases the lock then.
                conn.terminate()
                raise


async def _read_stats_untimed(pool: Pool) -> TableStats:
    """:func:`read_stats` clear of the session's statement timeout, like the upkeep itself:
    under load even this read can outlast a tight one, and upkeep would then never run."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL statement_timeout = 0")
        return await read_stats(conn)


async def read_stats(on: Pool | PoolConnectionProxy[asyncpg.Record]) -> TableStats:
    """The task table's counters (:data:`STATS`)."""
    row = await on.fetchrow(STATS)
    assert row is not None  # the regclass cast raises for a missing table
    return TableStats(
        planned_rows=row["planned_rows"],
        live_rows=row["live_rows"],
        dead_rows=row["dead_rows"],
        changed_rows=row["changed_rows"],
        maintainable=row["maintainable"],
        vacuums=row["vacuums"],
        analyzes=row["analyzes"],
    )
