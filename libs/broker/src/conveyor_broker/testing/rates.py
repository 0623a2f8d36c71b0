"""Conformance: rate limits (the token bucket of a queue)."""

from __future__ import annotations

import asyncio
import math
from datetime import timedelta

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import InvalidTask, RateLimitNotFound
from conveyor_broker.interface import Broker
from conveyor_broker.types import RateGrant, RateLimit

QUEUE = "calls"


class RateLimitTests:
    """set/get/list/delete_rate_limit, take_rate_tokens and return_rate_tokens."""

    async def test_rate_limits_set_replace_list_delete(self, broker: Broker) -> None:
        assert await broker.list_rate_limits() == []
        assert await broker.get_rate_limit(QUEUE) is None
        limit = await broker.set_rate_limit(RateLimit(QUEUE, 50, 10))
        assert limit == RateLimit(QUEUE, 50.0, 10)
        assert isinstance(limit.per_second, float)
        other = await broker.set_rate_limit(RateLimit("another", 0.5, 1))
        assert await broker.list_rate_limits() == [other, limit]
        replaced = await broker.set_rate_limit(RateLimit(QUEUE, 2.5, 3))
        assert await broker.get_rate_limit(QUEUE) == replaced
        await broker.delete_rate_limit(QUEUE)
        assert await broker.get_rate_limit(QUEUE) is None
        with pytest.raises(RateLimitNotFound):
            await broker.delete_rate_limit(QUEUE)
        assert await broker.list_rate_limits() == [other]

    @pytest.mark.parametrize(
        "limit",
        [
            RateLimit("bad queue", 1, 1),
            RateLimit(QUEUE, 0, 1),
            RateLimit(QUEUE, -1, 1),
            RateLimit(QUEUE, math.inf, 1),
            RateLimit(QUEUE, math.nan, 1),
            RateLimit(QUEUE, 2_000_000, 1),
            RateLimit(QUEUE, 1, 0),
            RateLimit(QUEUE, 1, 2_000_000),
            RateLimit(QUEUE, 1, 1.5),  # type: ignore[arg-type]
            RateLimit(QUEUE, True, 1),
        ],
    )
    async def test_a_bad_rate_limit_is_refused_and_the_stored_one_kept(
        self, broker: Broker, limit: RateLimit
    ) -> None:
        stored = await broker.set_rate_limit(RateLimit(QUEUE, 5, 5))
        with pytest.raises(InvalidTask):
            await broker.set_rate_limit(limit)
        assert await broker.list_rate_limits() == [stored]
        assert (await broker.take_rate_tokens(QUEUE, 10)).granted == 5

    async def test_a_queue_without_a_limit_grants_all(self, broker: Broker) -> None:
        assert await broker.take_rate_tokens(QUEUE, 1000) == RateGrant(1000)
        await broker.return_rate_tokens(QUEUE, 5)  # nothing to return to
        assert await broker.get_rate_limit(QUEUE) is None
        with pytest.raises(InvalidTask):
            await broker.take_rate_tokens(QUEUE, 0)

    async def test_a_new_bucket_is_full_then_refills_at_the_rate(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_rate_limit(RateLimit(QUEUE, 4, 10))
        assert await broker.take_rate_tokens(QUEUE, 6) == RateGrant(6)
        grant = await broker.take_rate_tokens(QUEUE, 6)
        assert grant.granted == 4
        assert grant.wait == timedelta(seconds=0.25)  # the next token, at 4 a second
        assert (await broker.take_rate_tokens(QUEUE, 1)).granted == 0
        clock.advance(timedelta(seconds=0.25) - timedelta(microseconds=1))
        assert (await broker.take_rate_tokens(QUEUE, 1)).granted == 0
        clock.advance(timedelta(microseconds=1))
        assert await broker.take_rate_tokens(QUEUE, 1) == RateGrant(1)
        # A long quiet spell fills the bucket to its burst, never above.
        clock.advance(timedelta(hours=1))
        assert (await broker.take_rate_tokens(QUEUE, 100)).granted == 10

    async def test_tokens_are_granted_at_the_rate_over_time(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        # 50 a second with a burst of 5, asked for 10 every 10 ms for 10 s: the burst, then
        # exactly the rate, and no second above rate + burst.
        await broker.set_rate_limit(RateLimit(QUEUE, 50, 5))
        per_second = [0] * 10
        for step in range(1000):
            per_second[step // 100] += (await broker.take_rate_tokens(QUEUE, 10)).granted
            clock.advance(timedelta(milliseconds=10))
        assert sum(per_second) == 5 + 50 * 10 - 1  # the last step's refill is not taken
        assert max(per_second) <= 55
        assert min(per_second) >= 49

    async def test_a_fractional_rate_grants_a_whole_token_at_a_time(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_rate_limit(RateLimit(QUEUE, 0.5, 1))
        assert (await broker.take_rate_tokens(QUEUE, 3)).granted == 1
        grant = await broker.take_rate_tokens(QUEUE, 1)
        assert grant == RateGrant(0, timedelta(seconds=2))
        clock.advance(timedelta(seconds=1))
        assert await broker.take_rate_tokens(QUEUE, 1) == RateGrant(0, timedelta(seconds=1))
        clock.advance(timedelta(seconds=1))
        assert (await broker.take_rate_tokens(QUEUE, 1)).granted == 1

    async def test_returned_tokens_are_granted_again_up_to_the_burst(self, broker: Broker) -> None:
        await broker.set_rate_limit(RateLimit(QUEUE, 1, 10))
        assert (await broker.take_rate_tokens(QUEUE, 10)).granted == 10
        await broker.return_rate_tokens(QUEUE, 3)
        assert (await broker.take_rate_tokens(QUEUE, 10)).granted == 3
        await broker.return_rate_tokens(QUEUE, 1000)
        assert (await broker.take_rate_tokens(QUEUE, 1000)).granted == 10

    async def test_changing_a_limit_keeps_the_bucket_not_a_fresh_burst(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.set_rate_limit(RateLimit(QUEUE, 1, 10))
        assert (await broker.take_rate_tokens(QUEUE, 8)).granted == 8
        # Raising the burst does not fill the bucket...
        await broker.set_rate_limit(RateLimit(QUEUE, 1, 100))
        assert (await broker.take_rate_tokens(QUEUE, 100)).granted == 2
        clock.advance(timedelta(seconds=4))
        # ... lowering it caps what the bucket holds.
        await broker.set_rate_limit(RateLimit(QUEUE, 1, 3))
        assert (await broker.take_rate_tokens(QUEUE, 100)).granted == 3
        # A deleted limit set again starts full.
        await broker.delete_rate_limit(QUEUE)
        await broker.set_rate_limit(RateLimit(QUEUE, 1, 7))
        assert (await broker.take_rate_tokens(QUEUE, 100)).granted == 7

    async def test_concurrent_takers_never_spend_one_token_twice(self, broker: Broker) -> None:
        # Two dispatchers owning the queue at once during a failover share one bucket.
        await broker.set_rate_limit(RateLimit(QUEUE, 0.001, 100))
        grants = await asyncio.gather(*(broker.take_rate_tokens(QUEUE, 7) for _ in range(30)))
        assert sum(grant.granted for grant in grants) == 100
