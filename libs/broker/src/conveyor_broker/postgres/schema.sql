-- The declared schema of the Postgres broker: what applying every migration in
-- migrations/ produces. It is kept by hand beside the migrations, and a test applies both
-- to fresh databases and asserts identical catalogs. To change the schema, add a
-- migration AND update this file.

-- Applied migrations (created and filled by conveyor_broker.postgres.migrate).
CREATE TABLE conveyor_migrations (
    version    integer NOT NULL,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL,
    CONSTRAINT conveyor_migrations_pkey PRIMARY KEY (version)
);

CREATE TABLE conveyor_tasks (
    id               text COLLATE "C" NOT NULL,
    queue            text COLLATE "C" NOT NULL,
    type             text NOT NULL,
    -- Stored as given by the producer and never rewritten: execution fields below are
    -- authoritative and overlaid on read.
    payload          bytea NOT NULL,
    headers          jsonb NOT NULL DEFAULT '{}'::jsonb,
    state            text NOT NULL,
    max_retry        integer NOT NULL,
    retried          integer NOT NULL DEFAULT 0,
    timeout          interval,
    deadline         timestamptz,
    process_at       timestamptz,
    expires_at       timestamptz,
    retention        interval,
    unique_key       text COLLATE "C",
    unique_until     timestamptz,
    -- The claim this task holds on (queue, unique_claim): unique_key until the claim lapses
    -- (unique_until passed), then NULL. unique_key itself stays as enqueued.
    unique_claim     text COLLATE "C",
    group_key        text COLLATE "C",
    depends_on       text[] COLLATE "C" NOT NULL DEFAULT '{}',
    on_failure       text NOT NULL DEFAULT 'block',
    concurrency_key  text COLLATE "C",
    available_at     timestamptz NOT NULL,
    lease_id         text COLLATE "C",
    lease_expires_at timestamptz,
    progress         bytea,
    result           bytea,
    last_error       text,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    started_at       timestamptz,
    completed_at     timestamptz,
    -- When a COMPLETED task with a retention of its own may be purged (completed_at +
    -- retention); NULL on every other row. Kept by the statements that complete a task.
    purge_at         timestamptz,
    -- Who holds the lease (an api process, see conveyor_holders) while ACTIVE; NULL when
    -- the dispatcher named nobody. Set by every lease, cleared when a lease ends.
    holder           text,
    -- Dependencies: of this task's edges, how many are open (the dependency has not
    -- ended) and how many failed (it ended without completing); kept while it is BLOCKED.
    deps_open        integer NOT NULL DEFAULT 0,
    deps_failed      integer NOT NULL DEFAULT 0,
    -- True while tasks wait for this one and its end has not been resolved for them.
    dependents_pending boolean NOT NULL DEFAULT false,
    CONSTRAINT conveyor_tasks_pkey PRIMARY KEY (id),
    CONSTRAINT conveyor_tasks_state_check CHECK (state IN (
        'pending', 'scheduled', 'aggregating', 'blocked', 'held', 'active', 'retry',
        'completed', 'archived', 'canceled')),
    CONSTRAINT conveyor_tasks_on_failure_check CHECK (
        on_failure IN ('block', 'continue', 'cascade_cancel')),
    CONSTRAINT conveyor_tasks_retry_check CHECK (max_retry >= 0 AND retried >= 0),
    CONSTRAINT conveyor_tasks_unique_claim_check CHECK (
        unique_claim IS NULL OR unique_claim = unique_key),
    CONSTRAINT conveyor_tasks_lease_check CHECK (
        (state = 'active') = (lease_id IS NOT NULL AND lease_expires_at IS NOT NULL))
);

-- Lease: the due set of one queue in lease order. The predicate must match the lease
-- query's literal state list so the planner can prove it even with no statistics.
-- DueQueues skips through it from one queue to the next.
CREATE INDEX conveyor_tasks_due_idx ON conveyor_tasks (queue, available_at, id)
    WHERE state IN ('pending', 'retry');

-- PromoteScheduled.
CREATE INDEX conveyor_tasks_scheduled_idx ON conveyor_tasks (available_at, id)
    WHERE state = 'scheduled';

-- ReapExpiredLeases.
CREATE INDEX conveyor_tasks_lease_expiry_idx ON conveyor_tasks (lease_expires_at, id)
    WHERE state = 'active';

-- ArchiveExpired: only tasks that have a pre-dispatch TTL and still wait.
CREATE INDEX conveyor_tasks_expiry_idx ON conveyor_tasks (expires_at, id)
    WHERE expires_at IS NOT NULL
      AND state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'held', 'retry');

-- PurgeTerminal walks these three in purge order, so a sweep reads about as many rows as
-- it deletes however many terminal rows are kept. Completed tasks with a retention of
-- their own, by purge_at:
CREATE INDEX conveyor_tasks_purge_at_idx ON conveyor_tasks (purge_at, id)
    WHERE state = 'completed' AND purge_at IS NOT NULL;

-- Completed tasks that take the sweep's default retention:
CREATE INDEX conveyor_tasks_completed_idx ON conveyor_tasks (completed_at, id)
    WHERE state = 'completed' AND purge_at IS NULL;

-- Archived and canceled tasks (the sweep's archive retention):
CREATE INDEX conveyor_tasks_ended_idx ON conveyor_tasks (completed_at, id)
    WHERE state IN ('archived', 'canceled');

-- QueueStats counts and ListTasks pages filtered by queue (and state).
CREATE INDEX conveyor_tasks_queue_state_idx ON conveyor_tasks (queue, state, id);

-- At most one incomplete task holds a claim on (queue, key). A lapsed claim is freed by
-- setting unique_claim to NULL, which takes the row out of this index.
CREATE UNIQUE INDEX conveyor_tasks_unique_idx ON conveyor_tasks (queue, unique_claim)
    WHERE unique_claim IS NOT NULL
      AND state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'held', 'active', 'retry');

-- PromoteReadyDependents: ended tasks whose dependents are not resolved yet, oldest end
-- first.
CREATE INDEX conveyor_tasks_resolve_idx ON conveyor_tasks (completed_at, id)
    WHERE dependents_pending AND state IN ('completed', 'archived', 'canceled');

-- Freeing lapsed claims.
CREATE INDEX conveyor_tasks_unique_until_idx ON conveyor_tasks (unique_until)
    WHERE unique_claim IS NOT NULL AND unique_until IS NOT NULL;

-- Per-queue settings. A row exists once a queue has a stored setting; a queue with no
-- row has the defaults. NULL limits mean "no limit".
CREATE TABLE conveyor_queues (
    queue             text COLLATE "C" NOT NULL,
    paused            boolean NOT NULL DEFAULT false,
    -- Tasks per second the dispatcher may lease, and its burst.
    rate_limit        double precision,
    rate_burst        integer,
    -- Most ACTIVE tasks per concurrency key.
    concurrency_limit integer,
    updated_at        timestamptz NOT NULL,
    CONSTRAINT conveyor_queues_pkey PRIMARY KEY (queue),
    CONSTRAINT conveyor_queues_rate_check CHECK (
        (rate_limit IS NULL OR rate_limit > 0) AND (rate_burst IS NULL OR rate_burst > 0)),
    CONSTRAINT conveyor_queues_concurrency_check CHECK (
        concurrency_limit IS NULL OR concurrency_limit > 0)
);

-- Dependency edges: task_id waits for depends_on. The dependency may be purged (once
-- resolved) or deleted before its dependent is, so depends_on carries no foreign key.
CREATE TABLE conveyor_task_dependencies (
    task_id    text COLLATE "C" NOT NULL,
    depends_on text COLLATE "C" NOT NULL,
    -- NULL while the dependency has not ended (or its end is not resolved yet).
    outcome    text,
    CONSTRAINT conveyor_task_dependencies_pkey PRIMARY KEY (task_id, depends_on),
    CONSTRAINT conveyor_task_dependencies_task_id_fkey FOREIGN KEY (task_id)
        REFERENCES conveyor_tasks (id) ON DELETE CASCADE,
    CONSTRAINT conveyor_task_dependencies_outcome_check CHECK (
        outcome IN ('satisfied', 'failed'))
);

-- Listing a task's dependents, by dependent id.
CREATE INDEX conveyor_task_dependencies_depends_on_idx
    ON conveyor_task_dependencies (depends_on, task_id);

-- Resolution: the open edges of a dependency, by dependent id.
CREATE INDEX conveyor_task_dependencies_open_idx
    ON conveyor_task_dependencies (depends_on, task_id) WHERE outcome IS NULL;

-- Webhook worker registrations: one row per registered HTTP endpoint the webhook service
-- delivers tasks to (names sort in byte order).
CREATE TABLE conveyor_webhook_workers (
    name        text COLLATE "C" NOT NULL,
    url         text NOT NULL,
    -- Queue name -> weight (a JSON object of positive integers).
    queues      jsonb NOT NULL,
    concurrency integer NOT NULL,
    -- Per-delivery timeout; an interval keeps a timedelta exact to the microsecond.
    timeout     interval NOT NULL,
    paused      boolean NOT NULL DEFAULT false,
    -- Signing secrets, newest first. Empty until the operator sets some.
    secrets     text[] NOT NULL DEFAULT '{}',
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL,
    -- Task types taken as whole aggregation groups (one call per group), each once.
    batch_types text[] NOT NULL DEFAULT '{}',
    CONSTRAINT conveyor_webhook_workers_pkey PRIMARY KEY (name),
    CONSTRAINT conveyor_webhook_workers_queues_check CHECK (
        jsonb_typeof(queues) = 'object' AND queues <> '{}'::jsonb),
    CONSTRAINT conveyor_webhook_workers_concurrency_check CHECK (concurrency > 0),
    CONSTRAINT conveyor_webhook_workers_timeout_check CHECK (timeout > interval '0')
);

-- Cron entries: one row per server-persisted entry, its schedule, the template of the
-- task each slot creates, and the next slot to fire (the scheduler's compare-and-set).
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

-- Aggregation group configs: when the groups of a queue whose names match a glob are due.
-- like_pattern is the glob as a LIKE pattern (kept by the broker).
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
-- Holders: the processes whose gateways hold leases (api processes), and when each last
-- beat. The reaper releases the ACTIVE tasks of a holder silent for too long, and forgets
-- a silent holder once it holds nothing.
CREATE TABLE conveyor_holders (
    holder  text NOT NULL,
    seen_at timestamptz NOT NULL,
    CONSTRAINT conveyor_holders_pkey PRIMARY KEY (holder)
);

-- Rate limits: a token bucket per queue. tokens is what the bucket held at refilled_at;
-- the broker refills it from the clock under the row's lock as it spends or returns them.
CREATE TABLE conveyor_rate_limits (
    queue       text COLLATE "C" NOT NULL,
    per_second  double precision NOT NULL,
    burst       integer NOT NULL,
    tokens      double precision NOT NULL,
    refilled_at timestamptz NOT NULL,
    CONSTRAINT conveyor_rate_limits_pkey PRIMARY KEY (queue),
    CONSTRAINT conveyor_rate_limits_rate_check CHECK (per_second > 0 AND burst > 0),
    CONSTRAINT conveyor_rate_limits_tokens_check CHECK (tokens >= 0 AND tokens <= burst)
);

-- Concurrency limits per key: the limits, the HELD tasks by key, the ACTIVE ones with a
-- key, and the keys whose ACTIVE tasks stopped being ACTIVE since the queue's last lease
-- (kept by the triggers below; see conveyor_broker.concurrency).
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

-- Circuit breakers per task type: the operators' configs (for the types of a queue that
-- match a glob: failures within window_ms open a breaker for cooldown_ms, for scope), and
-- the breakers that are not closed, as the gateways store them: a gateway's own (WORKER
-- scope; holder its process, so a dead process's breakers go with its leases) or a
-- queue-wide one (gateway '') that the dispatchers obey.
CREATE TABLE conveyor_breaker_configs (
    queue       text COLLATE "C" NOT NULL,
    pattern     text COLLATE "C" NOT NULL,
    failures    integer NOT NULL,
    window_ms   integer NOT NULL,
    cooldown_ms integer NOT NULL,
    scope       text NOT NULL,
    CONSTRAINT conveyor_breaker_configs_pkey PRIMARY KEY (queue, pattern),
    CONSTRAINT conveyor_breaker_configs_failures_check CHECK (failures > 0),
    CONSTRAINT conveyor_breaker_configs_times_check CHECK (window_ms > 0 AND cooldown_ms > 0),
    CONSTRAINT conveyor_breaker_configs_scope_check CHECK (scope IN ('worker', 'queue'))
);

CREATE TABLE conveyor_breakers (
    queue     text COLLATE "C" NOT NULL,
    type      text COLLATE "C" NOT NULL,
    gateway   text COLLATE "C" NOT NULL,
    status    text NOT NULL,
    opened_at timestamptz NOT NULL,
    until     timestamptz NOT NULL,
    failures  integer NOT NULL,
    worker_id text NOT NULL DEFAULT '',
    holder    text NOT NULL DEFAULT '',
    CONSTRAINT conveyor_breakers_pkey PRIMARY KEY (queue, type, gateway),
    CONSTRAINT conveyor_breakers_status_check CHECK (status IN ('open', 'half_open')),
    CONSTRAINT conveyor_breakers_failures_check CHECK (failures >= 0)
);
CREATE INDEX conveyor_breakers_holder_idx ON conveyor_breakers (holder);
