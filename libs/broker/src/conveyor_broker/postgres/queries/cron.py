"""Statements of the cron entries."""

from __future__ import annotations

# Rows that describe a cron entry have these columns in this order
# (rows.cron_entry_from_row reads them by position).
CRON_FIELDS = (
    "name",
    "schedule",
    "timezone",
    "paused",
    "misfire",
    "task_queue",
    "task_type",
    "payload",
    "headers",
    "max_retry",
    "timeout",
    "retention",
    "group_key",
    "concurrency_key",
    "next_run_at",
    "last_run_at",
    "created_at",
    "updated_at",
)
#: Every column of an entry, in CRON_FIELDS order, qualified with the alias ``c``; headers
#: as text whatever codec the pool's owner may have registered for jsonb.
CRON_COLUMNS = ", ".join(
    f"c.{name}::text AS {name}" if name == "headers" else f"c.{name}" for name in CRON_FIELDS
)

#: The entry $1, locked for the rest of the transaction.
LOCK_CRON_ENTRY = f"SELECT {CRON_COLUMNS} FROM conveyor_cron_entries c WHERE c.name = $1 FOR UPDATE"

#: Create or replace entry $1 at now $17 (created_at and last_run_at kept on replace).
UPSERT_CRON_ENTRY = f"""
INSERT INTO conveyor_cron_entries AS c
    (name, schedule, timezone, paused, misfire, task_queue, task_type, payload, headers,
     max_retry, timeout, retention, group_key, concurrency_key, next_run_at, last_run_at,
     created_at, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, $11, $12, $13, $14, $15, NULL,
        $16, $16)
ON CONFLICT (name) DO UPDATE SET
    schedule = excluded.schedule,
    timezone = excluded.timezone,
    paused = excluded.paused,
    misfire = excluded.misfire,
    task_queue = excluded.task_queue,
    task_type = excluded.task_type,
    payload = excluded.payload,
    headers = excluded.headers,
    max_retry = excluded.max_retry,
    timeout = excluded.timeout,
    retention = excluded.retention,
    group_key = excluded.group_key,
    concurrency_key = excluded.concurrency_key,
    next_run_at = excluded.next_run_at,
    updated_at = excluded.updated_at
RETURNING {CRON_COLUMNS}
"""

#: The entry $1.
GET_CRON_ENTRY = f"SELECT {CRON_COLUMNS} FROM conveyor_cron_entries c WHERE c.name = $1"

#: Every entry, by name.
LIST_CRON_ENTRIES = f"SELECT {CRON_COLUMNS} FROM conveyor_cron_entries c ORDER BY c.name"

#: At most $2 entries whose next run is at or before now $1, earliest first.
LIST_DUE_CRON_ENTRIES = f"""
SELECT {CRON_COLUMNS} FROM conveyor_cron_entries c
WHERE c.next_run_at IS NOT NULL AND c.next_run_at <= $1
ORDER BY c.next_run_at, c.name
LIMIT $2
"""

#: Set entry $1's pause flag to $2, its next run to $3, at now $4.
SET_CRON_PAUSED = f"""
UPDATE conveyor_cron_entries c SET paused = $2, next_run_at = $3, updated_at = $4
WHERE c.name = $1
RETURNING {CRON_COLUMNS}
"""

#: Entry $1 fired: next run $2, last run $3 (NULL: unchanged).
ADVANCE_CRON_ENTRY = f"""
UPDATE conveyor_cron_entries c
SET next_run_at = $2, last_run_at = coalesce($3, c.last_run_at)
WHERE c.name = $1
RETURNING {CRON_COLUMNS}
"""

#: Delete entry $1 (no row: not found).
DELETE_CRON_ENTRY = "DELETE FROM conveyor_cron_entries WHERE name = $1 RETURNING name"
