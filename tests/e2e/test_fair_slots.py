"""Fair slots through real processes (the scenario of tests/e2e/fairness.py): one worker
with 2 slots serving 10 busy queues of different weights; over 10,000 tasks each queue's
share of the completions is within 20% of its share by weight.

Without turns, a slot freed on one queue was announced on that queue only, and the
queues whose dispatchers happened to be quickest took nearly everything (measured: two
of these queues got no task at all in the first 4,000)."""

from __future__ import annotations

import pytest

from tests.e2e.fairness import fair_run
from tests.e2e.harness import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats, pytest.mark.slow]

WEIGHTS = {f"q{n}": w for n, w in enumerate([1, 1, 1, 1, 1, 1, 1, 2, 3, 4])}


async def test_one_worker_with_two_slots_shares_them_by_weight_over_ten_queues(
    cluster: Cluster,
) -> None:
    run = await fair_run(cluster, weights=WEIGHTS, concurrency=2, count=10_000)
    print(f"fair slots: {dict(run.done)} in {run.seconds:.1f} s, worst {run.worst():.1%} off")
    assert sum(run.done.values()) == 10_000
    for queue in WEIGHTS:
        assert 0.8 <= run.ratio(queue) <= 1.2, (queue, run.done)
