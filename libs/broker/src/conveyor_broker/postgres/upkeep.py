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
removes the dead entries. The maintenance service asks for both through
:meth:`~conveyor_broker.interface.Broker.upkeep_storage`, with the thresholds below:
about as eager as autovacuum's defaults, checked every few seconds instead of every
minute.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The table the hot path lives in; the others stay small.
TABLE = "conveyor_tasks"

#: Fewest changed (or dead) rows worth an ANALYZE (or a VACUUM) at all.
MIN_ROWS = 1000
#: ANALYZE once the rows written since the last one reach this share of the rows the
#: planner believes the table holds (a table that grew by half, or turned over by half).
ANALYZE_SHARE = 0.5
#: VACUUM once the dead row versions reach this share of the live rows.
VACUUM_SHARE = 0.2

#: The counters the decision reads, in one round trip. ``planned_rows`` is what the
#: planner believes (-1 before the first ANALYZE or VACUUM); ``maintainable`` is whether
#: this role may ANALYZE and VACUUM the table (its owner, a member of the owning role, or
#: a superuser: anyone else gets a warning and nothing done).
STATS = f"""
SELECT c.reltuples::float8 AS planned_rows,
       coalesce(s.n_live_tup, 0) AS live_rows,
       coalesce(s.n_dead_tup, 0) AS dead_rows,
       coalesce(s.n_mod_since_analyze, 0) AS changed_rows,
       pg_has_role(c.relowner, 'USAGE') AS maintainable
FROM pg_class c LEFT JOIN pg_stat_all_tables s ON s.relid = c.oid
WHERE c.oid = '{TABLE}'::regclass
"""

# SKIP_LOCKED: when autovacuum (or an operator) is already at it, do not queue up behind
# it; that run does the same work.
ANALYZE = f"ANALYZE (SKIP_LOCKED) {TABLE}"
VACUUM = f"VACUUM (SKIP_LOCKED) {TABLE}"
VACUUM_ANALYZE = f"VACUUM (ANALYZE, SKIP_LOCKED) {TABLE}"


@dataclass(frozen=True, slots=True)
class TableStats:
    """The task table's counters, as :data:`STATS` reads them."""

    planned_rows: float
    live_rows: int
    dead_rows: int
    changed_rows: int
    maintainable: bool = True


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
