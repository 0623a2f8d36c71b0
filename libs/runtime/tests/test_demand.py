"""Demand: which queues some gateway serves, from the registrations heard."""

from __future__ import annotations

import pytest
from conveyor_runtime.demand import Demand


def test_a_queue_is_served_while_a_registration_on_it_is_younger_than_the_ttl() -> None:
    demand = Demand(ttl=15.0)
    assert not demand.served("mail", now=0.0)
    demand.heard("mail", "gw-1", closing=False, now=100.0)
    assert demand.served("mail", now=100.0)
    assert demand.served("mail", now=114.9)
    assert not demand.served("mail", now=115.0)
    assert not demand.served("other", now=100.0)
    # Each registration renews it.
    demand.heard("mail", "gw-1", closing=False, now=110.0)
    assert demand.served("mail", now=124.9)


def test_any_live_gateway_serves_the_queue_and_a_closing_one_stops_at_once() -> None:
    demand = Demand(ttl=15.0)
    demand.heard("mail", "gw-1", closing=False, now=0.0)
    demand.heard("mail", "gw-2", closing=False, now=10.0)
    assert demand.served("mail", now=20.0)  # gw-1 expired, gw-2 not
    demand.heard("mail", "gw-2", closing=True, now=21.0)
    assert not demand.served("mail", now=21.0)
    # A goodbye from a gateway never heard of, or on a queue never served, changes nothing.
    demand.heard("mail", "gw-3", closing=True, now=21.0)
    demand.heard("none", "gw-1", closing=True, now=21.0)
    assert not demand.served("none", now=21.0)
    demand.heard("mail", "gw-1", closing=False, now=22.0)
    demand.heard("mail", "gw-1", closing=True, now=23.0)
    assert not demand.served("mail", now=23.0)
    assert len(demand) == 0


def test_queues_lists_the_served_ones_by_name_and_expire_forgets_the_rest() -> None:
    demand = Demand(ttl=5.0)
    demand.heard("zeta", "gw-1", closing=False, now=10.0)
    demand.heard("alpha", "gw-1", closing=False, now=10.0)
    demand.heard("old", "gw-2", closing=False, now=1.0)
    demand.heard("mixed", "gw-2", closing=False, now=1.0)
    demand.heard("mixed", "gw-3", closing=False, now=9.0)
    assert demand.queues(now=10.0) == ["alpha", "mixed", "zeta"]
    assert len(demand) == 4
    demand.expire(now=10.0)
    assert len(demand) == 3
    assert demand.queues(now=10.0) == ["alpha", "mixed", "zeta"]
    demand.expire(now=14.0)
    assert demand.queues(now=14.0) == ["alpha", "zeta"]
    demand.expire(now=15.0)
    assert len(demand) == 0
    assert demand.queues(now=15.0) == []


def test_the_ttl_must_be_positive() -> None:
    for ttl in (0.0, -1.0):
        with pytest.raises(ValueError, match="ttl"):
            Demand(ttl=ttl)
