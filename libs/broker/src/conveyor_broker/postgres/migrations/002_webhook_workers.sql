-- 002: webhook worker registrations.
--
-- One row per registered HTTP endpoint the webhook service delivers tasks to. Names follow
-- the queue-name rules and use the "C" collation, so listing by name is plain byte order.

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
    CONSTRAINT conveyor_webhook_workers_pkey PRIMARY KEY (name),
    CONSTRAINT conveyor_webhook_workers_queues_check CHECK (
        jsonb_typeof(queues) = 'object' AND queues <> '{}'::jsonb),
    CONSTRAINT conveyor_webhook_workers_concurrency_check CHECK (concurrency > 0),
    CONSTRAINT conveyor_webhook_workers_timeout_check CHECK (timeout > interval '0')
);
