"""Statements of Lease, LeaseMany, ExtendLease(s) and SetProgress.

A lease picks the due rows (locked with SKIP LOCKED, so concurrent leasers never
collide), numbers them, and makes each ACTIVE with the next of the lease ids it was given
and the next of the holders ("" or none: NULL). The numbering follows no order (no sort:
the plan stays a walk of the due index): the rows of one queue are numbered 1..k, so
they take the first k holders, which is all the contract says.
"""

from __future__ import annotations

from conveyor_broker.postgres.queries import TASK_COLUMNS

#: Lease up to $3 due tasks of queue $1 at now $2, handing out the lease ids $4, expiry
#: $5 and the holders $6. The state list is written as conveyor_tasks_due_idx's
#: predicate is. A queue with a concurrency limit leases nothing here (a one-time test:
#: the keyed lease of queries.concurrency is its own).
LEASE = f"""
WITH due AS (
    SELECT id, state FROM conveyor_tasks
    WHERE queue = $1 AND state IN ('pending', 'retry') AND available_at <= $2
      AND (expires_at IS NULL OR expires_at > $2)
      AND NOT EXISTS (SELECT 1 FROM conveyor_concurrency_limits l WHERE l.queue = $1)
    ORDER BY available_at, id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
), numbered AS (
    SELECT id, state, row_number() OVER () AS n FROM due
)
UPDATE conveyor_tasks t
SET state = 'active', lease_id = ($4::text[])[numbered.n],
    lease_expires_at = $5, started_at = $2, updated_at = $2, progress = NULL,
    holder = NULLIF(($6::text[])[numbered.n], '')
FROM numbered
WHERE t.id = numbered.id
RETURNING {TASK_COLUMNS}, numbered.state AS previous_state
"""

#: What a type filter (circuit breakers) adds to a plain lease's WHERE, after its expiry
#: test: only the tasks whose type is not one of $a and, unless $b is NULL, is one of $b.
_EXPIRY_TEST = "AND (expires_at IS NULL OR expires_at > $2)"


def with_type_filter(statement: str, exclude: int, only: int) -> str:
    """``statement`` (a plain lease's) with the type filter on parameters ``exclude`` and
    ``only`` in lines of their own after its expiry test, indented as it is; the rest of
    its text, and so its plan, unchanged."""
    lines = statement.split("\n")
    (at,) = [n for n, line in enumerate(lines) if line.strip() == _EXPIRY_TEST]
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines[at + 1 : at + 1] = [
        f"{indent}AND NOT (type = ANY(${exclude}::text[]))",
        f"{indent}AND (${only}::text[] IS NULL OR type = ANY(${only}::text[]))",
    ]
    return "\n".join(lines)


#: LEASE with type filters: $7 the types left out, $8 (unless NULL) the only ones taken.
#: Its own statement, so that the unfiltered lease (the hot path) keeps its text and plan.
LEASE_FILTERED = with_type_filter(LEASE, 7, 8)

#: LEASE for several queues: $1 queues and $2 their limits (one lateral probe of the due
#: index per queue), $3 now, $4 lease ids, $5 expiry; $7 the holders of every queue, each
#: queue's padded to its limit, and $6 where each queue's begin (0-based).
LEASE_MANY = f"""
WITH due AS (
    SELECT d.id, d.state, r.off + d.k AS h
    FROM unnest($1::text[], $2::int[], $6::int[]) AS r(queue, n, off)
    CROSS JOIN LATERAL (
        SELECT x.id, x.state, row_number() OVER () AS k FROM (
            SELECT c.id, c.state FROM conveyor_tasks c
            WHERE c.queue = r.queue AND c.state IN ('pending', 'retry')
              AND c.available_at <= $3 AND (c.expires_at IS NULL OR c.expires_at > $3)
              AND NOT EXISTS (
                  SELECT 1 FROM conveyor_concurrency_limits l WHERE l.queue = r.queue)
            ORDER BY c.available_at, c.id
            LIMIT r.n
            FOR UPDATE SKIP LOCKED
        ) x
    ) d
), numbered AS (
    SELECT id, state, h, row_number() OVER () AS n FROM due
)
UPDATE conveyor_tasks t
SET state = 'active', lease_id = ($4::text[])[numbered.n],
    lease_expires_at = $5, started_at = $3, updated_at = $3, progress = NULL,
    holder = NULLIF(($7::text[])[numbered.h], '')
FROM numbered
WHERE t.id = numbered.id
RETURNING {TASK_COLUMNS}, numbered.state AS previous_state
"""

#: The lease query's SELECT alone, for EXPLAIN in tests and diagnostics.
LEASE_SELECT = """
SELECT id FROM conveyor_tasks
WHERE queue = $1 AND state IN ('pending', 'retry') AND available_at <= $2
  AND (expires_at IS NULL OR expires_at > $2)
ORDER BY available_at, id
LIMIT $3
FOR UPDATE SKIP LOCKED
"""

#: Extend the lease ($1 task, $2 lease id) to $3 at now $4.
EXTEND_LEASE = """
UPDATE conveyor_tasks t SET lease_expires_at = $3, updated_at = $4
WHERE t.id = $1 AND t.state = 'active' AND t.lease_id = $2
RETURNING t.lease_expires_at
"""

# Batch statements keyed by (id, lease id) join an unnest() to the table. They must find
# their rows through the primary key whatever the statistics say: a burst into a freshly
# emptied (or never analyzed) table leaves the planner thinking ACTIVE rows are few, and
# ``t.state = 'active'`` then invites a bitmap scan of conveyor_tasks_lease_expiry_idx
# hashed against the batch. That index gains an entry per lease and, without a vacuum,
# keeps the dead ones, so such a scan grows with every task ever leased (measured: 46 ms
# per 100-row ack after 10k tasks, against 4 ms through the primary key). So these
# statements (EXTEND_LEASES here, ACK_BATCH in outcomes) do not name the state: a
# matching, non-null lease id with a lease expiry is the same test, because
# conveyor_tasks_lease_check makes (state = 'active') equal to (lease_id IS NOT NULL AND
# lease_expires_at IS NOT NULL); and no partial index can be proven from it.

#: Extend the leases ($1 ids, $2 lease ids) to $3 at now $4; returns the ones still held.
EXTEND_LEASES = """
UPDATE conveyor_tasks t SET lease_expires_at = $3, updated_at = $4
FROM unnest($1::text[], $2::text[]) AS u(id, lease_id)
WHERE t.id = u.id AND t.lease_id = u.lease_id AND t.lease_expires_at IS NOT NULL
RETURNING t.id, t.lease_id
"""

#: Store progress $3 of the task $1 under lease $2 at now $4.
SET_PROGRESS = """
UPDATE conveyor_tasks t SET progress = $3, updated_at = $4
WHERE t.id = $1 AND t.state = 'active' AND t.lease_id = $2
RETURNING t.id
"""
