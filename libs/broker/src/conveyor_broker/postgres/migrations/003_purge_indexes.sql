-- 003: PurgeTerminal walks indexes in purge order instead of sorting every terminal row.
--
-- A completed task with its own retention stores when it may go (purge_at, set by the
-- statements that complete it), so those rows can be read in purge order from an index;
-- completed rows without one (they take the sweep's default retention) and archived and
-- canceled rows (the sweep's archive retention) go in completed_at order, each from an
-- index of their own. The three indexes replace conveyor_tasks_terminal_idx, which mixed
-- them and so could only be filtered and sorted as a whole.

ALTER TABLE conveyor_tasks ADD COLUMN purge_at timestamptz;

-- The retention is added as exact seconds, as the broker does (see queries.ACK).
UPDATE conveyor_tasks
SET purge_at = completed_at + make_interval(secs => extract(epoch FROM retention)::float8)
WHERE state = 'completed' AND retention IS NOT NULL;

-- No CHECK ties purge_at to state and retention: during a rolling upgrade the previous
-- release's services still complete tasks without setting it. PurgeTerminal purges such a
-- row by its own retention from the completed_at index (at the default retention at the
-- earliest).

DROP INDEX conveyor_tasks_terminal_idx;

-- PurgeTerminal: completed tasks with a retention of their own, in purge order.
CREATE INDEX conveyor_tasks_purge_at_idx ON conveyor_tasks (purge_at, id)
    WHERE state = 'completed' AND purge_at IS NOT NULL;

-- PurgeTerminal: completed tasks that take the default retention.
CREATE INDEX conveyor_tasks_completed_idx ON conveyor_tasks (completed_at, id)
    WHERE state = 'completed' AND purge_at IS NULL;

-- PurgeTerminal: archived and canceled tasks.
CREATE INDEX conveyor_tasks_ended_idx ON conveyor_tasks (completed_at, id)
    WHERE state IN ('archived', 'canceled');
