"""The pure rules of circuit breakers (conveyor_broker.breakers): which config applies to
a type, and the breaker's state machine."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from conveyor_broker.breakers import BreakerMachine, config_for
from conveyor_broker.types import BreakerConfig, BreakerScope, BreakerStatus

T0 = datetime(2030, 1, 1, tzinfo=UTC)
WINDOW = timedelta(seconds=10)
COOLDOWN = timedelta(seconds=30)
LAPSE = timedelta(seconds=5)


def status_of(machine: BreakerMachine) -> BreakerStatus | None:
    """The machine's status, read afresh (a method call may have changed it)."""
    return machine.status


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _machine(failures: int = 3) -> BreakerMachine:
    return BreakerMachine(
        BreakerConfig("q", "*", failures=failures, window=WINDOW, cooldown=COOLDOWN)
    )


def _opened(failures: int = 3, at: float = 0) -> BreakerMachine:
    machine = _machine(failures)
    for n in range(failures):
        machine.failed(_at(at + n * 0.001))
    assert machine.status is BreakerStatus.OPEN
    return machine


def _half_open(at: float = 0) -> tuple[BreakerMachine, datetime]:
    """A machine that opened at ``at`` and went half-open at its cool-down; and when."""
    machine = _opened(at=at)
    assert machine.until is not None
    when = machine.until
    assert machine.tick(when)
    return machine, when


# ----------------------------------------------------------------------- config_for


def test_a_type_takes_its_queues_longest_matching_pattern() -> None:
    every = BreakerConfig("q", "*")
    email = BreakerConfig("q", "email.*")
    send = BreakerConfig("q", "email.send")
    configs = [every, send, email]
    assert config_for("email.send", configs) == send
    assert config_for("email.bounce", configs) == email
    assert config_for("sms.send", configs) == every
    assert config_for("email.send", [every, email]) == email


def test_equally_long_patterns_go_by_code_point_order() -> None:
    question = BreakerConfig("q", "a?c", failures=1)
    star = BreakerConfig("q", "ab*", failures=2)
    upper = BreakerConfig("q", "A*c", failures=3)
    # "?" (U+003F) sorts before "b".
    assert config_for("abc", [star, question]) == question
    assert config_for("abc", [question, star]) == question
    assert config_for("Abc", [star, upper, question]) == upper


def test_a_type_no_pattern_matches_has_no_breaker() -> None:
    assert config_for("anything", []) is None
    configs = [BreakerConfig("q", "email.*"), BreakerConfig("q", "sms.?")]
    assert config_for("push.send", configs) is None
    # A glob matches the whole type, and "?" exactly one character.
    assert config_for("sms.ab", configs) is None
    assert config_for("xemail.send", configs) is None
    assert config_for("sms.a", configs) == configs[1]


def test_wildcards_match_any_text_even_newlines_and_dots() -> None:
    config = BreakerConfig("q", "a*z")
    assert config_for("az", [config]) == config
    assert config_for("a.\nz", [config]) == config
    assert config_for("a.z.", [config]) is None


# ------------------------------------------------------------------ BreakerMachine


def test_a_new_breaker_is_closed_and_allows() -> None:
    machine = _machine()
    assert machine.status is None
    assert machine.allows(T0)
    assert not machine.tick(T0)
    assert not machine.succeeded(T0)
    assert not machine.succeeded(T0, probe=True)


def test_it_opens_after_n_failures_within_the_window() -> None:
    machine = _machine(3)
    assert machine.failed(_at(0)) is False
    assert machine.failed(_at(4)) is False
    assert machine.allows(_at(5))
    assert machine.failed(_at(10)) is True  # exactly the window apart still counts
    assert machine.status is BreakerStatus.OPEN
    assert machine.opened_at == _at(10)
    assert machine.until == _at(10) + COOLDOWN
    assert machine.tripped_by == 3
    assert not machine.allows(_at(11))


def test_one_failure_opens_a_breaker_of_one() -> None:
    machine = _machine(1)
    assert machine.failed(T0) is True
    assert machine.tripped_by == 1


def test_successes_do_not_reset_the_count() -> None:
    machine = _machine(3)
    for second in range(3):
        machine.failed(_at(second))
        if second < 2:
            assert machine.succeeded(_at(second + 0.5)) is False
            assert machine.status is None
    assert machine.status is BreakerStatus.OPEN


def test_old_failures_fall_out_of_the_window() -> None:
    machine = _machine(3)
    assert not machine.failed(_at(0))
    assert not machine.failed(_at(5))
    # The failure at 0 is more than the window old: two count.
    assert not machine.failed(_at(10.001))
    assert machine.status is None
    assert machine.failed(_at(12)) is True  # 5, 10.001 and 12
    assert machine.tripped_by == 3


def test_failures_far_apart_never_open_it() -> None:
    machine = _machine(2)
    for n in range(10):
        assert not machine.failed(_at(n * 11))
    assert machine.status is None


def test_an_open_breaker_goes_half_open_at_its_cooldown() -> None:
    machine = _opened(at=0)
    assert machine.until is not None
    until = machine.until
    assert not machine.tick(until - timedelta(microseconds=1))
    assert machine.status is BreakerStatus.OPEN
    assert not machine.allows(until - timedelta(microseconds=1))
    assert machine.tick(until) is True
    assert status_of(machine) is BreakerStatus.HALF_OPEN
    assert not machine.tick(until)  # once
    assert machine.allows(until)


def test_allows_moves_it_half_open_by_itself() -> None:
    machine = _opened(at=0)
    assert machine.until is not None
    assert machine.allows(machine.until + timedelta(seconds=1))
    assert machine.status is BreakerStatus.HALF_OPEN


def test_a_half_open_breaker_lets_one_probe_go() -> None:
    machine, now = _half_open()
    assert machine.allows(now)
    machine.probe_sent(now, LAPSE)
    assert machine.probing
    assert machine.until == now + LAPSE
    assert not machine.allows(now)
    assert not machine.allows(now + LAPSE - timedelta(microseconds=1))
    assert machine.status is BreakerStatus.HALF_OPEN


def test_the_probes_success_closes_it_and_the_count_starts_again() -> None:
    machine, now = _half_open()
    machine.probe_sent(now, LAPSE)
    done = now + timedelta(seconds=1)
    assert machine.succeeded(done, probe=True) is True
    assert machine.status is None
    assert machine.opened_at is None
    assert machine.until is None
    assert not machine.probing
    assert machine.allows(done)
    # The failures before it opened are forgotten: three new ones are needed.
    assert not machine.failed(done)
    assert not machine.failed(done + timedelta(seconds=1))
    assert machine.failed(done + timedelta(seconds=2))


def test_the_probes_failure_opens_it_again() -> None:
    machine, now = _half_open()
    machine.probe_sent(now, LAPSE)
    done = now + timedelta(seconds=1)
    assert machine.failed(done, probe=True) is True
    assert machine.status is BreakerStatus.OPEN
    assert machine.opened_at == done
    assert machine.until == done + COOLDOWN
    assert machine.tripped_by == 1
    assert not machine.probing
    assert not machine.allows(done + COOLDOWN - timedelta(microseconds=1))
    assert machine.allows(done + COOLDOWN)
    assert status_of(machine) is BreakerStatus.HALF_OPEN


def test_outcomes_of_other_attempts_while_open_change_nothing() -> None:
    machine = _opened(at=0)
    opened_at, until = machine.opened_at, machine.until
    for second in (1, 2, 3, 4, 5):
        assert machine.failed(_at(second)) is False
        assert machine.succeeded(_at(second)) is False
    # Even one said to be a probe: there is no probe while it is OPEN.
    assert machine.succeeded(_at(6), probe=True) is False
    assert (machine.status, machine.opened_at, machine.until) == (
        BreakerStatus.OPEN,
        opened_at,
        until,
    )
    assert machine.tripped_by == 3


def test_outcomes_of_other_attempts_while_half_open_change_nothing() -> None:
    machine, now = _half_open()
    machine.probe_sent(now, LAPSE)
    later = now + timedelta(seconds=1)
    assert machine.failed(later) is False
    assert machine.succeeded(later) is False
    assert machine.status is BreakerStatus.HALF_OPEN
    assert machine.probing
    assert machine.until == now + LAPSE


def test_a_probe_whose_chance_lapsed_lets_another_go() -> None:
    machine, now = _half_open()
    machine.probe_sent(now, LAPSE)
    lapsed = now + LAPSE
    assert machine.tick(lapsed) is False  # the status stays HALF_OPEN
    assert not machine.probing
    assert machine.status is BreakerStatus.HALF_OPEN
    assert machine.allows(lapsed)
    machine.probe_sent(lapsed, LAPSE)
    assert not machine.allows(lapsed)
    # The second probe's outcome decides.
    assert machine.succeeded(lapsed + timedelta(seconds=1), probe=True)
    assert machine.status is None


def test_probe_sent_does_nothing_unless_half_open() -> None:
    machine = _machine()
    machine.probe_sent(T0, LAPSE)
    assert not machine.probing
    assert machine.until is None
    opened = _opened()
    until = opened.until
    opened.probe_sent(_at(1), LAPSE)
    assert not opened.probing
    assert opened.until == until


@pytest.mark.parametrize("scope", list(BreakerScope))
def test_the_scope_does_not_change_the_rules(scope: BreakerScope) -> None:
    machine = BreakerMachine(BreakerConfig("q", failures=2, window=WINDOW, scope=scope))
    assert not machine.failed(T0)
    assert machine.failed(T0 + timedelta(seconds=1))
    assert machine.config.scope is scope
