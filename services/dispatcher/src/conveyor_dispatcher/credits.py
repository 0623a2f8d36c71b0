"""Per-queue credit accounting: which gateways serve a queue and how many tasks each can take.

Credits are a gateway's free slots on the queue. The gateway is the authority: a
``Register`` sets them to ``capacity - in_flight`` and a ``DispatchReply`` sets them to its
``credits``; between those, a dispatch takes one credit per task and a ``Done{n}`` gives
``n`` back.

Replies and Dones arrive on different subscriptions, so a Done sent after a reply can be
handled before it. Taking the reply's credits as they are would then drop that Done's
slots, and with a slot or two per queue (many queues sharing a worker's concurrency) the
gateway would look full until its next Register, seconds later. So every message carries
``returned``, the gateway's running total of slots given back: a Done adds only what is
beyond the total already counted, and a snapshot (reply or Register) older than that
total gets the difference added back. (A gateway that does not count sends 0 throughout:
its Dones add ``n``, and since none of them was counted its snapshots are taken as they
are.) What is left wrong is harmless: too many credits and the gateway refuses the
surplus (the dispatcher releases it at once), too few and the next register heals it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from conveyor_dispatcher.swrr import SmoothWeightedRoundRobin


@dataclass(slots=True)
class GatewayCredits:
    """What the dispatcher knows about one gateway on one queue."""

    gateway: str
    capacity: int
    weight: int
    credits: int
    #: Monotonic time of the gateway's last Register.
    seen_at: float
    #: The gateway's running total of slots given back that these credits account for.
    returned: int = 0
    #: The process that holds the gateway's leases ("": none), named on every lease made
    #: for it (see Register.holder).
    holder: str = ""
    #: Task types the gateway takes none of for now (its circuit breakers), as of its
    #: last Register or reply.
    blocked: frozenset[str] = frozenset()
    #: Task types the gateway takes as whole aggregation groups (Register.batch_types).
    batch_types: frozenset[str] = frozenset()


class CreditBook:
    """The gateways registered on one queue, their credits, and the SWRR between them."""

    def __init__(self) -> None:
        self._gateways: dict[str, GatewayCredits] = {}
        self._rr = SmoothWeightedRoundRobin()
        #: The gateways that block some task type now.
        self._blocking: set[str] = set()

    def __len__(self) -> int:
        return len(self._gateways)

    def __contains__(self, gateway: object) -> bool:
        return gateway in self._gateways

    def get(self, gateway: str) -> GatewayCredits | None:
        """The entry of ``gateway``, if registered."""
        return self._gateways.get(gateway)

    @property
    def total(self) -> int:
        """Free slots across every gateway."""
        return sum(g.credits for g in self._gateways.values())

    def register(
        self,
        gateway: str,
        *,
        capacity: int,
        weight: int,
        in_flight: int,
        now: float,
        returned: int = 0,
        holder: str = "",
        blocked: frozenset[str] = frozenset(),
        batch_types: frozenset[str] = frozenset(),
    ) -> GatewayCredits:
        """Record (or refresh) a registration: credits = capacity - in_flight (at least 0),
        plus the slots of Dones already counted that this snapshot predates."""
        capacity = max(0, capacity)
        previous = self._gateways.get(gateway)
        counted = previous.returned if previous is not None else 0
        entry = GatewayCredits(
            gateway=gateway,
            capacity=capacity,
            weight=max(1, weight),
            credits=_clamp(capacity - max(0, in_flight) + max(0, counted - returned), capacity),
            seen_at=now,
            returned=max(counted, returned),
            holder=holder,
            blocked=blocked,
            batch_types=batch_types,
        )
        self._gateways[gateway] = entry
        self._note_blocked(entry)
        return entry

    def _note_blocked(self, entry: GatewayCredits) -> None:
        if entry.blocked:
            self._blocking.add(entry.gateway)
        else:
            self._blocking.discard(entry.gateway)

    def forget(self, gateway: str) -> bool:
        """Drop ``gateway`` (it closed or stopped answering); True when it was known."""
        self._rr.forget(gateway)
        self._blocking.discard(gateway)
        return self._gateways.pop(gateway, None) is not None

    def refill(self, gateway: str, n: int, returned: int = 0) -> bool:
        """A Done: ``n`` slots freed, ``returned`` given back in all (0: not counted, add
        ``n``). Only slots beyond the total already counted are added (capped at
        capacity). False for an unknown gateway."""
        entry = self._gateways.get(gateway)
        if entry is None:
            return False
        if returned <= 0:
            fresh = max(0, n)
        else:
            fresh = max(0, returned - entry.returned)
            entry.returned = max(entry.returned, returned)
        entry.credits = _clamp(entry.credits + fresh, entry.capacity)
        return True

    def set_credits(
        self,
        gateway: str,
        credits: int,
        *,
        returned: int,
        blocked: frozenset[str] | None = None,
    ) -> None:
        """The gateway said how many slots it had free when it had given ``returned`` back
        in all: the slots of Dones counted since then are added (clamped to 0..capacity).
        A gateway that does not count sends 0, and as the dispatcher then never counted
        any of its Dones either, its credits are taken as they are. ``blocked``: the
        types it takes none of now (None: unchanged)."""
        entry = self._gateways.get(gateway)
        if entry is not None:
            if blocked is not None and blocked != entry.blocked:
                entry.blocked = blocked
                self._note_blocked(entry)
            missed = max(0, entry.returned - returned)
            entry.credits = _clamp(credits + missed, entry.capacity)
            entry.returned = max(entry.returned, returned)

    def refund(self, slots: Iterable[str]) -> None:
        """Give back slots taken by :meth:`take_slots` and not used (fewer tasks were due
        than slots taken), one per entry, to the gateways still registered (clamped to
        their capacity)."""
        for gateway in slots:
            entry = self._gateways.get(gateway)
            if entry is not None:
                entry.credits = _clamp(entry.credits + 1, entry.capacity)

    def holder_of(self, gateway: str) -> str:
        """The holder ``gateway`` announced ("": none, or not registered)."""
        entry = self._gateways.get(gateway)
        return entry.holder if entry is not None else ""

    def any_blocked(self, gateways: Iterable[str]) -> bool:
        """True when one of ``gateways`` blocks a task type."""
        blocking = self._blocking
        return bool(blocking) and any(g in blocking for g in gateways)

    def blocked_of(self, gateway: str) -> frozenset[str]:
        """The task types ``gateway`` takes none of now (empty when not registered)."""
        entry = self._gateways.get(gateway)
        return entry.blocked if entry is not None else frozenset()

    def credits_of(self, gateway: str) -> int:
        """The credits of ``gateway`` (0 when it is not registered)."""
        entry = self._gateways.get(gateway)
        return entry.credits if entry is not None else 0

    def block(self, gateway: str) -> None:
        """Send ``gateway`` nothing more until it says otherwise (a Register, a Done): it
        did not answer a dispatch. What it has given back so far stays counted."""
        entry = self._gateways.get(gateway)
        if entry is not None:
            entry.credits = 0

    def expire(self, now: float, max_age: float) -> list[str]:
        """Forget gateways not registered for ``max_age`` seconds; return their names."""
        stale = [g.gateway for g in self._gateways.values() if now - g.seen_at >= max_age]
        for gateway in stale:
            self.forget(gateway)
        return stale

    def take(self, n: int) -> dict[str, int]:
        """Hand out up to ``n`` slots by smooth weighted round-robin over the gateways that
        still have credits, taking one credit per slot. Returns gateway -> slots, in the
        order each gateway was first picked; fewer than ``n`` in total when credits run out.
        """
        shares: dict[str, int] = {}
        for gateway in self.take_slots(n):
            shares[gateway] = shares.get(gateway, 0) + 1
        return shares

    def batch_capable(self) -> bool:
        """True when some gateway with a free slot takes aggregation batches."""
        return any(g.credits > 0 and g.batch_types for g in self._gateways.values())

    def take_any_batch_slot(self) -> str | None:
        """One slot of the gateway taking any aggregation batches with the most credits
        (then the first by name), its credit taken; None when none has room."""
        return self._take_best(lambda entry: bool(entry.batch_types))

    def take_batch_slot(self, task_type: str, *, but: Iterable[str] = ()) -> str | None:
        """One slot for an aggregation batch of ``task_type``: of the gateways that take
        that type as batches and do not block it, the one with the most credits (then
        the first by name), not one of ``but``; its credit is taken. None when none has
        room."""
        skip = set(but)
        return self._take_best(
            lambda entry: (
                task_type in entry.batch_types
                and task_type not in entry.blocked
                and entry.gateway not in skip
            )
        )

    def _take_best(self, fits: Callable[[GatewayCredits], bool]) -> str | None:
        """Take one credit of the gateway with free slots that ``fits``, the most credits
        first (then the first by name); its name, or None."""
        best: GatewayCredits | None = None
        for entry in self._gateways.values():
            if entry.credits <= 0 or not fits(entry):
                continue
            if best is None or (entry.credits, best.gateway) > (best.credits, entry.gateway):
                best = entry
        if best is None:
            return None
        best.credits -= 1
        return best.gateway

    def take_slots(self, n: int) -> list[str]:
        """:meth:`take`, slot by slot: the gateway of each slot, in the order they were
        picked (so any first k of them are split by weight too)."""
        picked: list[str] = []
        candidates = {g.gateway: g.weight for g in self._gateways.values() if g.credits > 0}
        for _ in range(n):
            if not candidates:
                break
            gateway = self._rr.pick(candidates)
            entry = self._gateways[gateway]
            entry.credits -= 1
            picked.append(gateway)
            if entry.credits <= 0:
                del candidates[gateway]
        return picked


def _clamp(credits: int, capacity: int) -> int:
    return min(capacity, max(0, credits))
