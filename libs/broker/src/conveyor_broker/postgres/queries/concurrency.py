"""Statements of the concurrency limits per key (:mod:`conveyor_broker.concurrency`).

A queue with a limit is leased by :data:`KEYED_CANDIDATES`, decided in Python
(:func:`conveyor_broker.concurrency.plan_lease`) and written by :data:`LEASE_IDS` and
:data:`PARK`, all in one transaction under :data:`LOCK_KEYED_QUEUE`; the plain lease
statements skip such a queue (they test :data:`QUEUE_LIMITS`' table first).
"""

from __future__ import annotations

from conveyor_broker.postgres.queries import TASK_COLUMNS
from conveyor_broker.postgres.queries.lease import with_type_filter

_LIMIT = "queue, pattern, per_key"

#: Create or replace the limit of queue $1 and pattern $2: $3 per key.
SET_CONCURRENCY_LIMIT = """
INSERT INTO conveyor_concurrency_limits (queue, pattern, per_key) VALUES ($1, $2, $3)
ON CONFLICT (queue, pattern) DO UPDATE SET per_key = excluded.per_key
"""

#: The limits (of queue $1, or of all when NULL), by queue and pattern.
LIST_CONCURRENCY_LIMITS = f"""
SELECT {_LIMIT} FROM conveyor_concurrency_limits
WHERE $1::text IS NULL OR queue = $1
ORDER BY queue, pattern
"""

#: The limits of queue $1.
QUEUE_LIMITS = f"SELECT {_LIMIT} FROM conveyor_concurrency_limits WHERE queue = $1"

#: Which of the queues $1 have a limit.
LIMITED_QUEUES = """
SELECT DISTINCT queue FROM conveyor_concurrency_limits WHERE queue = ANY($1::text[])
"""

#: Delete the limit of queue $1 and pattern $2; returns the queue when there was one.
DELETE_CONCURRENCY_LIMIT = """
DELETE FROM conveyor_concurrency_limits WHERE queue = $1 AND pattern = $2 RETURNING queue
"""

#: Forget the freed keys of queue $1 (its last limit is gone).
FORGET_FREED = "DELETE FROM conveyor_concurrency_freed WHERE queue = $1"

#: Serialise the keyed leases (and limit changes) of queue $1 until the transaction ends.
LOCK_KEYED_QUEUE = (
    "SELECT pg_advisory_xact_lock(hashtextextended('conveyor.concurrency:' || $1, 0))"
)

#: Take the keys of queue $1 whose ACTIVE tasks stopped being ACTIVE (the triggers').
TAKE_FREED = "DELETE FROM conveyor_concurrency_freed WHERE queue = $1 RETURNING key"

#: The keys of queue $1 that have HELD tasks.
HELD_KEYS = """
SELECT DISTINCT concurrency_key AS key FROM conveyor_tasks
WHERE queue = $1 AND state = 'held'
"""

#: How many tasks of queue $1 are ACTIVE per key, of the keys $2.
ACTIVE_PER_KEY = """
SELECT concurrency_key AS key, count(*) AS n FROM conveyor_tasks
WHERE queue = $1 AND state = 'active' AND concurrency_key IS NOT NULL
  AND concurrency_key = ANY($2::text[])
GROUP BY concurrency_key
"""

#: The oldest HELD tasks of queue $1, up to $3[i] of key $2[i], PENDING again at now $4
#: (their due time kept: they keep their place).
PROMOTE_HELD = f"""
WITH picked AS (
    SELECT h.id FROM unnest($2::text[], $3::int[]) AS k(key, room)
    CROSS JOIN LATERAL (
        SELECT c.id FROM conveyor_tasks c
        WHERE c.queue = $1 AND c.state = 'held' AND c.concurrency_key = k.key
        ORDER BY c.available_at, c.id
        LIMIT k.room
        FOR UPDATE
    ) h
)
UPDATE conveyor_tasks t SET state = 'pending', updated_at = $4
FROM picked
WHERE t.id = picked.id
RETURNING {TASK_COLUMNS}
"""

#: Up to $3 due tasks of queue $1 at now $2 in lease order, locked (the lease query's
#: SELECT, with each one's state and key).
KEYED_CANDIDATES = """
SELECT id, state, concurrency_key FROM conveyor_tasks
WHERE queue = $1 AND state IN ('pending', 'retry') AND available_at <= $2
  AND (expires_at IS NULL OR expires_at > $2)
ORDER BY available_at, id
LIMIT $3
FOR UPDATE SKIP LOCKED
"""

#: KEYED_CANDIDATES with type filters (circuit breakers): only the tasks whose type is
#: not one of $4 and, unless $5 is NULL, is one of $5 (the others are neither leased nor
#: parked).
KEYED_CANDIDATES_FILTERED = with_type_filter(KEYED_CANDIDATES, 4, 5)

#: Lease the tasks $1 (locked by KEYED_CANDIDATES) with lease ids $2 and holders $3
#: ("" for none), expiring at $4, at now $5.
LEASE_IDS = f"""
UPDATE conveyor_tasks t
SET state = 'active', lease_id = u.lease_id, lease_expires_at = $4, started_at = $5,
    updated_at = $5, progress = NULL, holder = NULLIF(u.holder, '')
FROM unnest($1::text[], $2::text[], $3::text[]) AS u(id, lease_id, holder)
WHERE t.id = u.id
RETURNING {TASK_COLUMNS}
"""

#: Park the tasks $1 (locked by KEYED_CANDIDATES) HELD at now $2.
PARK = f"""
UPDATE conveyor_tasks t SET state = 'held', updated_at = $2
WHERE t.id = ANY($1::text[])
RETURNING {TASK_COLUMNS}
"""
