"""Statements of the rate limits: one token bucket per queue (``conveyor_rate_limits``).

The arithmetic is :mod:`conveyor_broker.rates`'s, in Python: a change locks the row
(:data:`LOCK_RATE_LIMIT`), computes, and writes it back (:data:`STORE_RATE_BUCKET`) in one
transaction, so two dispatchers that own the queue at once spend one bucket.
"""

from __future__ import annotations

_BUCKET = "queue, per_second, burst, tokens, refilled_at"

#: The bucket of queue $1, locked until the transaction ends (no row: no limit).
LOCK_RATE_LIMIT = f"SELECT {_BUCKET} FROM conveyor_rate_limits WHERE queue = $1 FOR UPDATE"

#: The bucket of queue $1, unlocked.
GET_RATE_LIMIT = f"SELECT {_BUCKET} FROM conveyor_rate_limits WHERE queue = $1"

#: Every bucket, by queue.
LIST_RATE_LIMITS = f"SELECT {_BUCKET} FROM conveyor_rate_limits ORDER BY queue"

#: Create or replace the bucket of queue $1: rate $2, burst $3, $4 tokens at $5; time
#: never runs backwards for a bucket (a caller whose clock is behind keeps refilled_at).
STORE_RATE_BUCKET = """
INSERT INTO conveyor_rate_limits AS r (queue, per_second, burst, tokens, refilled_at)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (queue) DO UPDATE SET
    per_second = excluded.per_second,
    burst = excluded.burst,
    tokens = excluded.tokens,
    refilled_at = greatest(r.refilled_at, excluded.refilled_at)
"""

#: Delete the bucket of queue $1 (no row: not found).
DELETE_RATE_LIMIT = "DELETE FROM conveyor_rate_limits WHERE queue = $1 RETURNING queue"
