"""A rate limit through real processes (the scenario of tests/e2e/rates.py: two api
processes, two dispatchers, workers with far more slots than the limit needs): no window
ever holds more starts than the bucket allows (its burst, then the rate), also across a
kill -9 of the owning dispatcher, which hands the queue over without a fresh burst.

How close the starts come to the limit is a figure of the benchmark
(``python -m bench.e2e_bench --rate-limit``), not asserted here: what this checks holds on
any machine, however slow."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from tests.e2e.harness import Cluster
from tests.e2e.rates import rate_run

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats, pytest.mark.slow]

RATE = 50
BURST = 5


async def test_no_window_starts_more_than_the_bucket_allows_across_a_dispatcher_kill(
    cluster: Cluster, tmp_path: Path
) -> None:
    run = await rate_run(
        cluster, tmp_path, queue="rated", rate=RATE, burst=BURST, tasks=1000, kill_at=600
    )
    span = run.starts[-1] - run.starts[0]
    print(
        f"rate limit {RATE}/s burst {BURST}: 1000 starts over {span.total_seconds():.1f} s, "
        f"busiest second {run.busiest()}"
    )
    for window in (timedelta(seconds=1), timedelta(seconds=5)):
        assert run.busiest(window) <= run.most_allowed(window), window
    # The whole run, the kill and the new owner's claim included: one bucket throughout.
    assert len(run.starts) <= run.most_allowed(span) + 1
