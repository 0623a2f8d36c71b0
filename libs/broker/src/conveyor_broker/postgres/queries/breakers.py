"""Statements of the circuit breakers per task type (:mod:`conveyor_broker.breakers`):
their configs, and the breakers that are not closed, as the gateways store them.

Both tables are small (a row per configured pattern; a row per open breaker), and every
statement goes through a primary key or reads a table whole.
"""

from __future__ import annotations

_CONFIG = "queue, pattern, failures, window_ms, cooldown_ms, scope"
_BREAKER = "queue, type, gateway, status, opened_at, until, failures, worker_id, holder"

#: Create or replace the config of queue $1 and pattern $2: $3 failures within $4 ms,
#: a cool-down of $5 ms, scope $6.
SET_BREAKER_CONFIG = """
INSERT INTO conveyor_breaker_configs (queue, pattern, failures, window_ms, cooldown_ms, scope)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (queue, pattern) DO UPDATE
SET failures = excluded.failures, window_ms = excluded.window_ms,
    cooldown_ms = excluded.cooldown_ms, scope = excluded.scope
"""

#: The configs (of queue $1, or of all when NULL), by queue and pattern.
LIST_BREAKER_CONFIGS = f"""
SELECT {_CONFIG} FROM conveyor_breaker_configs
WHERE $1::text IS NULL OR queue = $1
ORDER BY queue, pattern
"""

#: Delete the config of queue $1 and pattern $2; returns the queue when there was one.
DELETE_BREAKER_CONFIG = """
DELETE FROM conveyor_breaker_configs WHERE queue = $1 AND pattern = $2 RETURNING queue
"""

#: Store the breaker of queue $1, type $2 and gateway $3 ("": queue-wide): status $4,
#: opened at $5, until $6, $7 failures, worker $8, holder $9 ("" for none).
PUT_BREAKER = f"""
INSERT INTO conveyor_breakers ({_BREAKER})
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (queue, type, gateway) DO UPDATE
SET status = excluded.status, opened_at = excluded.opened_at, until = excluded.until,
    failures = excluded.failures, worker_id = excluded.worker_id, holder = excluded.holder
"""

#: Delete the breaker of queue $1, type $2 and gateway $3; returns its queue when stored.
DROP_BREAKER = """
DELETE FROM conveyor_breakers WHERE queue = $1 AND type = $2 AND gateway = $3 RETURNING queue
"""

#: The breakers (of queue $1, or of all when NULL), by queue, type and gateway.
LIST_BREAKERS = f"""
SELECT {_BREAKER} FROM conveyor_breakers
WHERE $1::text IS NULL OR queue = $1
ORDER BY queue, type, gateway
"""

#: Take the probe of the queue-wide breaker of queue $1 and type $2 when its until is at
#: or before now $4: HALF_OPEN until $3. One conditional UPDATE: a concurrent caller
#: waits for the row and, under READ COMMITTED, tests the condition again against the
#: winner's row (until $3, after now), so it takes nothing.
TAKE_PROBE = """
UPDATE conveyor_breakers SET status = 'half_open', until = $3
WHERE queue = $1 AND type = $2 AND gateway = '' AND until <= $4
RETURNING queue
"""
