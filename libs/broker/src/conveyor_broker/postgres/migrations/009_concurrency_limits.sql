-- 009: concurrency limits per key (conveyor_broker.concurrency).
--
-- A task whose key is at its limit when a lease picks it is parked HELD, out of the due
-- index, so the tasks behind it flow. When an ACTIVE task of a limited queue's key stops
-- being ACTIVE, the trigger notes its key in conveyor_concurrency_freed (an insert: no
-- lock to wait for, whatever order a batch updates its rows in); the queue's next lease
-- takes those notes and makes the oldest HELD tasks of those keys PENDING again, as far
-- as there is room. Leases of a keyed queue hold a per-queue advisory lock, so two
-- dispatchers (a failover) count the same ACTIVE tasks.

ALTER TABLE conveyor_tasks DROP CONSTRAINT conveyor_tasks_state_check;
ALTER TABLE conveyor_tasks ADD CONSTRAINT conveyor_tasks_state_check CHECK (state IN (
    'pending', 'scheduled', 'aggregating', 'blocked', 'held', 'active', 'retry',
    'completed', 'archived', 'canceled'));

-- HELD tasks wait, may expire and keep their unique claims.
DROP INDEX conveyor_tasks_expiry_idx;
CREATE INDEX conveyor_tasks_expiry_idx ON conveyor_tasks (expires_at, id)
    WHERE expires_at IS NOT NULL
      AND state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'held', 'retry');
DROP INDEX conveyor_tasks_unique_idx;
CREATE UNIQUE INDEX conveyor_tasks_unique_idx ON conveyor_tasks (queue, unique_claim)
    WHERE unique_claim IS NOT NULL
      AND state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'held', 'active', 'retry');

CREATE INDEX conveyor_tasks_held_idx ON conveyor_tasks (queue, concurrency_key, available_at, id)
    WHERE state = 'held';
CREATE INDEX conveyor_tasks_keyed_active_idx ON conveyor_tasks (queue, concurrency_key)
    WHERE state = 'active' AND concurrency_key IS NOT NULL;

CREATE TABLE conveyor_concurrency_limits (
    queue   text COLLATE "C" NOT NULL,
    pattern text COLLATE "C" NOT NULL,
    per_key integer NOT NULL,
    CONSTRAINT conveyor_concurrency_limits_pkey PRIMARY KEY (queue, pattern),
    CONSTRAINT conveyor_concurrency_limits_per_key_check CHECK (per_key > 0)
);

CREATE TABLE conveyor_concurrency_freed (
    queue text COLLATE "C" NOT NULL,
    key   text NOT NULL
);
CREATE INDEX conveyor_concurrency_freed_queue_idx ON conveyor_concurrency_freed (queue);

CREATE FUNCTION conveyor_concurrency_freed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM conveyor_concurrency_limits WHERE queue = OLD.queue) THEN
        INSERT INTO conveyor_concurrency_freed (queue, key)
        VALUES (OLD.queue, OLD.concurrency_key);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER conveyor_tasks_left_active
    AFTER UPDATE OF state ON conveyor_tasks FOR EACH ROW
    WHEN (OLD.state = 'active' AND NEW.state <> 'active' AND OLD.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION conveyor_concurrency_freed();

CREATE TRIGGER conveyor_tasks_deleted_active
    AFTER DELETE ON conveyor_tasks FOR EACH ROW
    WHEN (OLD.state = 'active' AND OLD.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION conveyor_concurrency_freed();
