"""Statements of the aggregation groups: configs, stats, due groups, LeaseGroup."""

from __future__ import annotations

from conveyor_broker.postgres.queries import TASK_COLUMNS

_CONFIG = "queue, pattern, max_size, max_delay, grace_period"

#: Create or replace the config ($1 queue, $2 pattern, $3 its LIKE form, $4 max size,
#: $5 max delay, $6 grace period).
SET_GROUP_CONFIG = f"""
INSERT INTO conveyor_group_configs AS c
    (queue, pattern, like_pattern, max_size, max_delay, grace_period)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (queue, pattern) DO UPDATE SET
    like_pattern = excluded.like_pattern,
    max_size = excluded.max_size,
    max_delay = excluded.max_delay,
    grace_period = excluded.grace_period
RETURNING {_CONFIG}
"""

#: Delete the config of queue $1 and pattern $2 (no row: not found).
DELETE_GROUP_CONFIG = """
DELETE FROM conveyor_group_configs WHERE queue = $1 AND pattern = $2 RETURNING queue
"""

#: Every config, or those of queue $1 (NULL: every queue).
LIST_GROUP_CONFIGS = f"""
SELECT {_CONFIG} FROM conveyor_group_configs
WHERE $1::text IS NULL OR queue = $1
ORDER BY queue, pattern
"""

#: The groups with AGGREGATING members (of queue $1; NULL: every queue), at most $2.
GROUP_STATS = """
SELECT queue, group_key, count(*)::int AS size, min(created_at) AS oldest_at,
       max(created_at) AS newest_at
FROM conveyor_tasks
WHERE state = 'aggregating' AND group_key IS NOT NULL AND ($1::text IS NULL OR queue = $1)
GROUP BY queue, group_key
ORDER BY queue, group_key
LIMIT $2
"""

#: The groups past a threshold at now $1 (counting the members due by then: a member back
#: from a failed attempt waits out its retry delay) of the config that applies to them (the longest
#: matching pattern, then the first; else the defaults $2 max size, $3 max delay, $4
#: grace period), the oldest first member first, at most $5; with the config's values.
DUE_GROUPS = """
WITH g AS (
    SELECT queue, group_key, count(*)::int AS size, min(created_at) AS oldest_at,
           max(created_at) AS newest_at
    FROM conveyor_tasks
    WHERE state = 'aggregating' AND group_key IS NOT NULL AND available_at <= $1
    GROUP BY queue, group_key
), e AS (
    SELECT g.queue, g.group_key, g.size, g.oldest_at, g.newest_at,
           coalesce(c.max_size, $2) AS max_size,
           coalesce(c.max_delay, $3) AS max_delay,
           coalesce(c.grace_period, $4) AS grace_period
    FROM g LEFT JOIN LATERAL (
        SELECT k.max_size, k.max_delay, k.grace_period FROM conveyor_group_configs k
        WHERE k.queue = g.queue AND g.group_key LIKE k.like_pattern
        ORDER BY length(k.pattern) DESC, k.pattern
        LIMIT 1
    ) c ON true
)
SELECT queue, group_key, size, oldest_at, newest_at, max_size, max_delay, grace_period
FROM e
WHERE size >= max_size
   OR oldest_at + make_interval(secs => extract(epoch FROM max_delay)::float8) <= $1
   OR newest_at + make_interval(secs => extract(epoch FROM grace_period)::float8) <= $1
ORDER BY oldest_at, queue, group_key
LIMIT $5
"""

#: Lease up to $3 members of group $2 of queue $1 due at now $4 under lease id $5 until
#: $6, held by $7 ('': nobody).
LEASE_GROUP = f"""
WITH members AS (
    SELECT id FROM conveyor_tasks
    WHERE queue = $1 AND group_key = $2 AND state = 'aggregating'
      AND available_at <= $4 AND (expires_at IS NULL OR expires_at > $4)
    ORDER BY created_at, id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
)
UPDATE conveyor_tasks t
SET state = 'active', lease_id = $5, lease_expires_at = $6, started_at = $4,
    updated_at = $4, progress = NULL, holder = NULLIF($7::text, '')
FROM members
WHERE t.id = members.id
RETURNING {TASK_COLUMNS}
"""
