"""The broker conformance suite, shipped with the library so every implementation runs it.

A broker's test module subclasses :class:`BrokerConformance` and provides two fixtures:
``clock`` (a :class:`FakeClock`) and ``broker`` (a fresh, empty Broker on that clock)::

    class TestMemoryBroker(BrokerConformance):
        @pytest.fixture
        def clock(self) -> FakeClock:
            return FakeClock()

        @pytest.fixture
        def broker(self, clock: FakeClock) -> Broker:
            return MemoryBroker(clock)

The tests only use the public interface and move time only with ``clock.advance``.
"""

from __future__ import annotations

import pytest

# Plain asserts in these modules should explain themselves in failures, as in test files.
pytest.register_assert_rewrite(
    "conveyor_broker.testing.admin",
    "conveyor_broker.testing.breakers",
    "conveyor_broker.testing.builders",
    "conveyor_broker.testing.concurrency",
    "conveyor_broker.testing.cron",
    "conveyor_broker.testing.dependencies",
    "conveyor_broker.testing.enqueue",
    "conveyor_broker.testing.events",
    "conveyor_broker.testing.groups",
    "conveyor_broker.testing.holders",
    "conveyor_broker.testing.lease",
    "conveyor_broker.testing.outcomes",
    "conveyor_broker.testing.rates",
    "conveyor_broker.testing.sweeps",
    "conveyor_broker.testing.webhooks",
)

from conveyor_broker.clock import FakeClock  # noqa: E402
from conveyor_broker.testing.admin import AdminTests  # noqa: E402
from conveyor_broker.testing.breakers import BreakerTests  # noqa: E402
from conveyor_broker.testing.concurrency import ConcurrencyLimitTests  # noqa: E402
from conveyor_broker.testing.cron import CronTests  # noqa: E402
from conveyor_broker.testing.dependencies import DependencyTests  # noqa: E402
from conveyor_broker.testing.enqueue import EnqueueTests  # noqa: E402
from conveyor_broker.testing.events import EventTests  # noqa: E402
from conveyor_broker.testing.groups import GroupTests  # noqa: E402
from conveyor_broker.testing.holders import HolderTests  # noqa: E402
from conveyor_broker.testing.lease import LeaseTests  # noqa: E402
from conveyor_broker.testing.outcomes import OutcomeTests  # noqa: E402
from conveyor_broker.testing.rates import RateLimitTests  # noqa: E402
from conveyor_broker.testing.sweeps import SweepTests  # noqa: E402
from conveyor_broker.testing.webhooks import WebhookTests  # noqa: E402


class BrokerConformance(
    EnqueueTests,
    LeaseTests,
    OutcomeTests,
    SweepTests,
    HolderTests,
    DependencyTests,
    AdminTests,
    EventTests,
    WebhookTests,
    CronTests,
    GroupTests,
    RateLimitTests,
    ConcurrencyLimitTests,
    BreakerTests,
):
    """Every behaviour the Broker interface promises. Subclass it and provide the
    ``clock`` and ``broker`` fixtures (see the module docstring)."""


__all__ = ["BrokerConformance", "FakeClock"]
