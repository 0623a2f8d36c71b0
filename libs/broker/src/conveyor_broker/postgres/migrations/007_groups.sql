-- 007: aggregation group configs, and the index the group sweeps and LeaseGroup read.
--
-- A config says when the groups of a queue whose names match a glob are due. like_pattern
-- is the glob as a LIKE pattern (kept by the broker), so the sweep can match in SQL.

CREATE TABLE conveyor_group_configs (
    queue        text COLLATE "C" NOT NULL,
    pattern      text COLLATE "C" NOT NULL,
    like_pattern text COLLATE "C" NOT NULL,
    max_size     integer NOT NULL,
    max_delay    interval NOT NULL,
    grace_period interval NOT NULL,
    CONSTRAINT conveyor_group_configs_pkey PRIMARY KEY (queue, pattern),
    CONSTRAINT conveyor_group_configs_size_check CHECK (max_size > 0),
    CONSTRAINT conveyor_group_configs_times_check CHECK (
        max_delay > interval '0' AND grace_period > interval '0')
);

-- GroupStats, DueGroups and LeaseGroup: the waiting members of each group, in join order.
CREATE INDEX conveyor_tasks_aggregating_idx ON conveyor_tasks (queue, group_key, created_at, id)
    WHERE state = 'aggregating';
