-- 008: rate limits, a token bucket per queue.
--
-- tokens is what the bucket held at refilled_at; the broker refills it from the clock
-- (conveyor_broker.rates) under the row's lock, in the transaction that spends or returns
-- tokens, so every dispatcher that owns the queue spends the same bucket.

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
