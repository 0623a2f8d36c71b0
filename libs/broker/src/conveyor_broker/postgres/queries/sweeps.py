"""Statements of the maintenance sweeps (reap, promote, purge, archive expired) and of
PendingCount and DueQueues.

A sweep takes at most its limit, oldest first, locking with SKIP LOCKED so that two
sweepers (or a sweeper and a worker) never wait on each other.
"""

from __future__ import annotations

from conveyor_broker.postgres.queries import TASK_COLUMNS
from conveyor_broker.types import LEASE_EXPIRED_ERROR

#: Leases expired at now $1 fail, at most $2 of them; $3 is when a retry becomes due (a
#: group's member goes back to AGGREGATING, due with its group then).
REAP_EXPIRED_LEASES = f"""
WITH expired AS (
    SELECT id, lease_expires_at FROM conveyor_tasks
    WHERE state = 'active' AND lease_expires_at <= $1
    ORDER BY lease_expires_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE conveyor_tasks t
SET state = CASE WHEN t.retried >= t.max_retry THEN 'archived'
                 WHEN t.group_key IS NOT NULL THEN 'aggregating'
                 ELSE 'retry' END,
    available_at = CASE WHEN t.retried >= t.max_retry THEN t.available_at
                        ELSE $3::timestamptz END,
    completed_at = CASE WHEN t.retried >= t.max_retry THEN $1::timestamptz END,
    retried = t.retried + 1, last_error = '{LEASE_EXPIRED_ERROR}', updated_at = $1,
    lease_id = NULL, lease_expires_at = NULL, holder = NULL
FROM expired
WHERE t.id = expired.id
RETURNING t.id, t.queue, t.type, t.state, expired.lease_expires_at, t.dependents_pending
"""

#: BeatHolder: holder $1 is alive at now $2.
BEAT_HOLDER = """
INSERT INTO conveyor_holders (holder, seen_at) VALUES ($1, $2)
ON CONFLICT (holder) DO UPDATE SET seen_at = EXCLUDED.seen_at
"""

#: The holders whose last beat is at or before $1, but those in $2. (A small table: one
#: row per api process that ran lately.)
DEAD_HOLDERS = """
SELECT holder FROM conveyor_holders WHERE seen_at <= $1 AND NOT (holder = ANY($2::text[]))
"""

#: The ACTIVE tasks of the dead holders $3 go back to PENDING (a group's member to
#: AGGREGATING) at now $1 (at most $4, by
#: lease expiry), as RELEASE gives a task back; the holders of $3 that hold no ACTIVE
#: task (as the statement's snapshot sees it: before the release) and have not beaten
#: since $2 are forgotten; and the circuit breakers the holders of $3 stored (their
#: gateways' own) are dropped. The tasks are found through
#: conveyor_tasks_lease_expiry_idx (every ACTIVE row): the statement runs only while a
#: holder is dead.
RELEASE_DEAD_HOLDERS = """
WITH dropped_breakers AS (
    DELETE FROM conveyor_breakers b WHERE b.holder = ANY($3::text[])
    RETURNING b.holder
), forgotten AS (
    DELETE FROM conveyor_holders h
    WHERE h.holder = ANY($3::text[]) AND h.seen_at <= $2
      AND NOT EXISTS (
          SELECT 1 FROM conveyor_tasks c WHERE c.state = 'active' AND c.holder = h.holder
      )
    RETURNING h.holder
), orphaned AS (
    SELECT id, holder, lease_expires_at FROM conveyor_tasks
    WHERE state = 'active' AND holder = ANY($3::text[])
    ORDER BY lease_expires_at, id
    LIMIT $4
    FOR UPDATE SKIP LOCKED
)
UPDATE conveyor_tasks t
SET state = CASE WHEN t.group_key IS NOT NULL THEN 'aggregating' ELSE 'pending' END,
    available_at = $1, updated_at = $1,
    lease_id = NULL, lease_expires_at = NULL, holder = NULL
FROM orphaned
WHERE t.id = orphaned.id
RETURNING t.id, t.queue, t.type, orphaned.holder, orphaned.lease_expires_at
"""

#: Due SCHEDULED tasks at now $1 become PENDING, at most $2 of them.
PROMOTE_SCHEDULED = """
WITH due AS (
    SELECT id FROM conveyor_tasks
    WHERE state = 'scheduled' AND available_at <= $1
    ORDER BY available_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE conveyor_tasks t SET state = 'pending', updated_at = $1
FROM due
WHERE t.id = due.id
RETURNING t.id, t.queue, t.type, t.available_at
"""

# Terminal rows go in purge order: oldest purge time (completed_at + the retention that
# applies) first, then id. Each kind of row is read from its own index, in that order,
# only as far as the limit and never past the rows that are due: COMPLETED rows with a
# retention of their own by purge_at (conveyor_tasks_purge_at_idx); COMPLETED rows that
# take the default retention $2 (conveyor_tasks_completed_idx) and ARCHIVED and CANCELED
# rows (conveyor_tasks_ended_idx, retention $3) by completed_at, which for them is purge
# order. Merging the three short lists gives the first $4 overall, so a sweep reads at
# most three times its limit however many rows are retained. Each list's LIMIT is a
# subquery so that the planner, not knowing it, plans for a large one: told "10" or
# "1000" while it guesses (with stale or no statistics) that fewer rows are due, it
# prefers a bitmap scan of every due row and a sort, and a backlog would be sorted whole.
# A row whose dependents are not resolved yet is kept (the resolution needs its state);
# such rows are few and short-lived, so filtering them costs the walk next to nothing.

#: $1 = now, $2 = default retention of COMPLETED rows, $3 = retention of ARCHIVED and
#: CANCELED rows, $4 = limit. Returns how many rows went.
PURGE_TERMINAL = """
WITH own AS (
    SELECT t.id, t.purge_at AS at FROM conveyor_tasks t
    WHERE t.state = 'completed' AND t.purge_at IS NOT NULL AND t.purge_at <= $1
      AND NOT t.dependents_pending
    ORDER BY t.purge_at, t.id
    LIMIT (SELECT $4::integer)
    FOR UPDATE SKIP LOCKED
), by_default AS (
    SELECT t.id,
           t.completed_at
           + coalesce(make_interval(secs => extract(epoch FROM t.retention)::float8),
                      make_interval(secs => extract(epoch FROM $2::interval)::float8)) AS at
    FROM conveyor_tasks t
    WHERE t.state = 'completed' AND t.purge_at IS NULL AND NOT t.dependents_pending
      AND t.completed_at
          <= $1::timestamptz - make_interval(secs => extract(epoch FROM $2::interval)::float8)
      AND (t.retention IS NULL
           OR t.completed_at
              + make_interval(secs => extract(epoch FROM t.retention)::float8) <= $1)
    ORDER BY t.completed_at, t.id
    LIMIT (SELECT $4::integer)
    FOR UPDATE SKIP LOCKED
), ended AS (
    SELECT t.id,
           t.completed_at + make_interval(secs => extract(epoch FROM $3::interval)::float8) AS at
    FROM conveyor_tasks t
    WHERE t.state IN ('archived', 'canceled') AND NOT t.dependents_pending
      AND t.completed_at
          <= $1::timestamptz - make_interval(secs => extract(epoch FROM $3::interval)::float8)
    ORDER BY t.completed_at, t.id
    LIMIT (SELECT $4::integer)
    FOR UPDATE SKIP LOCKED
), doomed AS (
    SELECT id, at FROM own
    UNION ALL SELECT id, at FROM by_default
    UNION ALL SELECT id, at FROM ended
    ORDER BY at, id
    LIMIT $4
), purged AS (
    DELETE FROM conveyor_tasks t USING doomed
    WHERE t.id = doomed.id
    RETURNING t.id
)
SELECT count(*) FROM purged
"""

#: Free up to $2 lapsed unique claims ($1 = now), so their keys can be reused.
FREE_ALL_LAPSED_CLAIMS = """
UPDATE conveyor_tasks SET unique_claim = NULL
WHERE id IN (
    SELECT id FROM conveyor_tasks
    WHERE unique_claim IS NOT NULL AND unique_until IS NOT NULL AND unique_until <= $1
    ORDER BY unique_until
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
"""

#: Waiting tasks expired at now $1 become ARCHIVED with error $3, at most $2 of them.
ARCHIVE_EXPIRED = f"""
WITH expired AS (
    SELECT id, state FROM conveyor_tasks
    WHERE expires_at IS NOT NULL AND expires_at <= $1
      AND state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'held', 'retry')
    ORDER BY expires_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE conveyor_tasks t
SET state = 'archived', last_error = $3, completed_at = $1, updated_at = $1
FROM expired
WHERE t.id = expired.id
RETURNING {TASK_COLUMNS}, expired.state AS previous_state, t.dependents_pending
"""

#: Due tasks per queue at now $1.
PENDING_COUNT = """
SELECT queue, count(*) AS n FROM conveyor_tasks
WHERE state IN ('pending', 'retry') AND available_at <= $1
  AND (expires_at IS NULL OR expires_at > $1)
GROUP BY queue
"""

#: Due tasks of queue $2 at now $1.
PENDING_COUNT_QUEUE = """
SELECT count(*) FROM conveyor_tasks
WHERE queue = $2 AND state IN ('pending', 'retry') AND available_at <= $1
  AND (expires_at IS NULL OR expires_at > $1)
"""

#: Queue $2's due tasks at now $1, counted up to $3: the LIMIT bounds the rows read.
DUE_COUNT_CAPPED = """
SELECT count(*) FROM (
    SELECT 1 FROM conveyor_tasks
    WHERE queue = $2 AND state IN ('pending', 'retry') AND available_at <= $1
      AND (expires_at IS NULL OR expires_at > $1)
    LIMIT $3
) due
"""

#: Queues that have a due task at now $1, named after $2, by name, at most $3. A skip
#: scan of conveyor_tasks_due_idx: one probe finds the next queue that has PENDING or
#: RETRY rows, one more its first due row; no row is counted.
DUE_QUEUES = """
WITH RECURSIVE leasable(queue) AS (
    (SELECT t.queue FROM conveyor_tasks t
     WHERE t.state IN ('pending', 'retry') AND t.queue > $2
     ORDER BY t.queue
     LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM conveyor_tasks t
            WHERE t.state IN ('pending', 'retry') AND t.queue > l.queue
            ORDER BY t.queue
            LIMIT 1)
    FROM leasable l
    WHERE l.queue IS NOT NULL
)
SELECT l.queue FROM leasable l
WHERE l.queue IS NOT NULL AND (
    SELECT true FROM conveyor_tasks t
    WHERE t.queue = l.queue AND t.state IN ('pending', 'retry') AND t.available_at <= $1
      AND (t.expires_at IS NULL OR t.expires_at > $1)
    ORDER BY t.available_at, t.id
    LIMIT 1
)
ORDER BY l.queue
LIMIT $3
"""

#: Which of the queues $2 (distinct names, sorted) have a due task at now $1, by name. One
#: probe of conveyor_tasks_due_idx per name: its first due row, if any.
DUE_AMONG = """
SELECT q.queue FROM unnest($2::text[]) AS q(queue)
WHERE (
    SELECT true FROM conveyor_tasks t
    WHERE t.queue = q.queue AND t.state IN ('pending', 'retry') AND t.available_at <= $1
      AND (t.expires_at IS NULL OR t.expires_at > $1)
    ORDER BY t.available_at, t.id
    LIMIT 1
)
ORDER BY q.queue
"""

#: DUE_AMONG with the due time (available_at) of each queue's first due row: the queues of
#: $2 that have a due task at now $1 (in no particular order: the caller sorts them). The
#: same probe per name, and nothing sorts the rows it reads.
OLDEST_DUE = """
SELECT q.queue, d.available_at FROM unnest($2::text[]) AS q(queue)
CROSS JOIN LATERAL (
    SELECT t.available_at FROM conveyor_tasks t
    WHERE t.queue = q.queue AND t.state IN ('pending', 'retry') AND t.available_at <= $1
      AND (t.expires_at IS NULL OR t.expires_at > $1)
    ORDER BY t.available_at, t.id
    LIMIT 1
) AS d
"""
