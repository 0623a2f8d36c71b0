"""Pytest fixtures for applications that use Conveyor: a real server per test.

Enable them in a ``conftest.py``::

    pytest_plugins = ["conveyor_cli.pytest_plugin"]

then ask for ``conveyor_server`` (a running
:class:`~conveyor_cli.testing.BlockingEmbeddedServer`: memory broker, embedded
nats-server, a free loopback port; stopped after the test). It works in plain and in
async tests alike: the server runs on a thread of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conveyor_cli.testing import BlockingEmbeddedServer


@pytest.fixture
def conveyor_server() -> Iterator[BlockingEmbeddedServer]:
    """A fresh embedded Conveyor server for one test: give ``conveyor_server.target`` to
    ``Client`` or ``AsyncClient``, and run the application's worker with
    ``with conveyor_server.running(worker):``."""
    with BlockingEmbeddedServer() as server:
        yield server
