"""Parked deliveries: the ones whose endpoint answered ``accepted`` (asynchronous mode).

A parked delivery keeps its slot in the gateway, but the gateway's bulk heartbeat leaves
its lease alone: only the endpoint's Heartbeat callbacks extend it. So the webhook gateway
watches each one until its last known lease expiry, and a delivery whose lease lapses with
no heartbeat is ended (see :class:`~conveyor_webhook.gateway.WebhookGateway`).

:class:`ParkedDeliveries` is the one record of which leases are parked, the lease expiry
known for each, and its lapse timer. It also keeps what the gateway's own extensions told
of the leases of open (not yet parked) deliveries, which is the known expiry of one whose
extension fails at park time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterator, Set
from dataclasses import dataclass
from datetime import datetime

from conveyor_broker.clock import Clock


@dataclass(frozen=True, slots=True)
class Parked:
    """A parked delivery whose lease expiry is known."""

    task_id: str
    #: The latest lease expiry the gateway knows of.
    expires: datetime


class ParkedDeliveries:
    """The parked deliveries of one webhook gateway, by lease id.

    A lease is parked from :meth:`park` until :meth:`forget` (or :meth:`clear`); once
    :meth:`watch` gives its lease expiry, ``on_due(lease_id)`` runs on the event loop when
    that expiry passes (unless watched again or forgotten first). ``in`` and iteration
    name the parked leases (so this is the gateway's heartbeat skip list).
    """

    def __init__(self, clock: Clock, on_due: Callable[[str], None]) -> None:
        self._clock = clock
        self._on_due = on_due
        self._leases: set[str] = set()
        self._watched: dict[str, Parked] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        # Lease id -> the latest expiry the gateway's own extensions gave it.
        self._extended: dict[str, datetime] = {}

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    def __iter__(self) -> Iterator[str]:
        return iter(self._leases)

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def leases(self) -> Set[str]:
        """The parked leases."""
        return self._leases

    @property
    def watched(self) -> int:
        """Parked deliveries whose lease expiry is known."""
        return len(self._watched)

    def park(self, lease_id: str) -> None:
        """Park ``lease_id`` (its lease expiry is not known yet)."""
        self._leases.add(lease_id)

    def get(self, lease_id: str) -> Parked | None:
        """The parked delivery ``lease_id`` with its known expiry (None: not parked, or its
        expiry not known yet)."""
        return self._watched.get(lease_id)

    def watch(self, lease_id: str, task_id: str, expires: datetime) -> None:
        """Know ``expires`` as the lease expiry of parked ``lease_id`` (a new record), and
        call ``on_due`` once it passes."""
        self._watched[lease_id] = Parked(task_id, expires)
        old = self._timers.pop(lease_id, None)
        if old is not None:
            old.cancel()
        delay = max(0.0, (expires - self._clock.now()).total_seconds())
        self._timers[lease_id] = asyncio.get_running_loop().call_later(delay, self._due, lease_id)

    def _due(self, lease_id: str) -> None:
        self._timers.pop(lease_id, None)
        self._on_due(lease_id)

    def note_extended(self, lease_ids: Collection[str], until: datetime) -> None:
        """The gateway extended ``lease_ids``, each until ``until`` at least."""
        extended = self._extended
        for lease_id in lease_ids:
            known = extended.get(lease_id)
            extended[lease_id] = until if known is None else max(known, until)

    def extended_until(self, lease_id: str) -> datetime | None:
        """The latest expiry the gateway's own extensions gave ``lease_id`` (a lower bound
        of the broker's); None when it never extended it."""
        return self._extended.get(lease_id)

    def forget(self, lease_id: str) -> bool:
        """Stop tracking ``lease_id`` (its timer canceled, what the gateway's extensions
        told of it dropped); True when it was parked."""
        self._extended.pop(lease_id, None)
        handle = self._timers.pop(lease_id, None)
        if handle is not None:
            handle.cancel()
        self._watched.pop(lease_id, None)
        if lease_id not in self._leases:
            return False
        self._leases.remove(lease_id)
        return True

    def clear(self) -> list[str]:
        """Stop tracking everything (every timer canceled); the leases that were parked."""
        parked = list(self._leases)
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        self._watched.clear()
        self._leases.clear()
        self._extended.clear()
        return parked
