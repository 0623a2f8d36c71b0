"""The in-memory broker passes the conformance suite."""

from __future__ import annotations

import pytest
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.testing import BrokerConformance, FakeClock


class TestMemoryBroker(BrokerConformance):
    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    def broker(self, clock: FakeClock) -> MemoryBroker:
        return MemoryBroker(clock)
