-- 010: circuit breakers per task type (conveyor_broker.breakers).
--
-- conveyor_breaker_configs holds the operators' configs: for the task types of a queue
-- that match a glob, how many failed attempts within window_ms open a breaker, how long
-- it stays open (cooldown_ms), and whom it stops (scope). The gateways count the failures
-- and run the breakers; conveyor_breakers holds the ones that are not closed, as they
-- store them: a gateway's own (WORKER scope, gateway named, holder its process, so the
-- breakers of a dead process go with its leases) or a queue-wide one (gateway '', QUEUE
-- scope) that the dispatchers obey and whose probe one of them takes.

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
