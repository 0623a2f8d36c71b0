"""The in-memory broker passes the conformance suite, plain and encrypted."""

from __future__ import annotations

import os

import pytest
from conveyor_broker.encrypted import EncryptedBroker
from conveyor_broker.interface import MAX_BATCH, Broker
from conveyor_broker.keyring import Keyring
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.testing import BrokerConformance, FakeClock
from conveyor_broker.types import NewTask


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


class _PagingBroker(MemoryBroker):
    """A broker with no ``_due_among`` of its own: the base class's default, which pages
    through ``_due_queues``."""

    _due_among = Broker._due_among


async def test_the_default_due_among_pages_through_every_due_queue() -> None:
    clock = FakeClock()
    broker = _PagingBroker(clock)
    names = [f"q{n:04d}" for n in range(2 * MAX_BATCH + 5)]
    for start in range(0, len(names), MAX_BATCH):
        await broker.enqueue_batch([NewTask(q, "t") for q in names[start : start + MAX_BATCH]])
    asked = [names[0], names[MAX_BATCH + 1], names[-1], "q9999", "a-first"]
    assert await broker.due_among(asked) == [names[0], names[MAX_BATCH + 1], names[-1]]
    assert await broker.due_among(["zz"]) == []
    assert await broker.due_among(["a"]) == []
