-- The build-event ingest's tables, in their own schema beside the task queue's.
CREATE SCHEMA IF NOT EXISTS bep;

CREATE TABLE bep.projects (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    slug        text NOT NULL UNIQUE CHECK (slug ~ '^[a-z0-9][a-z0-9-]{0,62}$'),
    name        text NOT NULL,
    key_prefix  text NOT NULL,
    max_streams integer NOT NULL DEFAULT 200 CHECK (max_streams > 0),
    max_unacked integer NOT NULL DEFAULT 5000 CHECK (max_unacked > 0),
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE bep.api_keys (
    id            text PRIMARY KEY,
    project_id    bigint NOT NULL REFERENCES bep.projects (id) ON DELETE CASCADE,
    secret_sha256 bytea NOT NULL,
    name          text NOT NULL DEFAULT '',
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz
);
CREATE INDEX api_keys_project_idx ON bep.api_keys (project_id);

CREATE TABLE bep.invocations (
    invocation_id        text PRIMARY KEY,
    project_id           bigint NOT NULL REFERENCES bep.projects (id) ON DELETE CASCADE,
    build_id             text NOT NULL DEFAULT '',
    last_event_seq       bigint NOT NULL DEFAULT 0,
    status               text NOT NULL DEFAULT 'running',
    finished             boolean NOT NULL DEFAULT false,
    exit_code            integer,
    exit_name            text,
    command              text,
    patterns             text[],
    tool_version         text,
    user_name            text,
    host_name            text,
    branch               text,
    commit_sha           text,
    tags                 jsonb NOT NULL DEFAULT '{}',
    command_line         text[],
    options              jsonb,
    started_at           timestamptz,
    finished_at          timestamptz,
    attempt_started_at   timestamptz,
    attempt_finished_at  timestamptz,
    lifecycle_status     text,
    targets_configured   integer NOT NULL DEFAULT 0,
    targets_completed    integer NOT NULL DEFAULT 0,
    targets_failed       integer NOT NULL DEFAULT 0,
    tests_total          integer NOT NULL DEFAULT 0,
    tests_passed         integer NOT NULL DEFAULT 0,
    tests_failed         integer NOT NULL DEFAULT 0,
    tests_flaky          integer NOT NULL DEFAULT 0,
    actions_failed       integer NOT NULL DEFAULT 0,
    actions_created      bigint,
    actions_executed     bigint,
    cache_hits           bigint,
    events               bigint NOT NULL DEFAULT 0,
    log_bytes            bigint NOT NULL DEFAULT 0,
    log_lines            bigint NOT NULL DEFAULT 0,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX invocations_project_idx ON bep.invocations (project_id, created_at DESC);
CREATE INDEX invocations_created_idx ON bep.invocations (created_at);

CREATE TABLE bep.targets (
    invocation_id  text NOT NULL,
    label          text NOT NULL,
    aspect         text NOT NULL DEFAULT '',
    configuration  text,
    kind           text,
    test_size      text,
    tags           text[],
    success        boolean,
    failure        text,
    test_status    text,
    test_runs      integer,
    test_cached    integer,
    test_duration_ms bigint,
    PRIMARY KEY (invocation_id, label, aspect)
);

CREATE TABLE bep.test_results (
    invocation_id   text NOT NULL,
    label           text NOT NULL,
    run             integer NOT NULL,
    shard           integer NOT NULL,
    attempt         integer NOT NULL,
    configuration   text,
    status          text NOT NULL,
    status_details  text,
    cached_locally  boolean NOT NULL DEFAULT false,
    cached_remotely boolean NOT NULL DEFAULT false,
    started_at      timestamptz,
    duration_ms     bigint,
    strategy        text,
    exit_code       integer,
    outputs         jsonb NOT NULL DEFAULT '[]',
    PRIMARY KEY (invocation_id, label, run, shard, attempt)
);

CREATE TABLE bep.actions (
    invocation_id  text NOT NULL,
    seq            bigint NOT NULL,
    label          text,
    mnemonic       text,
    configuration  text,
    primary_output text,
    success        boolean NOT NULL,
    exit_code      integer,
    stdout_uri     text,
    stderr_uri     text,
    command_line   text[],
    failure        text,
    PRIMARY KEY (invocation_id, seq)
);

CREATE TABLE bep.named_sets (
    invocation_id text NOT NULL,
    set_id        text NOT NULL,
    files         jsonb NOT NULL,
    file_sets     text[] NOT NULL,
    PRIMARY KEY (invocation_id, set_id)
);

CREATE TABLE bep.invocation_metrics (
    invocation_id text PRIMARY KEY,
    metrics       jsonb NOT NULL
);

-- The raw stream (scrubbed), as zstd-compressed batches of length-delimited events, in
-- daily partitions: retention drops a partition. The service creates partitions ahead.
CREATE TABLE bep.event_segments (
    day           date NOT NULL,
    invocation_id text NOT NULL,
    first_seq     bigint NOT NULL,
    last_seq      bigint NOT NULL,
    raw_bytes     integer NOT NULL,
    data          bytea NOT NULL,
    PRIMARY KEY (invocation_id, first_seq, day)
) PARTITION BY RANGE (day);

-- The build log (progress stdout/stderr and console output, scrubbed), compressed per
-- batch, with the byte and line offset of each segment's first byte in the whole log.
CREATE TABLE bep.log_segments (
    day           date NOT NULL,
    invocation_id text NOT NULL,
    byte_offset   bigint NOT NULL,
    line_offset   bigint NOT NULL,
    bytes         integer NOT NULL,
    lines         integer NOT NULL,
    data          bytea NOT NULL,
    PRIMARY KEY (invocation_id, byte_offset, day)
) PARTITION BY RANGE (day);

CREATE TABLE bep.tag_keys (
    project_id bigint NOT NULL REFERENCES bep.projects (id) ON DELETE CASCADE,
    key        text NOT NULL,
    value      text NOT NULL,
    builds     bigint NOT NULL,
    PRIMARY KEY (project_id, key, value)
);
