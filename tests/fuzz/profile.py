"""How much the fuzz suite tries: a bounded, deterministic run by default (what CI runs as
part of ``pytest``), longer or exploring new inputs on demand.

- ``CONVEYOR_FUZZ_EXAMPLES``: examples per test (default 25);
- ``CONVEYOR_FUZZ_RANDOM=1``: draw new inputs each run instead of the same ones (a failure
  prints what reproduces it).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

#: Examples per fuzz test.
EXAMPLES = int(os.environ.get("CONVEYOR_FUZZ_EXAMPLES", "25"))
#: Explore new inputs each run (else the same inputs every run: CI stays deterministic).
RANDOM = os.environ.get("CONVEYOR_FUZZ_RANDOM", "") not in ("", "0", "false")

settings.register_profile(
    "conveyor-fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.function_scoped_fixture,
    ],
)
#: The settings of every fuzz test (not loaded globally: other tests keep their own).
FUZZ = settings.get_profile("conveyor-fuzz")


def fuzz(share: float = 1.0) -> settings:
    """The fuzz settings with ``share`` of :data:`EXAMPLES` (at least one example), for a
    test whose examples cost more than most."""
    return settings(FUZZ, max_examples=max(1, round(EXAMPLES * share)))
