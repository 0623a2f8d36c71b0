"""Statements of the webhook worker registrations."""

from __future__ import annotations

# Rows that describe a webhook worker have these columns in this order
# (rows.webhook_worker_from_row reads them by position).
WEBHOOK_FIELDS = (
    "name",
    "url",
    "queues",
    "concurrency",
    "timeout",
    "paused",
    "secrets",
    "created_at",
    "updated_at",
    "batch_types",
)
#: Every column of a registration, in WEBHOOK_FIELDS order, qualified with the alias
#: ``w``; queues as text whatever codec the pool's owner may have registered for jsonb.
WEBHOOK_COLUMNS = ", ".join(
    f"w.{name}::text AS {name}" if name == "queues" else f"w.{name}" for name in WEBHOOK_FIELDS
)

#: Create or replace registration $1 at now $8; an empty $7 keeps the stored secrets;
#: $9 its batch types.
UPSERT_WEBHOOK_WORKER = f"""
INSERT INTO conveyor_webhook_workers AS w
    (name, url, queues, concurrency, timeout, paused, secrets, created_at, updated_at,
     batch_types)
VALUES ($1, $2, $3::jsonb, $4, $5, $6, $7::text[], $8, $8, $9::text[])
ON CONFLICT (name) DO UPDATE SET
    url = excluded.url,
    queues = excluded.queues,
    concurrency = excluded.concurrency,
    timeout = excluded.timeout,
    paused = excluded.paused,
    batch_types = excluded.batch_types,
    secrets = CASE WHEN cardinality(excluded.secrets) = 0 THEN w.secrets
                   ELSE excluded.secrets END,
    updated_at = excluded.updated_at
RETURNING {WEBHOOK_COLUMNS}
"""

#: The registration $1.
GET_WEBHOOK_WORKER = f"SELECT {WEBHOOK_COLUMNS} FROM conveyor_webhook_workers w WHERE w.name = $1"

#: Every registration, by name.
LIST_WEBHOOK_WORKERS = f"SELECT {WEBHOOK_COLUMNS} FROM conveyor_webhook_workers w ORDER BY w.name"

#: Set the pause flag of registration $1 to $2 at now $3 (no row: not found).
SET_WEBHOOK_WORKER_PAUSED = f"""
UPDATE conveyor_webhook_workers w SET paused = $2, updated_at = $3
WHERE w.name = $1
RETURNING {WEBHOOK_COLUMNS}
"""

#: Delete registration $1 (no row: not found).
DELETE_WEBHOOK_WORKER = "DELETE FROM conveyor_webhook_workers WHERE name = $1 RETURNING name"

#: Store secrets $3 for registration $1 if its secrets are exactly $2 (no row: not).
REPLACE_WEBHOOK_SECRETS = """
UPDATE conveyor_webhook_workers SET secrets = $3::text[]
WHERE name = $1 AND secrets = $2::text[]
RETURNING name
"""
