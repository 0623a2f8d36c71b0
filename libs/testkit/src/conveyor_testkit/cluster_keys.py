"""The cluster key of a test run: the tests' own services and buses seal with it.

The root conftest puts :data:`TEST_CLUSTER_KEY` into ``CONVEYOR_CLUSTER_KEY`` before any
test runs (:func:`use_test_key`), so every settings object a test builds, and every
service process it starts, has it; :func:`cluster_auth` gives a test's own bus the same
key.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from conveyor_runtime.cluster_key import ClusterAuth, generate_key, parse_keys

__all__ = ["TEST_CLUSTER_KEY", "cluster_auth", "use_test_key"]

#: A fresh key per test run.
TEST_CLUSTER_KEY = generate_key()


def use_test_key() -> None:
    """Make :data:`TEST_CLUSTER_KEY` the key of every service this process configures (and
    of the processes it starts), whatever the environment held."""
    os.environ["CONVEYOR_CLUSTER_KEY"] = TEST_CLUSTER_KEY
    os.environ.pop("CONVEYOR_CLUSTER_KEY_FILE", None)
    os.environ.pop("CONVEYOR_ALLOW_UNSIGNED", None)


def cluster_auth(
    *keys: str, allow_unsigned: bool = False, now: Callable[[], float] | None = None
) -> ClusterAuth:
    """An auth with ``keys`` (base64; default :data:`TEST_CLUSTER_KEY`): the first signs."""
    parsed = parse_keys(keys or (TEST_CLUSTER_KEY,))
    if now is None:
        return ClusterAuth(parsed, allow_unsigned=allow_unsigned)
    return ClusterAuth(parsed, allow_unsigned=allow_unsigned, now=now)
