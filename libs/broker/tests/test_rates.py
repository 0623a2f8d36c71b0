"""The token bucket's arithmetic (conveyor_broker.rates), on its own."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from conveyor_broker.rates import default_burst, refilled, take
from conveyor_broker.types import RateGrant, RateLimit

T0 = datetime(2030, 1, 1, tzinfo=UTC)
LIMIT = RateLimit("q", 10.0, 20)


def test_refill_follows_the_clock_up_to_the_burst() -> None:
    assert refilled(LIMIT, 0.0, T0, T0) == 0.0
    assert refilled(LIMIT, 0.0, T0, T0 + timedelta(milliseconds=250)) == 2.5
    assert refilled(LIMIT, 5.0, T0, T0 + timedelta(seconds=1)) == 15.0
    assert refilled(LIMIT, 5.0, T0, T0 + timedelta(days=3)) == 20.0


def test_a_clock_behind_the_last_refill_mints_nothing() -> None:
    assert refilled(LIMIT, 3.5, T0, T0 - timedelta(seconds=30)) == 3.5


def test_take_grants_whole_tokens_and_says_when_the_next_comes() -> None:
    assert take(LIMIT, 20.0, 7) == (RateGrant(7), 13.0)
    grant, left = take(LIMIT, 2.75, 5)
    assert grant.granted == 2
    assert left == 0.75
    assert grant.wait == timedelta(milliseconds=25)
    assert take(LIMIT, 0.0, 1) == (RateGrant(0, timedelta(milliseconds=100)), 0.0)


def test_a_token_refilled_to_a_hair_under_one_is_granted() -> None:
    tokens = refilled(LIMIT, 0.0, T0, T0 + timedelta(seconds=0.1))
    grant, _ = take(RateLimit("q", 3.0, 3), 0.1 * 3 + 0.7 - 1e-12, 1)
    assert grant.granted == 1
    assert take(LIMIT, tokens, 1)[0].granted == 1


def test_the_wait_is_never_zero() -> None:
    # At a million a second the next token is half a microsecond away: wait one.
    grant, _ = take(RateLimit("q", 1e6, 1), 0.5, 1)
    assert grant == RateGrant(0, timedelta(microseconds=1))


def test_the_default_burst_is_a_second_of_tokens() -> None:
    assert default_burst(50) == 50
    assert default_burst(0.2) == 1
    assert default_burst(2.5) == 3
    assert default_burst(float("inf")) == 1
    assert default_burst(float("nan")) == 1
