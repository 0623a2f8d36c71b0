-- 006: cron entries.
--
-- One row per server-persisted cron entry: its schedule, the template of the task each
-- slot creates, and the next slot to fire. The scheduler fires a slot with a
-- compare-and-set on next_run_at, in the transaction that enqueues the slot's task.

CREATE TABLE conveyor_cron_entries (
    name            text COLLATE "C" NOT NULL,
    -- A cron expression (5 or 6 fields), an alias or @every <duration>, in normal form.
    schedule        text NOT NULL,
    -- The IANA time zone the schedule is read in.
    timezone        text NOT NULL,
    paused          boolean NOT NULL DEFAULT false,
    misfire         text NOT NULL,
    -- The task template.
    task_queue      text COLLATE "C" NOT NULL,
    task_type       text NOT NULL,
    payload         bytea NOT NULL,
    headers         jsonb NOT NULL DEFAULT '{}'::jsonb,
    max_retry       integer,
    timeout         interval,
    retention       interval,
    group_key       text COLLATE "C",
    concurrency_key text COLLATE "C",
    -- The next slot to fire (NULL while paused); the last slot fired.
    next_run_at     timestamptz,
    last_run_at     timestamptz,
    created_at      timestamptz NOT NULL,
    updated_at      timestamptz NOT NULL,
    CONSTRAINT conveyor_cron_entries_pkey PRIMARY KEY (name),
    CONSTRAINT conveyor_cron_entries_misfire_check CHECK (misfire IN ('run_once', 'skip')),
    CONSTRAINT conveyor_cron_entries_paused_check CHECK (NOT (paused AND next_run_at IS NOT NULL))
);

-- ListDueCronEntries: the entries whose next run has come, earliest first.
CREATE INDEX conveyor_cron_entries_due_idx ON conveyor_cron_entries (next_run_at, name)
    WHERE next_run_at IS NOT NULL;
