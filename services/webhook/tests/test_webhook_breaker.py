"""The per-endpoint circuit breaker's state machine (pure, caller-supplied time)."""

from __future__ import annotations

import pytest
from conveyor_webhook.breaker import BreakerState, CircuitBreaker


def test_it_opens_after_threshold_consecutive_transport_failures() -> None:
    breaker = CircuitBreaker(threshold=3, cooldown=10.0)
    assert breaker.cap(0.0) is None
    breaker.record_failure(1.0)
    breaker.record_failure(2.0)
    assert breaker.state(2.0) is BreakerState.CLOSED
    assert breaker.failures == 2
    breaker.record_failure(3.0)
    assert breaker.state(3.0) is BreakerState.OPEN
    assert breaker.cap(3.0) == 0
    assert breaker.reopens_at() == 13.0


def test_an_answer_resets_the_count() -> None:
    breaker = CircuitBreaker(threshold=2, cooldown=10.0)
    breaker.record_failure(1.0)
    breaker.record_success(2.0)
    breaker.record_failure(3.0)
    assert breaker.state(3.0) is BreakerState.CLOSED
    breaker.record_failure(4.0)
    assert breaker.state(4.0) is BreakerState.OPEN


def test_after_the_cooldown_a_single_probe_slot() -> None:
    breaker = CircuitBreaker(threshold=1, cooldown=10.0)
    breaker.record_failure(0.0)
    assert breaker.cap(9.99) == 0
    assert breaker.cap(10.0) == 1
    assert breaker.state(10.0) is BreakerState.HALF_OPEN
    assert breaker.reopens_at() is None


def test_a_successful_probe_closes_it() -> None:
    breaker = CircuitBreaker(threshold=1, cooldown=10.0)
    breaker.record_failure(0.0)
    breaker.record_success(11.0)
    assert breaker.state(11.0) is BreakerState.CLOSED
    assert breaker.cap(11.0) is None
    assert breaker.failures == 0


def test_a_failed_probe_reopens_it_for_another_cooldown() -> None:
    breaker = CircuitBreaker(threshold=5, cooldown=10.0)
    for t in range(5):
        breaker.record_failure(float(t))
    breaker.record_failure(20.0)  # the probe, half-open since t=14
    assert breaker.state(20.0) is BreakerState.OPEN
    assert breaker.reopens_at() == 30.0
    assert breaker.cap(29.0) == 0
    assert breaker.cap(30.0) == 1


def test_answers_of_deliveries_in_flight_while_open_change_nothing() -> None:
    breaker = CircuitBreaker(threshold=1, cooldown=10.0)
    breaker.record_failure(0.0)
    breaker.record_success(1.0)
    breaker.record_failure(2.0)
    assert breaker.state(5.0) is BreakerState.OPEN
    assert breaker.reopens_at() == 10.0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold"):
        CircuitBreaker(threshold=0, cooldown=1.0)
    with pytest.raises(ValueError, match="cooldown"):
        CircuitBreaker(threshold=1, cooldown=0.0)


def test_only_the_probes_answer_decides_a_half_open_breaker() -> None:
    breaker = CircuitBreaker(threshold=1, cooldown=10.0)
    before = breaker.ticket(0.0)  # sent while closed, still in flight
    breaker.record_failure(1.0)  # another delivery's failure opens it
    assert breaker.state(1.0) is BreakerState.OPEN
    probe = breaker.ticket(11.0)
    assert probe.probe

    # The old request answers now: neither its success nor its failure counts.
    breaker.record_success(12.0, before)
    assert breaker.state(12.0) is BreakerState.HALF_OPEN
    breaker.record_failure(12.0, before)
    assert breaker.state(12.0) is BreakerState.HALF_OPEN

    # The probe's answer does.
    breaker.record_success(13.0, probe)
    assert breaker.state(13.0) is BreakerState.CLOSED
    assert breaker.cap(13.0) is None


def test_a_probes_transport_failure_reopens_it_and_stale_answers_stay_ignored() -> None:
    breaker = CircuitBreaker(threshold=2, cooldown=10.0)
    breaker.record_failure(0.0)
    breaker.record_failure(0.0)
    sent_while_open = breaker.ticket(5.0)
    assert not sent_while_open.probe
    probe = breaker.ticket(10.0)
    breaker.record_success(11.0, sent_while_open)
    assert breaker.state(11.0) is BreakerState.HALF_OPEN
    breaker.record_failure(11.0, probe)
    assert breaker.state(11.0) is BreakerState.OPEN
    assert breaker.reopens_at() == 21.0
    # After it closes again, answers of requests from the earlier periods count nothing.
    breaker.record_success(22.0, breaker.ticket(22.0))
    assert breaker.state(22.0) is BreakerState.CLOSED
    breaker.record_failure(23.0, probe)
    breaker.record_failure(23.0, sent_while_open)
    assert breaker.failures == 0


def test_a_probe_answered_with_a_client_error_closes_it() -> None:
    # The breaker guards the transport: an HTTP 404 is an answer (recorded as success).
    breaker = CircuitBreaker(threshold=1, cooldown=10.0)
    breaker.record_failure(0.0)
    probe = breaker.ticket(10.0)
    breaker.record_success(10.5, probe)
    assert breaker.state(10.5) is BreakerState.CLOSED
