"""Keeping a gateway's leases alive: the worker's heartbeat extends every held lease at
once, one lease can be extended on its own, and a delivery's progress is stored under
its lease.

A lease the broker says is lost is dropped at once (``lose``: the gateway frees its slot
and tells the worker to cancel that run).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Container, Coroutine, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from conveyor_broker import Broker, LeaseLost, LeaseRef
from conveyor_broker.clock import Clock

from conveyor_gateway.holdings import Held, Holdings

logger = logging.getLogger(__name__)

#: Told which held leases an extension reached and that each now lasts at least until the
#: given time (the broker's expiry may be later: this is read before the call).
OnExtended = Callable[[Collection[str], datetime], None]


class LeaseExtension:
    """Extends the leases of the deliveries in ``holdings``.

    The bulk heartbeat leaves the leases in ``skips`` alone (their worker keeps them alive
    some other way) and runs one at a time: a heartbeat that lands during one adds
    nothing, since the next comes well before any lease could lapse. ``on_extended``, when
    given, hears of every extension this makes (the bulk one and single ones).
    """

    def __init__(
        self,
        gateway_id: str,
        *,
        broker: Broker,
        holdings: Holdings,
        lease_ttl: timedelta,
        clock: Clock,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        lose: Callable[[str], Held | None],
        skips: Container[str] = frozenset(),
        on_extended: OnExtended | None = None,
    ) -> None:
        self._id = gateway_id
        self._broker = broker
        self._held = holdings.by_lease
        self._expires = holdings.expires
        self._ttl = lease_ttl
        self._clock = clock
        self._spawn = spawn
        self._lose = lose
        self._skips = skips
        self._on_extended = on_extended
        self._extending = False

    def heartbeat(self) -> None:
        """Extend every held lease not skipped, in the background."""
        if self._extending or not self._held:
            return
        self._extending = True
        self._spawn(self._extend())

    async def _extend(self) -> None:
        # The broker's expiry is at least this plus the TTL.
        started = self._clock.now()
        try:
            skips = self._skips
            # A batch's lease is every member's: each is extended.
            refs = [
                LeaseRef(t.task_id, t.lease_id)
                for h in self._held.values()
                if h.lease_id not in skips
                for t in h.tasks
            ]
            if not refs:
                return
            lost = await self._broker.extend_leases(refs, self._ttl)
        except Exception:
            logger.exception("gateway.extend_failed gateway=%s", self._id)
            return
        finally:
            self._extending = False
        held = self._held
        gone = _gone(lost, held)
        kept = list(
            dict.fromkeys(r.lease_id for r in refs if r.lease_id not in gone and r.lease_id in held)
        )
        until = started + self._ttl
        expires = self._expires
        for lease_id in kept:
            if expires.get(lease_id, until) <= until:
                expires[lease_id] = until
        if kept and self._on_extended is not None:
            self._on_extended(kept, until)
        for lease_id in gone:
            dropped = self._lose(lease_id)
            if dropped is None:
                continue  # completed meanwhile
            logger.info(
                "gateway.lease_lost_on_heartbeat gateway=%s task=%s lease=%s",
                self._id,
                dropped.task_id,
                dropped.lease_id,
            )

    async def extend(self, task_id: str, lease_id: str) -> datetime | None:
        """Extend one held lease by the lease TTL; the new expiry. None when it is not
        held. When the broker says the lease is lost, it is dropped and LeaseLost raised."""
        held = self._held.get(lease_id)
        if held is None or held.task_id != task_id:
            return None
        if held.members:
            expires = await self._extend_batch(held)
        else:
            try:
                expires = await self._broker.extend_lease(task_id, lease_id, self._ttl)
            except LeaseLost:
                self._lose(lease_id)
                raise
        if self._held.get(lease_id) is held:
            self._expires[lease_id] = expires
        if self._on_extended is not None and self._held.get(lease_id) is held:
            self._on_extended((lease_id,), expires)
        return expires

    async def _extend_batch(self, held: Held) -> datetime:
        """Extend every member's lease of the batch ``held``; the new expiry. LeaseLost
        (the batch dropped) once no member's lease is left."""
        until = self._clock.now() + self._ttl
        refs = [LeaseRef(t.task_id, t.lease_id) for t in held.members]
        lost = await self._broker.extend_leases(refs, self._ttl)
        if held.lease_id in _gone(lost, {held.lease_id: held}):
            self._lose(held.lease_id)
            raise LeaseLost(held.task_id, held.lease_id)
        return until

    def expired(self, now: datetime, grace: timedelta) -> list[str]:
        """The held leases (but the skipped) that ran out more than ``grace`` ago as far
        as this gateway knows: nothing extended them (the worker stopped heartbeating),
        so the reaper may hand their tasks to another worker. None while an extension is
        under way (it may be renewing them)."""
        if self._extending:
            return []
        skips = self._skips
        return [
            lease_id
            for lease_id, until in self._expires.items()
            if now - until > grace and lease_id not in skips
        ]

    def progress(self, task_id: str, lease_id: str, data: bytes) -> None:
        """Store ``data`` as the progress of the held delivery, in the background."""
        held = self._held.get(lease_id)
        if held is None or held.task_id != task_id:
            logger.info(
                "gateway.progress_for_unknown_lease gateway=%s task=%s lease=%s",
                self._id,
                task_id,
                lease_id,
            )
            return
        self._spawn(self._store_progress(held, data))

    async def _store_progress(self, held: Held, data: bytes) -> None:
        try:
            await self._broker.set_progress(held.task_id, held.lease_id, data)
        except LeaseLost:
            logger.info("gateway.progress_lease_lost gateway=%s task=%s", self._id, held.task_id)
        except Exception:
            logger.exception("gateway.progress_failed gateway=%s task=%s", self._id, held.task_id)


def _gone(lost: Iterable[LeaseRef], held: Mapping[str, Held]) -> set[str]:
    """The held leases that ``lost`` (an extension's answer) says are gone: a single
    task's lease when its task's is, a batch's once every member's is (a member canceled
    by an operator loses only its own outcome; the batch runs on for the others)."""
    lost_tasks: dict[str, set[str]] = {}
    for ref in lost:
        lost_tasks.setdefault(ref.lease_id, set()).add(ref.task_id)
    gone: set[str] = set()
    for lease_id, tasks in lost_tasks.items():
        h = held.get(lease_id)
        if h is None or not h.members or all(t.task_id in tasks for t in h.members):
            gone.add(lease_id)
    return gone
