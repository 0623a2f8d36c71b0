"""Pytest fixtures for the webhook service's tests: a real endpoint, a real dispatcher and
WebhookManagers, all in the test's process, and the :class:`~conveyor_testkit.webhooks.Rig`
bundling them with the ``broker``, ``nc``, ``subjects``, ``bus``, ``clock`` and
``nats_url`` fixtures of the workspace's root conftest (a test module may override any of
those).

A test module takes them by importing them (they are not in a conftest, whose module name
every test folder would share)::

    from conveyor_testkit.fixtures import (  # noqa: F401  (pytest fixtures)
        dispatcher_fixture,
        endpoint_fixture,
        managers_fixture,
        rig_fixture,
    )
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from conveyor_broker import Broker, FakeClock
from conveyor_dispatcher import Dispatcher
from conveyor_runtime.bus import Bus
from conveyor_runtime.nats_connect import NatsClient
from conveyor_runtime.settings import DispatcherSettings
from conveyor_runtime.subjects import Subjects

from conveyor_testkit.webhooks import Endpoint, Managers, Rig

__all__ = ["dispatcher_fixture", "endpoint_fixture", "managers_fixture", "rig_fixture"]


@pytest.fixture(name="endpoint")
async def endpoint_fixture() -> AsyncIterator[Endpoint]:
    """A real HTTP endpoint on a free local port."""
    async with Endpoint() as ep:
        yield ep


@pytest.fixture(name="dispatcher")
async def dispatcher_fixture(
    broker: Broker, nc: NatsClient, clock: FakeClock, subjects: Subjects, nats_url: str
) -> AsyncIterator[Dispatcher]:
    """A real dispatcher, in this process."""
    settings = DispatcherSettings(
        nats_url=nats_url,
        subject_prefix=subjects.prefix,
        broker="memory",
        instance_id=f"disp-{uuid.uuid4().hex[:6]}",
        owner_ttl=2.0,
        register_tick=5.0,
    )
    d = Dispatcher(settings, broker, nc, clock)
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


@pytest.fixture(name="managers")
async def managers_fixture(
    broker: Broker, nc: NatsClient, clock: FakeClock, subjects: Subjects, nats_url: str
) -> AsyncIterator[Managers]:
    """Start WebhookManagers (settings overrides as keywords); each is stopped after."""
    async with Managers(broker, nc, clock, nats_url, subjects) as make:
        yield make


@pytest.fixture(name="rig")
def rig_fixture(
    broker: Broker,
    bus: Bus,
    clock: FakeClock,
    endpoint: Endpoint,
    managers: Managers,
    dispatcher: Dispatcher,
) -> Rig:
    """Registration ``billing`` on queue ``hooks``, with all of the above around it."""
    return Rig(broker, bus, clock, endpoint, managers, dispatcher)
