"""The in-memory broker passes the conformance suite, plain and encrypted."""

from __future__ import annotations

import os

import pytest
from conveyor_broker.encrypted import EncryptedBroker
from conveyor_broker.keyring import Keyring
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.testing import BrokerConformance, FakeClock


class TestMemoryBroker(BrokerConformance):
    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    def broker(self, clock: FakeClock) -> MemoryBroker:
        return MemoryBroker(clock)


class TestEncryptedMemoryBroker(BrokerConformance):
    """The encrypted broker passes the same suite around the memory broker."""

    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    def broker(self, clock: FakeClock) -> EncryptedBroker:
        keyring = Keyring({"old": os.urandom(32), "new": os.urandom(32)}, primary="new")
        return EncryptedBroker(MemoryBroker(clock), keyring)
