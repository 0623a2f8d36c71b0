"""Concurrency limits per key: which limit applies to a key, and what a lease does with
the due tasks it picked.

Both brokers decide with these functions, under the same rule:

* a key takes the limit of its queue's longest matching pattern (then the first in code
  point order: the rule of :func:`conveyor_broker.groups.config_for`); a task with no
  key, or whose key no pattern matches, is not limited;
* a lease walks its due tasks in lease order; a limited task whose key already has
  ``per_key`` ACTIVE tasks (counting the ones this lease took) is parked HELD instead of
  leased, so it leaves the due set and the tasks of other keys behind it flow (no
  head-of-line blocking by a hot key);
* when an ACTIVE task of a limited key stops being ACTIVE (acked, failed, released,
  reaped, canceled), its key has room again: the queue's next lease first makes the
  oldest HELD tasks of that key PENDING again, as many as there is room for, with their
  old due time (so they keep their place), then leases as above, so a promoted task
  never runs beyond the limit. Raising or deleting a limit promotes at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from conveyor_broker.groups import pattern_regex
from conveyor_broker.types import ConcurrencyLimit


def limit_for(key: str | None, limits: Iterable[ConcurrencyLimit]) -> int | None:
    """The per-key limit of ``key`` among its queue's ``limits``; None: not limited."""
    if key is None:
        return None
    matching = [c for c in limits if pattern_regex(c.pattern).fullmatch(key)]
    if not matching:
        return None
    return min(matching, key=lambda c: (-len(c.pattern), c.pattern)).per_key


@dataclass(frozen=True, slots=True)
class LeasePlan:
    """What a lease does with its candidates: the indexes it leases and those it parks,
    each in candidate order."""

    lease: list[int]
    park: list[int]


def plan_lease(
    keys: Sequence[str | None],
    limits: Sequence[ConcurrencyLimit],
    active: Mapping[str, int],
    want: int,
) -> LeasePlan:
    """Split due candidates (their concurrency keys, in lease order) into at most
    ``want`` to lease and those to park, given the ACTIVE count per key in ``active``
    (keys it lacks have none). Candidates after the ``want``-th leased one are left as
    they are."""
    taken: dict[str, int] = {}
    lease: list[int] = []
    park: list[int] = []
    for index, key in enumerate(keys):
        if len(lease) >= want:
            break
        per_key = limit_for(key, limits)
        if per_key is None or key is None:
            lease.append(index)
            continue
        running = active.get(key, 0) + taken.get(key, 0)
        if running < per_key:
            taken[key] = taken.get(key, 0) + 1
            lease.append(index)
        else:
            park.append(index)
    return LeasePlan(lease, park)


def room(
    keys: Iterable[str], limits: Sequence[ConcurrencyLimit], active: Mapping[str, int]
) -> dict[str, int]:
    """How many more tasks of each of ``keys`` may be ACTIVE now (unlimited keys are
    left out; a key at or over its limit has 0)."""
    out: dict[str, int] = {}
    for key in keys:
        per_key = limit_for(key, limits)
        if per_key is not None:
            out[key] = max(0, per_key - active.get(key, 0))
    return out
